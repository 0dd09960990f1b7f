"""Batch.rebalance and Batch.restore at 4096 samples on CPU: the padded batch moved as rows
(now) against the per-sample dicts it used to go through (before Batch.rebalance).

    python bench/balance/rebalance.py                  # 4 gloo ranks x 1024 samples, 9 repeats
    python bench/balance/rebalance.py --repeats 3 --samples-per-rank 256 --no-write   # a smoke run

Each rank holds a trainer's batch: input_ids and loss_mask (int64), rollout_logprobs and
advantages (float32, per token), group_id and reward per sample; GRPO groups of 8 kept whole
(group_key), lengths long-tailed (lognormal, median 384) up to 2048 tokens. Cases: every rank
drawn alike at the default tolerance (the trainer's call: the plan moves a few samples), rank
0's samples twice as long (some move), and rank 0's four times as long at tolerance=0 (the best
balance whatever the movement: the plan falls back to the balanced partition and most move).

    old  Batch.to_samples() -> yatt.balance.across_ranks.rebalance (a list of dicts) ->
         Batch.from_samples (pads again); restore likewise. Kept here only as a reference.
    new  Batch.rebalance / Batch.restore: yatt.balance.across_ranks.rebalance_rows moves the rows a
         plan moves, one payload of packed columns per peer, and the batch is padded once.

Per repeat, old and new run back to back (their order alternating), each after a barrier; a
call's time is the slowest rank's. Reported: medians over repeats, new / old, and whether both
paths gave identical batches. Writes bench/results/rebalance_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from yatt.balance.across_ranks import rebalance, restore
from yatt.core import Batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from measured_commit import measured_commit
from report import write_report

RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results
MAX_LEN = 2048
GROUP_SIZE = 8
CASES = {
    "alike, tolerance 1e-3": {"skew": 1.0, "tolerance": 1e-3},
    "rank 0 x2 longer, tolerance 1e-3": {"skew": 2.0, "tolerance": 1e-3},
    "rank 0 x4 longer, tolerance 0": {"skew": 4.0, "tolerance": 0.0},
}


# -- the path before Batch.rebalance (reference only; the library no longer has it) ---------------

_ARRAY_TAG = "__yatt_ndarray__"


def _wrap_arrays(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def wrap(value: Any) -> Any:
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable.*")
                return (_ARRAY_TAG, torch.from_numpy(np.ascontiguousarray(value)))
        return value

    return [{k: wrap(v) for k, v in row.items()} for row in rows]


def _unwrap_arrays(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def unwrap(value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == 2 and value[0] == _ARRAY_TAG:
            return value[1].numpy()
        return value

    return [{k: unwrap(v) for k, v in row.items()} for row in rows]


def old_rebalance(
    batch: Batch, *, group_key: str, tolerance: float, group: Any = None
) -> tuple[Batch, Any]:
    """Batch.rebalance as it was: per-sample dicts moved by yatt.balance.across_ranks.rebalance."""
    groups = batch[group_key].tolist()
    rows, plan = rebalance(
        _wrap_arrays(batch.to_samples()),
        batch.lengths.tolist(),
        group=group,
        groups=groups,
        tolerance=tolerance,
    )
    return Batch.from_samples(_unwrap_arrays(rows), token_keys=batch.token_keys, like=batch), plan


def old_restore(batch: Batch, plan: Any, *, group: Any = None) -> Batch:
    """Batch.restore as it was."""
    rows = restore(_wrap_arrays(batch.to_samples()), plan, group=group)
    return Batch.from_samples(_unwrap_arrays(rows), token_keys=batch.token_keys, like=batch)


# -- one rank ----------------------------------------------------------------------------------


def make_batch(rank: int, num_samples: int, skew: float) -> Batch:
    rng = np.random.default_rng([rank, num_samples])
    lengths = rng.lognormal(np.log(384), 0.9, num_samples) * (skew if rank == 0 else 1.0)
    lengths = np.clip(np.round(lengths), 16, MAX_LEN).astype(np.int64)
    lengths_B = torch.from_numpy(lengths)
    width = int(lengths.max())
    mask_BT = torch.arange(width)[None, :] < lengths_B[:, None]
    gen = torch.Generator().manual_seed(rank)
    prompt_B = torch.clamp(lengths_B // 4, max=256)
    loss_mask = (torch.arange(width)[None, :] >= prompt_B[:, None]) & mask_BT
    rewards = torch.rand(num_samples, generator=gen)
    return Batch(
        tokens={
            "input_ids": torch.randint(1, 150_000, (num_samples, width), generator=gen) * mask_BT,
            "attention_mask": mask_BT.to(torch.int64),
            "loss_mask": loss_mask.to(torch.int64),
            "rollout_logprobs": -torch.rand(num_samples, width, generator=gen) * loss_mask,
            "advantages": (rewards[:, None] - 0.5) * loss_mask,
        },
        samples={
            "group_id": torch.arange(num_samples) // GROUP_SIZE,
            "reward": rewards,
        },
    )


def same_batch(a: Batch, b: Batch) -> bool:
    if set(a.keys()) != set(b.keys()):
        return False
    return all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])
        for k in (*a.tokens, *a.samples)
    )


def timed(fn) -> tuple[Any, float]:
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    local_s = time.perf_counter() - start
    # The collective is as slow as its slowest rank.
    slowest = torch.tensor([local_s], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return out, float(slowest)


def run_case(samples_per_rank: int, skew: float, tolerance: float, repeats: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(rank, samples_per_rank, skew)
    times: dict[str, list[float]] = {
        "old_rebalance": [],
        "new_rebalance": [],
        "old_restore": [],
        "new_restore": [],
    }
    identical = True
    moved_local = 0
    for repeat in range(repeats + 1):  # repeat 0 warms up (allocator, gloo pairs)
        runs = {}
        for path in ("old", "new") if repeat % 2 else ("new", "old"):
            if path == "old":
                (got, plan), t_rebalance = timed(
                    lambda: old_rebalance(batch, group_key="group_id", tolerance=tolerance)
                )
                got.samples["score"] = got["reward"] * 2
                back, t_restore = timed(lambda got=got, plan=plan: old_restore(got, plan))
            else:
                (got, plan), t_rebalance = timed(
                    lambda: batch.rebalance(group_key="group_id", tolerance=tolerance)
                )
                got.samples["score"] = got["reward"] * 2
                back, t_restore = timed(lambda got=got, plan=plan: got.restore(plan))
            runs[path] = (got, back, plan)
            if repeat:
                times[f"{path}_rebalance"].append(t_rebalance)
                times[f"{path}_restore"].append(t_restore)
        identical &= same_batch(runs["old"][0], runs["new"][0])
        identical &= same_batch(runs["old"][1], runs["new"][1])
        plan = runs["new"][2]
        mine = slice(plan.offsets[rank], plan.offsets[rank + 1])
        moved_local = int((plan.destination[mine] != rank).sum())
    flags = torch.tensor([int(identical), moved_local, batch.num_tokens], dtype=torch.int64)
    gathered = [torch.zeros_like(flags) for _ in range(world)]
    dist.all_gather(gathered, flags)
    return {
        "times_s": times,
        "identical": all(bool(g[0]) for g in gathered),
        "moved_samples": sum(int(g[1]) for g in gathered),
        "num_tokens": sum(int(g[2]) for g in gathered),
    }


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        out = {
            name: run_case(args.samples_per_rank, case["skew"], case["tolerance"], args.repeats)
            for name, case in CASES.items()
        }
        if dist.get_rank() == 0:
            Path(args.worker).write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- the launcher --------------------------------------------------------------------------------


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Batch.rebalance / Batch.restore, {meta['ranks']} gloo ranks x "
        f"{meta['samples_per_rank']} samples (CPU, 1 thread per rank, {meta['cpus']} cores, "
        f"1-minute load average {meta['load_avg_1m']:.1f} after the run), commit {meta['commit']}; "
        f"medians of {meta['repeats']} repeats, the slowest rank's time per call. old: per-sample "
        "dicts, padded again (the path before Batch.rebalance); new: Batch.rebalance / Batch.restore. "
        "identical: both gave equal batches (fields, dtypes, values) on every rank and repeat.",
        "",
        "| case | moved samples | tokens | rebalance old ms | new ms | new/old "
        "| restore old ms | new ms | new/old | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['moved_samples']} | {r['num_tokens']} | "
            f"{r['old_rebalance_ms']:.1f} | {r['new_rebalance_ms']:.1f} | "
            f"{r['rebalance_ratio']:.2f} | {r['old_restore_ms']:.1f} | "
            f"{r['new_restore_ms']:.1f} | {r['restore_ratio']:.2f} | {r['identical']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--samples-per-rank", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--worker", metavar="OUT_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from yatt.testing import run_ranks  # here: the workers need not import it

    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "rank0.json"
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            str(out_path),
            "--samples-per-rank",
            str(args.samples_per_rank),
            "--repeats",
            str(args.repeats),
        ]
        run_ranks(cmd, args.ranks, env={"CUDA_VISIBLE_DEVICES": ""}, timeout_s=3600)
        raw = json.loads(out_path.read_text())
    rows = []
    for name, res in raw.items():
        row: dict[str, Any] = {"case": name, **{k: v for k, v in res.items() if k != "times_s"}}
        for key, values in res["times_s"].items():
            row[f"{key}_ms"] = statistics.median(values) * 1e3
        row["rebalance_ratio"] = row["new_rebalance_ms"] / row["old_rebalance_ms"]
        row["restore_ratio"] = row["new_restore_ms"] / row["old_restore_ms"]
        row["times_s"] = res["times_s"]
        rows.append(row)
    meta = {
        "commit": measured_commit(),
        "ranks": args.ranks,
        "samples_per_rank": args.samples_per_rank,
        "repeats": args.repeats,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    report = to_markdown(rows, meta)
    print(report)
    if not args.no_write:
        write_report(RESULTS / "rebalance_cpu.md", report, data={"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
