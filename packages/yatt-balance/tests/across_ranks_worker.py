"""One rank of the rebalance/restore checks; launched by test_across_ranks.py and test_across_ranks_cuda.py.

    python across_ranks_worker.py --backend gloo   (with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Exits non-zero (with the assertion's traceback) if any check fails on this rank.
"""

from __future__ import annotations

import argparse
import os
from collections import OrderedDict, namedtuple

import numpy as np
import torch
import torch.distributed as dist

from yatt.balance import imbalance, partition
from yatt.balance.across_ranks import (
    MovedRows,
    RebalancePlan,
    partition_destination,
    rebalance,
    rebalance_rows,
    restore,
    restore_rows,
)

Pair = namedtuple("Pair", ["first", "second"])


def make_sample(rank: int, i: int, device: torch.device) -> dict:
    """A nested payload whose content is a pure function of its origin (rank, i)."""
    rng = np.random.default_rng(1000 * rank + i)
    length = int(rng.integers(1, 60)) * (5 if i % 7 == 0 else 1)  # a long tail
    ids = torch.arange(length, dtype=torch.int64, device=device) + 10_000 * rank + i
    return {
        "ids": ids,
        "meta": OrderedDict(
            origin=(rank, i),
            logp=torch.full((length,), float(i), dtype=torch.float32, device=device) / (rank + 1),
            mask=torch.tensor([i % 2 == 0, True], device=device),
            half=torch.ones(3, 2, dtype=torch.bfloat16, device=device) * i,
        ),
        "pair": Pair(torch.tensor(float(rank), device=device), f"text-{i}"),
        "cpu_only": torch.zeros(0, 4),
        "scalars": [length, None, 1.5],
    }


def check_sample(sample: dict, device: torch.device) -> None:
    rank, i = sample["meta"]["origin"]
    want = make_sample(rank, i, device)
    assert sample.keys() == want.keys()
    assert isinstance(sample["meta"], OrderedDict) and isinstance(sample["pair"], Pair)
    for got, exp in [
        (sample["ids"], want["ids"]),
        (sample["meta"]["logp"], want["meta"]["logp"]),
        (sample["meta"]["mask"], want["meta"]["mask"]),
        (sample["meta"]["half"], want["meta"]["half"]),
        (sample["pair"].first, want["pair"].first),
        (sample["cpu_only"], want["cpu_only"]),
    ]:
        assert got.dtype == exp.dtype and got.shape == exp.shape, (got, exp)
        assert got.device == exp.device, (got.device, exp.device)
        assert torch.equal(got, exp)
    assert sample["pair"].second == want["pair"].second
    assert sample["scalars"] == want["scalars"]


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def check_round_trip(
    counts: list[int], device: torch.device, *, grouped: bool, equal_size: bool
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = [make_sample(rank, i, device) for i in range(counts[rank])]
    lengths = [len(s["ids"]) for s in samples]
    labels = [i // 4 for i in range(len(samples))] if grouped else None
    local, plan = rebalance(samples, lengths, groups=labels, equal_size=equal_size)
    assert isinstance(plan, RebalancePlan)
    for sample in local:
        check_sample(sample, device)
    origins = [s["meta"]["origin"] for s in local]
    assert origins == sorted(origins), "a rank's samples come in (origin rank, index) order"
    everyone = gather(origins)
    flat = [o for part in everyone for o in part]
    assert sorted(flat) == [(r, i) for r in range(world) for i in range(counts[r])], "each once"
    # The plan is the balanced partition of all lengths, identical on every rank.
    all_lengths = np.array(
        [len(make_sample(r, i, device)["ids"]) for r in range(world) for i in range(counts[r])]
    )
    offsets = np.concatenate(([0], np.cumsum(counts)))
    parts = [[int(offsets[r] + i) for r, i in part] for part in everyone]
    all_labels = None
    if grouped:
        all_labels = [(r, i // 4) for r in range(world) for i in range(counts[r])]
        home = {}
        for dst, part in enumerate(everyone):
            for r, i in part:
                assert home.setdefault((r, i // 4), dst) == dst, "a group is split"
        all_labels = [r * 1000 + i // 4 for r in range(world) for i in range(counts[r])]
    # Balanced to within the default tolerance of the partition, and moving no more than
    # handing each balanced part to one rank (the plan before locality) would.
    expected = partition(all_lengths, world, groups=all_labels, equal_size=equal_size)
    assert imbalance(parts, all_lengths) <= imbalance(expected, all_lengths) * (1 + 1e-3)
    origin = np.repeat(np.arange(world), counts)
    old = partition_destination(expected, origin, all_lengths.astype(float), world)
    assert all_lengths[plan.destination != origin].sum() <= all_lengths[old != origin].sum()
    if equal_size and not grouped:
        assert len({len(p) for p in parts}) == 1
    if equal_size and grouped:
        assert len({len({(r, i // 4) for r, i in part}) for part in everyone}) == 1
    plans = gather(plan.destination.tolist())
    assert all(p == plans[0] for p in plans), "one plan on every rank"

    results = [
        {"total": s["ids"].sum() * 2, "origin": s["meta"]["origin"], "by": rank} for s in local
    ]
    back = restore(results, plan)
    assert len(back) == len(samples)
    for i, (res, sample) in enumerate(zip(back, samples, strict=True)):
        assert res["origin"] == (rank, i)
        assert torch.equal(res["total"], sample["ids"].sum() * 2)
        assert res["total"].device == device


def check_bad_input_raises_everywhere(device: torch.device) -> None:
    rank = dist.get_rank()
    samples = [make_sample(rank, i, device) for i in range(3)]
    lengths = [5, 6, -1 if rank == 1 else 7]
    try:
        rebalance(samples, lengths)
    except ValueError as exc:
        assert "rank 1" in str(exc) and "lengths[2]" in str(exc), exc
    else:
        raise AssertionError("negative length on rank 1 must raise on every rank")


def check_settings_must_agree(device: torch.device) -> None:
    rank = dist.get_rank()
    samples = [make_sample(rank, i, device) for i in range(3)]
    for kwargs, needle in (
        ({"tolerance": 1e-3 if rank == 0 else 0.0}, "same (equal_size, tolerance)"),
        ({"tolerance": -1.0}, "tolerance must be a finite number >= 0"),
    ):
        try:
            rebalance(samples, [5, 6, 7], **kwargs)
        except ValueError as exc:
            assert needle in str(exc), exc
        else:
            raise AssertionError(f"rebalance({kwargs}) must raise on every rank")


def check_balanced_input_moves_nothing(device: torch.device) -> None:
    rank = dist.get_rank()
    # Every rank holds the same lengths in a different order: already balanced.
    samples = [make_sample(0, i, device) for i in range(12)]
    order = np.random.default_rng(rank).permutation(12).tolist()
    samples = [samples[i] for i in order]
    local, plan = rebalance(samples, [len(s["ids"]) for s in samples])
    assert (plan.destination == plan.origin_rank(np.arange(plan.destination.shape[0]))).all()
    assert [s["meta"]["origin"] for s in local] == [s["meta"]["origin"] for s in samples]


def place(moved: MovedRows, local: list, unpack) -> list:
    """The rows a rank holds after a move, from its own `local` rows and the payloads."""
    out = [None] * moved.num_rows
    for i, at in zip(moved.kept.tolist(), moved.kept_at.tolist(), strict=True):
        out[at] = local[i]
    for peer, payload in moved.received.items():
        rows = unpack(peer, payload)
        assert len(rows) == len(moved.received_at[peer])
        for at, row in zip(moved.received_at[peer].tolist(), rows, strict=True):
            out[at] = row
    assert all(row is not None for row in out)
    return out


def check_rows_api(counts: list[int], device: torch.device, *, grouped: bool) -> None:
    """rebalance_rows / restore_rows with rows kept as columns (one tensor and one list for
    all rows): the plan and the order of rebalance, each peer's rows in one payload."""
    rank = dist.get_rank()
    samples = [make_sample(rank, i, device) for i in range(counts[rank])]
    lengths = [len(s["ids"]) for s in samples]
    labels = [i // 3 for i in range(len(samples))] if grouped else None
    own = [(rank, i) for i in range(len(samples))]
    keys_n2 = torch.tensor(own, dtype=torch.int64, device=device).reshape(-1, 2)
    calls = []  # the rows of each take() call

    def take(rows: np.ndarray) -> dict:
        calls.append(rows.tolist())
        keys = keys_n2[torch.from_numpy(rows).to(device)]
        return {"key": keys, "text": [f"{r}-{i}" for r, i in keys.tolist()]}

    def unpack(peer: int, payload: dict) -> list:
        assert payload["key"].device == device
        keys = [tuple(k) for k in payload["key"].tolist()]
        assert payload["text"] == [f"{r}-{i}" for r, i in keys]
        # A rebalance receives the sender's own rows; a restore receives this rank's.
        assert all(r == (peer if is_rebalance else rank) for r, _ in keys), (peer, keys)
        return keys

    is_rebalance = True
    moved, plan = rebalance_rows(take, lengths, groups=labels)
    listed, list_plan = rebalance(samples, lengths, groups=labels)
    assert np.array_equal(plan.destination, list_plan.destination)
    for index in (moved.kept, moved.kept_at, *moved.received_at.values()):
        assert index.dtype == np.int64 and (np.diff(index) > 0).all()
    assert all(c == sorted(c) and c for c in calls), calls
    mine = plan.destination[plan.offsets[rank] : plan.offsets[rank + 1]]
    assert len(calls) == len(set(mine.tolist()) - {rank}), "one take() per receiving peer"
    held = place(moved, own, unpack)
    assert held == [s["meta"]["origin"] for s in listed]

    calls.clear()
    is_rebalance = False
    keys_n2 = torch.tensor(held, dtype=torch.int64, device=device).reshape(-1, 2)
    back = restore_rows(take, plan, num_rows=len(held))
    home = place(back, held, unpack)
    assert home == own
    try:
        restore_rows(take, plan, num_rows=len(held) + 1)
    except ValueError as exc:
        assert f"holds {len(held)} samples" in str(exc), exc
    else:
        raise AssertionError("restore_rows with the wrong num_rows must raise")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    try:
        world = dist.get_world_size()
        uneven = [0, 11, 3, 25][:world] if world == 4 else [17, 4][:world]
        check_round_trip(uneven, device, grouped=False, equal_size=False)
        check_round_trip(
            [8 * (r + 1) for r in range(world)], device, grouped=True, equal_size=False
        )
        check_round_trip([8] * world, device, grouped=False, equal_size=True)
        check_round_trip([8 * world] * world, device, grouped=True, equal_size=True)
        check_bad_input_raises_everywhere(device)
        check_settings_must_agree(device)
        check_balanced_input_moves_nothing(device)
        check_rows_api(uneven, device, grouped=False)
        check_rows_api([6 * (r + 1) for r in range(world)], device, grouped=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
