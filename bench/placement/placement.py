"""Placement benchmark: switch times and bytes per plan mode, and the raw move rates behind them.

    python bench/placement/placement.py                    # CUDA if available, else bookkeeping on CPU
    python bench/placement/placement.py --device cpu       # bookkeeping backend, small sizes

Two synthetic engines (rollout, GenRM) hold weights in a CPU-backed region and a KV cache in a
region without backup; the trainer is an MLP with AdamW state, offloaded as a TrainerRole. Each
mode runs `--steps` RL steps (rollout -> genrm -> train -> sync) and reports, per phase, the
median switch time and the bytes released / resident after the switch (device-wide from
torch.cuda.mem_get_info on CUDA; the roles' books on CPU). Steps after the first are timed.
Writes bench/results/placement-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from yatt.placement import (
    MemorySplit,
    Plan,
    RegionRole,
    TrainerRole,
    configure_regions,
    offload,
    onload,
    pause,
    region,
    resident_bytes,
    resume,
)

MIB = 1 << 20
RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results
PHASES = ("rollout", "genrm", "train", "sync")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _used_bytes(device: str) -> int | None:
    if device != "cuda":
        return None
    _sync()
    free, total = torch.cuda.mem_get_info()
    return total - free


def build_engine(name: str, weights_mib: int, kv_mib: int, device: str) -> tuple[RegionRole, list]:
    """An engine stand-in: weights survive a pause (CPU backup), the KV cache does not."""
    with region(f"{name}/weights", enable_cpu_backup=True):
        weights = torch.randint(0, 255, (weights_mib * MIB,), dtype=torch.uint8, device=device)
    with region(f"{name}/kv_cache"):
        kv = torch.zeros(kv_mib * MIB, dtype=torch.uint8, device=device)
    role = RegionRole({"weights": (f"{name}/weights",), "kv_cache": (f"{name}/kv_cache",)})
    return role, [weights, kv]


def build_trainer(hidden: int, num_layers: int, device: str) -> TrainerRole:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(hidden, hidden, device=device) for _ in range(num_layers)]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # One step so gradients and both AdamW moments exist, as in a real trainer.
    model(torch.randn(8, hidden, device=device)).square().mean().backward()
    optimizer.step()
    return TrainerRole(model, optimizer)


def measure_primitives(device: str, engine_tags: dict[str, str], trainer: TrainerRole) -> dict:
    """GB/s of pause/resume with and without CPU backup, and of trainer offload/onload."""
    out = {}
    for label, tag in engine_tags.items():
        num_bytes = resident_bytes(tag)
        before = _used_bytes(device)
        start = time.perf_counter()
        pause(tag)
        _sync()
        paused = time.perf_counter()
        after = _used_bytes(device)
        resume(tag)
        _sync()
        resumed = time.perf_counter()
        out[label] = {
            "bytes": num_bytes,
            "pause_s": paused - start,
            "resume_s": resumed - paused,
            "pause_gbps": num_bytes / max(paused - start, 1e-9) / 1e9,
            "resume_gbps": num_bytes / max(resumed - paused, 1e-9) / 1e9,
            "released_fraction": None if before is None else (before - after) / max(num_bytes, 1),
        }
    parts = {"trainer_weights": trainer.model, "trainer_optimizer": trainer.optimizer}
    for label, part in parts.items():
        before = _used_bytes(device)
        start = time.perf_counter()
        num_bytes = offload(part)
        offloaded = time.perf_counter()
        after = _used_bytes(device)
        onload(part)
        onloaded = time.perf_counter()
        out[label] = {
            "bytes": num_bytes,
            "offload_s": offloaded - start,
            "onload_s": onloaded - offloaded,
            "offload_gbps": num_bytes / max(offloaded - start, 1e-9) / 1e9,
            "onload_gbps": num_bytes / max(onloaded - offloaded, 1e-9) / 1e9,
            "released_fraction": None if before is None else (before - after) / max(num_bytes, 1),
        }
    return out


def run_mode(mode: str, roles: dict, steps: int) -> dict:
    if mode == "full_colocation":
        plan = Plan.full_colocation(**roles)
    elif mode == "partial_colocation":
        plan = Plan.partial_colocation(**roles, split=MemorySplit())
    else:
        plan = Plan.separate(**roles)
    for step in range(steps):
        for phase in PHASES:
            with plan.phase(phase):
                pass
        if mode == "partial_colocation":
            # A synthetic load that swings between the engines, to exercise the split.
            plan.update_load(
                rollout_pending_tokens=1000 * (step % 3 + 1), genrm_pending_tokens=1500
            )
    # Every role awake again, as the next mode expects.
    for name in ("rollout", "genrm", "train"):
        roles[name].wake_up()
    # The first step's records pay for first-touch costs (pinned buffers, pools); skip them.
    timed = list(plan.records)[len(PHASES) :] or list(plan.records)
    result = {}
    for phase in PHASES:
        records = [r for r in timed if r.phase == phase]
        result[phase] = {
            "switch_s": statistics.median(r.switch_s for r in records),
            "sleep_s": statistics.median(r.sleep_s for r in records),
            "wake_s": statistics.median(r.wake_s for r in records),
            "released_bytes": records[-1].released_bytes,
            "woken_bytes": records[-1].woken_bytes,
            "resident_bytes": records[-1].resident_bytes,
        }
    result["metrics"] = plan.metrics()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rollout-weights-mib", type=int, default=None)
    parser.add_argument("--rollout-kv-mib", type=int, default=None)
    parser.add_argument("--genrm-weights-mib", type=int, default=None)
    parser.add_argument("--genrm-kv-mib", type=int, default=None)
    parser.add_argument("--train-hidden", type=int, default=None)
    parser.add_argument("--train-layers", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    configure_regions(backend=device)
    # GPU defaults fit all three roles resident at once (the separate baseline) on one 80 GB
    # card: 20 GiB rollout, 10 GiB GenRM, a ~4 GiB trainer (weights, grads, AdamW moments).
    big = device == "cuda"
    device_name = torch.cuda.get_device_name() if big else f"{platform.machine()} x{os.cpu_count()}"
    sizes = {
        "rollout_weights_mib": args.rollout_weights_mib or (4096 if big else 8),
        "rollout_kv_mib": args.rollout_kv_mib or (16384 if big else 32),
        "genrm_weights_mib": args.genrm_weights_mib or (2048 if big else 4),
        "genrm_kv_mib": args.genrm_kv_mib or (8192 if big else 16),
        "train_hidden": args.train_hidden or (4096 if big else 256),
        "train_layers": args.train_layers or (16 if big else 4),
    }

    rollout, rollout_tensors = build_engine(
        "rollout", sizes["rollout_weights_mib"], sizes["rollout_kv_mib"], device
    )
    genrm, genrm_tensors = build_engine(
        "genrm", sizes["genrm_weights_mib"], sizes["genrm_kv_mib"], device
    )
    trainer = build_trainer(sizes["train_hidden"], sizes["train_layers"], device)
    roles = {"rollout": rollout, "genrm": genrm, "train": trainer}

    primitives = measure_primitives(
        device,
        {"pause_weights_cpu_backup": "rollout/weights", "pause_kv_no_backup": "rollout/kv_cache"},
        trainer,
    )
    modes = {
        mode: run_mode(mode, roles, args.steps)
        for mode in ("separate", "full_colocation", "partial_colocation")
    }

    print(f"device={device} ({device_name})")
    print(f"{'primitive':<28}{'MiB':>10}{'out s':>9}{'back s':>9}{'out GB/s':>10}{'released':>10}")
    for label, row in primitives.items():
        out_s = row.get("pause_s", row.get("offload_s"))
        back_s = row.get("resume_s", row.get("onload_s"))
        gbps = row.get("pause_gbps", row.get("offload_gbps"))
        released = row["released_fraction"]
        released_text = "n/a" if released is None else f"{released:.3f}"
        print(
            f"{label:<28}{row['bytes'] / MIB:>10.1f}{out_s:>9.3f}{back_s:>9.3f}"
            f"{gbps:>10.1f}{released_text:>10}"
        )
    print(f"\n{'mode':<20}{'phase':<9}{'switch s':>10}{'released MiB':>14}{'resident MiB':>14}")
    for mode, result in modes.items():
        for phase in PHASES:
            row = result[phase]
            print(
                f"{mode:<20}{phase:<9}{row['switch_s']:>10.3f}"
                f"{row['released_bytes'] / MIB:>14.1f}{row['resident_bytes'] / MIB:>14.1f}"
            )

    report = {
        "device": device,
        "device_name": device_name,
        "torch": torch.__version__,
        "steps": args.steps,
        "sizes": sizes,
        "primitives": primitives,
        "modes": modes,
    }
    out = args.out or RESULTS / f"placement-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    del rollout_tensors, genrm_tensors


if __name__ == "__main__":
    main()
