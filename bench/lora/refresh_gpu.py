"""Issue 45's sync bar taken apart: where a bound adapter's refresh spends its time.

    python3 bench/lora/refresh_gpu.py --out-dir OUT            # Qwen2.5-7B shapes, rank 16, CUDA
    python bench/lora/refresh_gpu.py --smoke --out-dir /tmp/x  # tiny shapes on CPU: the plumbing

At c770730 bench/lora/lora_gpu.py timed the trainer's sync call with the adapter bound to the
engine (AdapterBinding.refresh) at 2.1 ms, against 18.8 ms for full fine-tuning's (0.114; the
bar is 0.05). Its copies move ~0.4 GB (float32 parameters into bf16 buffers, scaling * B through
a float32 temporary): ~0.1 ms of an H200's bandwidth. This says where the rest goes. A beside
engine over random weights of the shape (built on the device, not saved) and a rank-16 adapter
on its 196 linears, bound; each way timed over --calls calls, each followed by a device
synchronisation (median, min, max):

  refresh      AdapterBinding.refresh(): the trainer's sync, engine and all
  temporaries  the copies refresh ran until 2c6f68c, restated on the bench's own buffers of the
               same shapes (the engine's are private): scaling * B into a float32 temporary per
               module, then cast and copied
  copy+scale_  what refresh runs since: one _foreach_copy_ over A and B together, then the bf16
               sB scaled in place (the float32 path's values for a power-of-two scaling);
               refresh less this is the engine's part
  flat         one copy of the same elements as one float32 tensor into one bf16 tensor: the
               floor, were the adapter and the engine's buffers each one storage
  full_floor   one bf16 copy of the shape's parameter count: the floor of a full sync's copy

and a profiler pass over refresh (kernels launched per call, their device time, host time).
Writes refresh_<gpu>.json/.md (refresh_cpu_smoke.* with --smoke), the commit named.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))
import _step_setup as setup  # bench/step's model shapes
from device_label import device_name
from measured_commit import measured_commit
from report import write_report

from yatt.rollout import BuiltinEngine, EngineConfig

LORA_RANK, LORA_ALPHA = 16, 32.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WATCHED = ("bench/lora/refresh_gpu.py", "packages/yatt-rollout/src/yatt/rollout/builtin")


@dataclass
class CopyLists:
    """A trainer's adapter (float32 parameters A [r, in], B [out, r]) and buffers of the
    engine's beside factors' shapes in the served dtype (the bench's own: the engine's are
    private to it)."""

    A_src: list[torch.Tensor] = field(default_factory=list)
    B_src: list[torch.Tensor] = field(default_factory=list)
    A_dst: list[torch.Tensor] = field(default_factory=list)
    sB_dst: list[torch.Tensor] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)  # the target modules' names, in order
    scaling: float = LORA_ALPHA / LORA_RANK

    @property
    def destinations(self) -> list[torch.Tensor]:
        return [*self.A_dst, *self.sB_dst]


def make_engine(shape: dict, device: torch.device, served: torch.dtype) -> BuiltinEngine:
    """A beside engine over random weights of `shape` (its vocabulary cut: no target lives
    there), its factors reserved at the adapter's rank, as the trainer builds it."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device(device):
        config = Qwen2Config(**{**shape, "vocab_size": 1024})
        model = AutoModelForCausalLM.from_config(config, dtype=served)
    engine_config = EngineConfig(
        max_batch_size=4,
        max_seq_len=64,
        lora_mode="beside",
        max_lora_rank=LORA_RANK,
        region_prefix="refresh",
        device=str(device),
    )
    return BuiltinEngine(model, config=engine_config)


def adapter(model: torch.nn.Module, served: torch.dtype, seed: int = 0) -> CopyLists:
    """A random rank-16 adapter on every decoder linear of `model`, as parameters on its
    device, with buffers of the beside factors' shapes."""
    lists = CopyLists()
    gen = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            device = module.weight.device
            A = torch.randn(LORA_RANK, module.in_features, generator=gen) * 0.01
            B = torch.randn(module.out_features, LORA_RANK, generator=gen) * 0.01
            lists.A_src.append(torch.nn.Parameter(A.to(device)))
            lists.B_src.append(torch.nn.Parameter(B.to(device)))
            lists.A_dst.append(torch.zeros(A.shape, dtype=served, device=device))
            lists.sB_dst.append(torch.zeros(B.shape, dtype=served, device=device))
            lists.modules.append(name)
    return lists


def live_pairs(lists: CopyLists):
    """What TorchPolicy.named_adapter_weights(live=True) yields for `lists`' parameters."""
    for name, A, B in zip(lists.modules, lists.A_src, lists.B_src, strict=True):
        yield name + ".lora_A", A
        yield name + ".lora_B", B
        yield name + ".lora_scaling", torch.tensor(lists.scaling)


@torch.no_grad()
def with_temporaries(lists: CopyLists) -> None:
    """The copies AdapterBinding.refresh ran until 2c6f68c, restated: A cast and copied;
    scaling * B in float32 (a temporary per target), then cast and copied."""
    torch._foreach_copy_(lists.A_dst, lists.A_src)
    scalings = [lists.scaling] * len(lists.B_src)  # per target, as a binding holds them
    torch._foreach_copy_(lists.sB_dst, torch._foreach_mul(lists.B_src, scalings))


@torch.no_grad()
def copy_then_scale(lists: CopyLists) -> None:
    """What BoundCopies.copy runs for a power-of-two scaling, restated: one cast-and-copy over
    A and B, then sB *= scaling in the served dtype (every rounded value as the float32
    path's)."""
    torch._foreach_copy_(lists.destinations, [*lists.A_src, *lists.B_src])
    torch._foreach_mul_(lists.sB_dst, lists.scaling)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call, device: torch.device, calls: int, warmup: int = 3) -> dict[str, float]:
    """Median, min and max seconds of call() with its device work, over `calls` calls."""
    for _ in range(warmup):
        call()
    _sync(device)
    seconds = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds)}


def one_copy(numel: int, source: torch.dtype, served: torch.dtype, device, calls: int) -> dict:
    """One tensor of `numel` elements copied into another (the buffers freed on return)."""
    src = torch.zeros(numel, dtype=source, device=device)
    dst = torch.empty(numel, dtype=served, device=device)
    return timed(lambda: dst.copy_(src), device, calls)


def profile(call, device: torch.device, calls: int = 5) -> dict[str, float]:
    """Per call: kernels launched, their device seconds, and the host seconds of the ops."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    call()
    _sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            call()
        _sync(device)
    events = prof.key_averages()
    kernels = [
        e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
    ]
    return {
        "kernels_per_call": sum(e.count for e in kernels) / calls,
        "device_s_per_call": sum(e.self_device_time_total for e in kernels) / 1e6 / calls,
        "host_ops_s_per_call": sum(
            e.self_cpu_time_total for e in events if e.key.startswith("aten::")
        )
        / 1e6
        / calls,
        "top_ops": [
            (e.key, e.count // calls, e.self_cpu_time_total / 1e6 / calls)
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
        ],
    }


def markdown(results: dict) -> str:
    rows = [
        f"# A bound adapter's refresh taken apart (issue 45's sync bar), {results['device']}",
        "",
        f"commit: {results['commit']} · shape {results['shape']}, LoRA rank {results['rank']} on "
        f"{results['num_targets']} targets ({results['adapter_bytes'] / 1e6:.1f} MB float32 "
        f"parameters, served {results['served']}) · {results['calls']} calls a way, each with "
        "a device synchronisation",
        "",
        "| way | median ms | min ms | max ms |",
        "|---|---:|---:|---:|",
    ]
    for way, t in results["ways"].items():
        rows.append(
            f"| {way} | {1e3 * t['median']:.3f} | {1e3 * t['min']:.3f} | {1e3 * t['max']:.3f} |"
        )
    p = results["profile_refresh"]
    rows += [
        "",
        f"refresh, profiled: {p['kernels_per_call']:.0f} kernels a call, their device time "
        f"{1e3 * p['device_s_per_call']:.3f} ms, host time in aten ops "
        f"{1e3 * p['host_ops_s_per_call']:.3f} ms; top host ops: "
        + ", ".join(f"{k} x{n} {1e3 * s:.3f} ms" for k, n, s in p["top_ops"]),
        "",
        f"The engine's part of a refresh (lock, checks, device selection, its synchronisation): "
        f"refresh less copy+scale_, {1e3 * results['engine_overhead_s']:.3f} ms a call.",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--shape", default="7b", choices=sorted(setup.SHAPES))
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    if args.smoke:
        device, served, args.calls, label = torch.device("cpu"), torch.float32, 3, "cpu_smoke"
        shape, args.shape = setup.TINY, "tiny"
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --smoke on CPU)")
        device, served, label = torch.device("cuda"), torch.bfloat16, device_name()
        shape = setup.SHAPES[args.shape]
    engine = make_engine(shape, device, served)
    try:
        lists = adapter(engine.model, served)
        binding = engine.bind_adapter(live_pairs(lists))
        n_src = sum(t.numel() for t in (*lists.A_src, *lists.B_src))
        ways = {
            "refresh": timed(binding.refresh, device, args.calls),
            "temporaries": timed(lambda: with_temporaries(lists), device, args.calls),
            "copy+scale_": timed(lambda: copy_then_scale(lists), device, args.calls),
            "flat": one_copy(n_src, torch.float32, served, device, args.calls),
        }
        profiled = profile(binding.refresh, device)
    finally:
        engine.close()
    ways["full_floor"] = one_copy(
        setup.count_parameters(args.shape), served, served, device, args.calls
    )
    results = {
        "device": label,
        "commit": measured_commit(WATCHED),
        "shape": args.shape,
        "rank": LORA_RANK,
        "num_targets": len(lists.A_src),
        "adapter_bytes": 4 * n_src,
        "served": str(served).removeprefix("torch."),
        "calls": args.calls,
        "ways": ways,
        "engine_overhead_s": ways["refresh"]["median"] - ways["copy+scale_"]["median"],
        "profile_refresh": profiled,
    }
    path = write_report(args.out_dir / f"refresh_{label}.md", markdown(results), data=results)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
