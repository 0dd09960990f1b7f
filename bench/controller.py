"""Per-rank controllers (yatt) against a single controller, with multimodal prompts, on CPU.

    python bench/controller.py                      # 1, 2 and 4 ranks; ~1-2 minutes on 2 cores
    python bench/controller.py --ranks 1 2 4 8 --prompts-per-rank 32 --steps 3

Every prompt carries a 3x448x448 uint8 image (588 KiB), stored as an .npy file that the
dataset row points to, as LLaVA-style JSONL datasets do. One step, per mode:

    yatt          every rank: ShardedLoader reads its own rows -> decodes its own images
                  -> processes them -> all-reduces scalar stats
    yatt+balance  as yatt, plus Batch.rebalance by length before processing (yatt.balance.dist
                  moves the samples its plan moves, images included, point-to-point)
    baseline      rank 0 (the "driver"): reads every rank's rows -> decodes every image
                  -> scatter_object_list to the ranks (pickled, as a Ray driver ships objects)
                  every rank: processes its share -> gather_object of stats to rank 0

Measured in each process: peak RSS during the steps above its RSS just before them (VmHWM after
clear_refs; imports and the process group are excluded), and the step time (max over ranks).
Workers run with MALLOC_MMAP_THRESHOLD_ fixed at 64 KiB: glibc otherwise raises the threshold
after the first freed image and keeps later images on its heap after they are freed, so RSS
would track the allocator's history instead of the live payloads. The busiest process is the
one with the largest peak. The bar: yatt's busiest-process peak stays flat as ranks grow (slope
under a quarter of one rank's payload per added rank) while the baseline's grows linearly (at
least one rank's payload per added rank). yatt+balance is reported, not judged: what it adds
is what the balancing plan moves, bounded by about two batches (received + send buffer).
Writes bench/results/controller_cpu.json and controller_cpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

IMAGE_SHAPE = (3, 448, 448)
RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("yatt", "yatt+balance", "baseline")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    # Writing 5 resets VmHWM to the current RSS (Linux >= 4.0), so the peak excludes start-up.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _make_dataset(root: Path, num_rows: int, num_images: int) -> Path:
    rng = np.random.default_rng(0)
    for i in range(num_images):
        np.save(root / f"img{i}.npy", rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8))
    path = root / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(num_rows):
            image = str(root / f"img{i % num_images}.npy")
            f.write(json.dumps({"prompt": f"Describe image {i}.", "image": image}) + "\n")
    return path


def _decode(row: dict) -> dict:
    """A sample: its image (a fresh array per row, as a decoder produces) and token ids."""
    import torch

    image = np.load(row["image"])
    length = 64 + (row["_index"] * 37) % 448  # prompt + response tokens, varied
    return {"input_ids": torch.arange(length) % 200, "image": image, "row": row["_index"]}


def _process(samples: list[dict]) -> float:
    """Stand-in for per-sample work on the payload: normalise each image, one at a time."""
    import torch

    total = 0.0
    for sample in samples:
        total += float(torch.from_numpy(sample["image"]).float().div_(255.0).mean())
    return total


def worker(mode: str, data: str, prompts_per_rank: int, steps: int, out: str) -> None:
    import torch.distributed as dist

    from yatt.core import Batch, ShardedLoader, init_runtime, reduce_metrics

    with init_runtime(device="cpu") as rt:
        rank, world = rt.dp_rank, rt.dp_size
        group = rt.dp_group
        if mode != "baseline":
            loader = ShardedLoader(
                data, batch_size=prompts_per_rank, rank=rank, world_size=world, image_key="image"
            )
        elif rank == 0:
            loader = ShardedLoader(data, batch_size=prompts_per_rank * world, image_key="image")
        # Import what the steps import lazily, so the peak counts data, not code.
        import yatt.balance.dist  # noqa: F401

        reduce_metrics({"warm": 0.0}, group=group)
        dist.barrier()
        start_rss = _rss_kib("VmRSS")
        _reset_peak()
        times = []
        moved_in: list[int] = []  # samples balancing brought to this rank, per step
        for _ in range(steps):
            t0 = time.perf_counter()
            if mode != "baseline":
                samples = [_decode(row) for row in loader.next_batch()]
                batch = Batch.from_samples(samples)
                if mode == "yatt+balance":
                    own = set(batch["row"].tolist())
                    # Images (numpy) ride in meta; only the samples the plan moves travel.
                    batch, _ = batch.rebalance(group=group)
                    moved_in.append(sum(r not in own for r in batch["row"].tolist()))
                score = _process(batch.to_samples())
                reduce_metrics({"score": score}, group=group, default_op="sum")
                del samples, batch
            else:
                chunks = None
                if rank == 0:
                    samples = [_decode(row) for row in loader.next_batch()]
                    chunks = [samples[r::world] for r in range(world)]
                received = [None]
                dist.scatter_object_list(received, chunks, src=0, group=group)
                del chunks
                samples = None
                score = _process(received[0])
                gathered = [None] * world if rank == 0 else None
                dist.gather_object(score, gathered, dst=0, group=group)
                del received
            dist.barrier()
            times.append(time.perf_counter() - t0)
        peak = _rss_kib("VmHWM")
        result = {
            "rank": rank,
            "peak_above_start_mib": (peak - start_rss) / 1024,
            "times": times,
            "moved_in": moved_in,
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def launch(mode: str, world: int, data: Path, args: argparse.Namespace) -> dict:
    from yatt.testing import run_ranks  # here: the workers need not import it

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--worker", mode, str(data), out]
        cmd += ["--prompts-per-rank", str(args.prompts_per_rank), "--steps", str(args.steps)]
        env = {"CUDA_VISIBLE_DEVICES": "", "MALLOC_MMAP_THRESHOLD_": "65536"}
        run_ranks(cmd, world, env=env, timeout_s=600)  # fails with each failed rank's output
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    # The first step pays one-time costs (page cache, allocator growth); report the others.
    step_times = [max(r["times"][s] for r in ranks) for s in range(1, args.steps)]
    peaks = [r["peak_above_start_mib"] for r in ranks]
    return {
        "mode": mode,
        "ranks": world,
        "busiest_peak_mib": max(peaks),
        "busiest_rank": int(np.argmax(peaks)),
        "per_rank_peak_mib": peaks,
        "step_s": float(np.median(step_times)),
        "max_moved_in_per_step": max((max(r["moved_in"], default=0) for r in ranks), default=0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prompts-per-rank", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "DATA", "OUT"))
    args = parser.parse_args()
    if args.worker:
        mode, data, out = args.worker
        worker(mode, data, args.prompts_per_rank, args.steps, out)
        return

    rows_needed = max(args.ranks) * args.prompts_per_rank * args.steps
    image_mib = int(np.prod(IMAGE_SHAPE)) / 2**20
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        data = _make_dataset(Path(root), rows_needed + max(args.ranks), num_images=16)
        for world in args.ranks:
            for mode in MODES:
                results.append(launch(mode, world, data, args))
                r = results[-1]
                print(
                    f"{mode:12s} ranks={world}  busiest peak {r['busiest_peak_mib']:7.1f} MiB"
                    f"  (rank {r['busiest_rank']})  step {r['step_s']:.3f} s",
                    flush=True,
                )
    by = {(r["mode"], r["ranks"]): r for r in results}
    # One rank's decoded payload per step: the unit in which growth is judged.
    share_mib = args.prompts_per_rank * image_mib
    slope = {
        m: float(np.polyfit(args.ranks, [by[m, w]["busiest_peak_mib"] for w in args.ranks], 1)[0])
        for m in MODES
    }
    # Flat: each added rank adds under a quarter of one rank's payload to yatt's busiest
    # process; linear: the driver gains at least one full share per added rank.
    passed = slope["yatt"] < 0.25 * share_mib and slope["baseline"] >= share_mib
    summary = {
        "config": {
            "prompts_per_rank": args.prompts_per_rank,
            "steps": args.steps,
            "image_shape": list(IMAGE_SHAPE),
            "image_mib": image_mib,
            "cpu_count": os.cpu_count(),
        },
        "results": results,
        "payload_share_mib": share_mib,
        "peak_slope_mib_per_rank": slope,
        "bar": "busiest-process peak slope per added rank: yatt < 0.25 share, baseline >= 1 share",
        "passed": passed,
        "wall_s": time.perf_counter() - t0,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "controller_cpu.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "# Controller memory: per-rank controllers (yatt) vs one driver (baseline), CPU",
        "",
        f"{args.prompts_per_rank} prompts per rank per step, each with a {IMAGE_SHAPE} uint8 image "
        f"({image_mib * 1024:.0f} KiB); peak RSS above each process's start, busiest process; "
        f"median step time over steps 2..{args.steps} (max over ranks). "
        f"{os.cpu_count()} CPU cores, gloo; with more ranks than cores the step times "
        "include time-sharing, for both modes alike.",
        "",
        "| ranks | busiest peak (MiB): yatt | yatt+balance | baseline "
        "| step (s): yatt | yatt+balance | baseline | samples moved in (max) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world in args.ranks:
        y, yb, b = (by[m, world] for m in MODES)
        lines.append(
            f"| {world} | {y['busiest_peak_mib']:.1f} | {yb['busiest_peak_mib']:.1f} "
            f"| {b['busiest_peak_mib']:.1f} | {y['step_s']:.3f} | {yb['step_s']:.3f} "
            f"| {b['step_s']:.3f} | {yb['max_moved_in_per_step']} of {args.prompts_per_rank} |"
        )
    lines += [
        "",
        "yatt: each rank loads, decodes and processes its own shard. yatt+balance: also "
        "rebalances the samples (with their images) by length through yatt.balance.dist. "
        "baseline: rank 0 loads and decodes every image and scatters them (pickled).",
        "",
        f"Busiest-process peak per added rank (least squares): yatt {slope['yatt']:.1f} MiB, "
        f"yatt+balance {slope['yatt+balance']:.1f} MiB, baseline {slope['baseline']:.1f} MiB; "
        f"one rank's decoded payload per step is {share_mib:.1f} MiB. "
        f"Bar (yatt < 0.25 share, baseline >= 1 share): {'PASS' if passed else 'FAIL'}.",
        "",
    ]
    (RESULTS / "controller_cpu.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
