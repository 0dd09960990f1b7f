"""Benchmark of yatt.balance.partition against plain Karmarkar-Karp and greedy LPT.

    python bench/balance/balance.py            # full grid, writes bench/results/balance_cpu.{json,md}
    python bench/balance/balance.py --quick    # n <= 1024 only, for a smoke run

Items are sequences whose cost is the forward FLOPs of a Qwen2.5-7B-shaped model
(flops_cost), lengths drawn from: uniform, lognormal (long tail), bimodal (short answers plus
long chains of thought), and GRPO-grouped (a difficulty per prompt, 8 or 16 responses per
prompt kept together). Imbalance = heaviest part / mean part; the lower bound is
max(mean, largest item or group) / mean. Times are medians of repeated runs in this process.
Bar: n=4096, k=64, lognormal: imbalance <= 1.005 and median time <= 20 ms; yatt never worse
than plain KK anywhere.

Locality (yatt.balance.across_ranks.rebalance's plan, k=8 ranks, each rank's samples drawn from the
distribution as if it had generated them): the fraction of samples (and of tokens) the plan
moves to another rank, before (balanced partition, each part to the rank holding most of it)
and after (fewest moves within tolerance=1e-3 of that partition's heaviest part), and both
plans' imbalance.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from yatt.balance import flops_cost, imbalance, partition
from yatt.balance.across_ranks import make_plan, partition_destination

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from report import write_report

QWEN25_7B = dict(
    hidden_size=3584, num_layers=28, ffn_hidden_size=18944, num_heads=28, num_kv_heads=4,
    vocab_size=152064, is_gated_mlp=True,
)  # fmt: skip
MAX_LEN = 32768
RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results


def draw_lengths(
    dist: str, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray | None]:
    """(lengths, group label per item or None)."""
    if dist == "uniform":
        lengths = rng.uniform(64, 8192, n)
    elif dist == "lognormal":
        lengths = rng.lognormal(math.log(1024), 1.0, n)
    elif dist == "bimodal":
        long = rng.random(n) < 0.2
        lengths = np.where(long, rng.normal(12000, 2000, n), rng.normal(512, 128, n))
    elif dist.startswith("grpo"):
        size = int(dist.removeprefix("grpo-g"))
        num_groups = n // size
        difficulty = rng.lognormal(math.log(1024), 0.8, num_groups)  # per prompt
        lengths = np.repeat(difficulty, size) * rng.lognormal(0.0, 0.5, num_groups * size)
        return np.clip(np.round(lengths), 16, MAX_LEN), np.repeat(np.arange(num_groups), size)
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    return np.clip(np.round(lengths), 16, MAX_LEN), None


def heaviest(parts: list[list[int]], costs: np.ndarray) -> float:
    return max(math.fsum(costs[p].tolist()) for p in parts)


def timed(fn, repeats: int) -> tuple[list[list[int]], float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return out, statistics.median(times) * 1e3


def run_case(dist: str, n: int, k: int, repeats: int, equal_size: bool = False) -> dict:
    rng = np.random.default_rng([n, *dist.encode()])  # same draw for every k and run
    lengths, groups = draw_lengths(dist, n, rng)
    costs = flops_cost(lengths, **QWEN25_7B)
    row: dict = {"dist": dist + (" equal_size" if equal_size else ""), "n": n, "k": k}
    for method in ("auto", "kk", "greedy"):
        parts, ms = timed(
            lambda m=method: partition(costs, k, groups=groups, equal_size=equal_size, method=m),
            repeats,
        )
        row[method] = {
            "imbalance": imbalance(parts, costs),
            "heaviest": heaviest(parts, costs),
            "ms": ms,
        }
    unit = costs if groups is None else np.bincount(groups, weights=costs)
    row["lower_bound"] = max(costs.sum() / k, unit.max()) / (costs.sum() / k)
    return row


def run_locality_case(dist: str, per_rank: int, k: int, repeats: int) -> dict:
    rng = np.random.default_rng([per_rank, k, *dist.encode()])
    lengths, groups = [], []
    for r in range(k):
        scale = 2.0 if dist == "uniform, rank 0 x2" and r == 0 else 1.0
        length, label = draw_lengths(dist.split(",")[0], per_rank, rng)
        lengths.append(np.clip(np.round(length * scale), 16, MAX_LEN))
        groups.append(label)
    costs = [flops_cost(x, **QWEN25_7B) for x in lengths]
    plan, ms = timed(
        lambda: make_plan(
            rank=0, costs=costs, volumes=lengths, group_labels=groups, equal_size=False
        ),
        repeats,
    )
    all_costs, all_lengths = np.concatenate(costs), np.concatenate(lengths)
    origin = np.repeat(np.arange(k), per_rank)
    labels = None
    if groups[0] is not None:
        labels = np.concatenate([g + r * per_rank for r, g in enumerate(groups)])
    parts = partition(all_costs, k, groups=labels)
    old = partition_destination(parts, origin, all_lengths, k)
    row: dict = {"dist": dist, "n": per_rank * k, "k": k, "plan_ms": ms}
    for name, dest in (("old", old), ("new", plan.destination)):
        moved = dest != origin
        row[name] = {
            "moved_samples": float(moved.mean()),
            "moved_tokens": float(all_lengths[moved].sum() / all_lengths.sum()),
            "imbalance": imbalance([np.flatnonzero(dest == r) for r in range(k)], all_costs),
        }
    return row


def locality_markdown(rows: list[dict]) -> str:
    lines = [
        "| dist | n | k | moved samples: old | new | moved tokens: old | new "
        "| imbalance: old | new | plan ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dist']} | {r['n']} | {r['k']} | {r['old']['moved_samples']:.3f} | "
            f"{r['new']['moved_samples']:.3f} | {r['old']['moved_tokens']:.3f} | "
            f"{r['new']['moved_tokens']:.3f} | {r['old']['imbalance']:.5f} | "
            f"{r['new']['imbalance']:.5f} | {r['plan_ms']:.1f} |"
        )
    return "\n".join(lines)


def to_markdown(rows: list[dict]) -> str:
    lines = [
        "| dist | n | k | yatt | plain KK | greedy LPT | lower bound | yatt ms | KK ms | LPT ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dist']} | {r['n']} | {r['k']} | {r['auto']['imbalance']:.5f} | "
            f"{r['kk']['imbalance']:.5f} | {r['greedy']['imbalance']:.5f} | {r['lower_bound']:.5f} | "
            f"{r['auto']['ms']:.1f} | {r['kk']['ms']:.1f} | {r['greedy']['ms']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n <= 1024 only; writes nothing")
    args = parser.parse_args()
    dists = ["uniform", "lognormal", "bimodal", "grpo-g8", "grpo-g16"]
    sizes = [256, 1024] if args.quick else [256, 1024, 4096, 16384]
    rows = []
    for dist in dists:
        for n in sizes:
            for k in (8, 64, 256):
                repeats = (
                    21 if (dist, n, k) == ("lognormal", 4096, 64) else (3 if n >= 16384 else 5)
                )
                rows.append(run_case(dist, n, k, repeats))
    # Not in the grid of the bar: equal_size (same count per rank), where plain KK's
    # start from runs of k sorted items is weakest.
    for dist in ("lognormal", "grpo-g8"):
        for k in (8, 64):
            rows.append(run_case(dist, sizes[-1] if args.quick else 4096, k, 5, equal_size=True))
    table = to_markdown(rows)
    never_worse = all(r["auto"]["heaviest"] <= r["kk"]["heaviest"] for r in rows)
    bar_row = next(
        (r for r in rows if (r["dist"], r["n"], r["k"]) == ("lognormal", 4096, 64)), None
    )
    lines = [table, ""]
    bar_ok = None
    if bar_row is not None:
        bar_ok = bar_row["auto"]["imbalance"] <= 1.005 and bar_row["auto"]["ms"] <= 20.0
        lines.append(
            f"bar (n=4096, k=64, lognormal): imbalance {bar_row['auto']['imbalance']:.6f} <= 1.005, "
            f"median {bar_row['auto']['ms']:.1f} ms <= 20 ms: {'PASS' if bar_ok else 'FAIL'}"
        )
    lines.append(
        f"yatt never worse than plain KK on all {len(rows)} cases: {'PASS' if never_worse else 'FAIL'}"
    )
    wins = sum(r["auto"]["heaviest"] < r["kk"]["heaviest"] * (1 - 1e-6) for r in rows)
    lines.append(f"yatt strictly better than plain KK (by > 1e-6) on {wins} of {len(rows)} cases")
    local_rows = [
        run_locality_case(dist, per_rank, 8, 5)
        for dist in ("uniform", "lognormal", "bimodal", "grpo-g8", "uniform, rank 0 x2")
        for per_rank in (32, 512)
    ]
    worst = max(
        r["new"]["moved_samples"] / max(r["old"]["moved_samples"], 1e-9) for r in local_rows
    )
    within = all(
        r["new"]["imbalance"] <= r["old"]["imbalance"] * (1 + 1e-3) + 1e-12 for r in local_rows
    )
    lines += [
        "",
        "locality of the rebalance plan (k=8 ranks, tolerance=1e-3; old = balanced partition "
        "mapped to ranks):",
        "",
        locality_markdown(local_rows),
        "",
        "moved-sample fraction old vs new: "
        + ", ".join(
            f"{r['dist']} n={r['n']}: {r['old']['moved_samples']:.2f} -> "
            f"{r['new']['moved_samples']:.2f}"
            for r in local_rows
        ),
        f"new moves at most {worst:.2f}x the old samples; imbalance within 1e-3 of old "
        f"everywhere: {'PASS' if within else 'FAIL'}",
    ]
    report = "\n".join(lines)
    print(report)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        meta = {
            "machine": platform.machine(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "cost_model": "flops_cost, Qwen2.5-7B shape",
        }
        out = {
            "meta": meta,
            "rows": rows,
            "bar_ok": bar_ok,
            "never_worse_than_kk": never_worse,
            "locality_rows": local_rows,
            "locality_within_tolerance": within,
        }
        write_report(RESULTS / "balance_cpu.md", report, data=out)


if __name__ == "__main__":
    main()
