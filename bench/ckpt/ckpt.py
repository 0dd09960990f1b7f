"""How long a checkpoint blocks the training loop: async vs synchronous save, side by side.

    python bench/ckpt/ckpt.py                          # ~1 GB CPU state, writes bench/results/ckpt_cpu.json
    python bench/ckpt/ckpt.py --size-mb 128 --repeats 2    # quick check
    python bench/ckpt/ckpt.py --device cuda            # state on the GPU, writes bench/results/ckpt_cuda.json

The state is a stack of bias-free Linear layers plus AdamW (params + exp_avg + exp_avg_sq, so
~3x the parameter bytes). Each round does one synchronous save, then one async save; "blocked" is
the time the `save` call takes (for async: state_dict + copy into CPU staging buffers), and the
async end-to-end time is save + wait (write, fsync, commit). The first async save allocates the
staging buffers and is reported apart from the median. Bar: median async blocked time
<= 15% of the median synchronous save time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from yatt.ckpt import Checkpointer

BAR_RATIO = 0.15
HIDDEN = 2048


def build_state(size_mb: float, device: str) -> tuple[dict, int]:
    bytes_per_layer = 3 * 4 * HIDDEN * HIDDEN  # fp32 weight + AdamW's two moments
    num_layers = max(1, round(size_mb * 2**20 / bytes_per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(num_layers)])
    model.to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one step creates the AdamW moments
        p.grad = torch.randn_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    num_bytes = sum(3 * p.numel() * p.element_size() for p in model.parameters())
    return {"model": model, "optim": optim}, num_bytes


def touch(state: dict) -> None:
    """Stand-in for a training step between saves: the state changes, so staging must copy."""
    with torch.no_grad():
        for p in state["model"].parameters():
            p.mul_(0.999)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(size_mb: float, device: str, repeats: int, root: Path) -> dict:
    state, num_bytes = build_state(size_mb, device)
    sync_ckpt = Checkpointer(root / "sync", keep_last=1, async_save=False)
    async_ckpt = Checkpointer(root / "async", keep_last=1, async_save=True)
    sync_s, async_blocked_s, async_total_s = [], [], []
    first_async_blocked_s = first_async_total_s = None
    try:
        for step in range(repeats + 1):
            touch(state)
            sync_time = timed(lambda step=step: sync_ckpt.save(step, state))
            touch(state)
            t0 = time.perf_counter()
            async_ckpt.save(step, state)
            blocked = time.perf_counter() - t0
            async_ckpt.wait()
            total = time.perf_counter() - t0
            if step == 0:  # warm-up: page cache, staging buffer allocation
                first_async_blocked_s, first_async_total_s = blocked, total
                continue
            sync_s.append(sync_time)
            async_blocked_s.append(blocked)
            async_total_s.append(total)
    finally:
        sync_ckpt.close()
        async_ckpt.close()
    sync_med = statistics.median(sync_s)
    blocked_med = statistics.median(async_blocked_s)
    total_med = statistics.median(async_total_s)
    mb = num_bytes / 1e6
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_avg_1min_at_end": round(os.getloadavg()[0], 2),  # a shared host inflates timings
        "state_mb": round(mb, 1),
        "repeats": repeats,
        "sync_save_s": [round(x, 4) for x in sync_s],
        "async_blocked_s": [round(x, 4) for x in async_blocked_s],
        "async_total_s": [round(x, 4) for x in async_total_s],
        "first_async_blocked_s": round(first_async_blocked_s, 4),
        "first_async_total_s": round(first_async_total_s, 4),
        "median_sync_save_s": round(sync_med, 4),
        "median_async_blocked_s": round(blocked_med, 4),
        "median_async_total_s": round(total_med, 4),
        "blocked_ratio": round(blocked_med / sync_med, 4),
        "bar_ratio": BAR_RATIO,
        "meets_bar": blocked_med <= BAR_RATIO * sync_med,
        "sync_write_mb_per_s": round(mb / sync_med, 1),
        "async_write_mb_per_s": round(mb / total_med, 1),
        "staging_mb_per_s": round(mb / blocked_med, 1),
    }


def print_table(r: dict) -> None:
    print(
        f"\nstate {r['state_mb']} MB on {r['device']} ({r['device_name']}), median of {r['repeats']}\n"
    )
    print("| mode | loop blocked (s) | save end-to-end (s) | write MB/s |")
    print("|---|---|---|---|")
    print(
        f"| sync | {r['median_sync_save_s']} | {r['median_sync_save_s']} | {r['sync_write_mb_per_s']} |"
    )
    print(
        f"| async | {r['median_async_blocked_s']} | {r['median_async_total_s']} | "
        f"{r['async_write_mb_per_s']} |"
    )
    print(
        f"\nblocked ratio async/sync = {r['blocked_ratio']} (bar <= {r['bar_ratio']}: "
        f"{'met' if r['meets_bar'] else 'NOT met'}); first async save blocked "
        f"{r['first_async_blocked_s']} s (staging buffers allocated)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size-mb", type=float, default=1024.0, help="state size (model + AdamW)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed saves per mode after a warm-up"
    )
    parser.add_argument(
        "--root", type=Path, default=None, help="checkpoint folder (default: a temp dir)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default bench/results/ckpt_<device>.json)",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; run on the GPU machine or use --device cpu")
    out = args.out or Path(__file__).resolve().parents[1] / "results" / f"ckpt_{args.device}.json"
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        result = run(args.size_mb, args.device, args.repeats, Path(tmp))
    print_table(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
