"""One rank of the Batch.rebalance / Batch.restore checks; launched by test_batch_rebalance.py.

    python _rebalance_worker.py        (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Every sample is a pure function of its origin (rank, i), so each rank can build the batch it
must hold after rebalance (and after restore) on its own, padded here independently of Batch,
and compare it with what it got: fields, order, dtypes, widths and values. Exits non-zero with
the failing assertion's traceback.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from yatt.balance import cost
from yatt.balance.across_ranks import make_plan
from yatt.core import Batch

Key = tuple[int, int]  # (origin rank, index there)


def length_of(key: Key) -> int:
    rank, i = key
    rng = np.random.default_rng([rank, i])
    # A long tail; ranks hold differently long samples so balancing has something to move.
    length = int(rng.integers(1, 24)) * (6 if i % 5 == 0 else 1)
    return length * (3 if rank == 1 else 1)


def token_row(key: Key, *, is_added: bool = False) -> dict[str, torch.Tensor]:
    rank, i = key
    n = length_of(key)
    pos = torch.arange(n)
    if is_added:
        return {"old_logprobs": -(pos + 1).to(torch.float32) / (100 * rank + i + 1)}
    return {
        "input_ids": pos + 10_000 * rank + 100 * i + 1,
        "loss_mask": (pos >= 2).to(torch.int64),
        "logprobs": -pos.to(torch.float32) / (i + 1),
        "hidden": torch.stack([pos, -pos], dim=1).to(torch.bfloat16) * (rank + 1),
    }


def sample_row(key: Key, *, is_added: bool = False) -> dict[str, torch.Tensor]:
    rank, i = key
    if is_added:
        return {"score": torch.tensor(rank + i / 100, dtype=torch.float64)}
    return {
        "group_id": torch.tensor(i // 4),
        "reward": torch.tensor(float(i % 3), dtype=torch.float32),
        "vec": torch.tensor([rank, i, length_of(key)], dtype=torch.float64),
        "flag": torch.tensor(i % 2 == 0),
    }


def meta_row(key: Key, *, is_added: bool = False) -> dict:
    rank, i = key
    if is_added:
        return {"verdict": f"ok-{rank}-{i}"}
    image = np.full((1 + i % 3, 4), 16 * rank + i, dtype=np.uint8)  # ragged across samples
    read_only = np.arange(3, dtype=np.int32) + i
    read_only.flags.writeable = False
    # A plain int stays metadata: the move keeps each field's kind.
    return {"key": key, "text": f"prompt {rank}/{i}", "image": image, "ids": read_only, "n": i}


TOKEN_SHAPES = {
    "input_ids": ((), torch.int64),
    "loss_mask": ((), torch.int64),
    "logprobs": ((), torch.float32),
    "hidden": ((2,), torch.bfloat16),
}
SAMPLE_SHAPES = {
    "group_id": ((), torch.int64),
    "reward": ((), torch.float32),
    "vec": ((3,), torch.float64),
    "flag": ((), torch.bool),
}


def build_batch(keys: list[Key], *, is_added: bool = False) -> Batch:
    """The padded batch of `keys`, in order, built here (not through Batch's own helpers)."""
    token_shapes = dict(TOKEN_SHAPES)
    sample_shapes = dict(SAMPLE_SHAPES)
    if is_added:
        token_shapes["old_logprobs"] = ((), torch.float32)
        sample_shapes["score"] = ((), torch.float64)
    lengths = [length_of(key) for key in keys]
    width = max(lengths, default=0)
    tokens = {}
    for name, (shape, dtype) in token_shapes.items():
        out = torch.zeros((len(keys), width, *shape), dtype=dtype)
        for b, key in enumerate(keys):
            row = token_row(key) | (token_row(key, is_added=True) if is_added else {})
            out[b, : lengths[b]] = row[name]
        tokens[name] = out
    tokens["attention_mask"] = torch.zeros((len(keys), width), dtype=torch.int64)
    for b, n in enumerate(lengths):
        tokens["attention_mask"][b, :n] = 1
    samples = {}
    for name, (shape, dtype) in sample_shapes.items():
        out = torch.zeros((len(keys), *shape), dtype=dtype)
        for b, key in enumerate(keys):
            out[b] = (sample_row(key) | (sample_row(key, is_added=True) if is_added else {}))[name]
        samples[name] = out
    meta_rows = [meta_row(k) | (meta_row(k, is_added=True) if is_added else {}) for k in keys]
    names = list(meta_row((0, 0))) + (["verdict"] if is_added else [])
    meta = {name: [row[name] for row in meta_rows] for name in names}
    return Batch(tokens=tokens, samples=samples, meta=meta)


def add_fields(batch: Batch) -> None:
    """What a trainer adds between rebalance and restore (one field of each kind)."""
    keys = batch["key"]
    batch.tokens["old_logprobs"] = build_batch(keys, is_added=True).tokens["old_logprobs"]
    batch.samples["score"] = build_batch(keys, is_added=True).samples["score"]
    batch.meta["verdict"] = [meta_row(key, is_added=True)["verdict"] for key in keys]


def assert_same_batch(got: Batch, want: Batch, where: str) -> None:
    for kind in ("tokens", "samples", "meta"):
        assert set(getattr(got, kind)) == set(getattr(want, kind)), (where, kind)
    for kind in ("tokens", "samples"):
        for name, expected in getattr(want, kind).items():
            value = getattr(got, kind)[name]
            assert value.dtype == expected.dtype, (where, name, value.dtype, expected.dtype)
            assert value.shape == expected.shape, (where, name, value.shape, expected.shape)
            assert torch.equal(value, expected), (where, name)
    for name, expected in want.meta.items():
        for value, exp in zip(got.meta[name], expected, strict=True):
            assert type(value) is type(exp), (where, name, type(value), type(exp))
            if isinstance(exp, np.ndarray):
                assert value.dtype == exp.dtype and np.array_equal(value, exp), (where, name)
            else:
                assert value == exp, (where, name, value, exp)


def check_round_trip(
    counts: list[int],
    *,
    group_key: str | None = None,
    is_equal_size: bool = False,
    tolerance: float = 1e-3,
    quadratic: float = 0.0,
) -> Batch:
    rank, world = dist.get_rank(), dist.get_world_size()
    where = f"counts={counts} group_key={group_key} equal={is_equal_size} tol={tolerance}"
    own = [(rank, i) for i in range(counts[rank])]
    batch = build_batch(own)
    costs = None
    if quadratic:
        costs = cost([length_of(key) for key in own], quadratic=quadratic).tolist()
    got, plan = batch.rebalance(
        group_key=group_key, costs=costs, is_equal_size=is_equal_size, tolerance=tolerance
    )

    # The plan yatt.balance makes from every rank's lengths, computed here without moving.
    keys = [(r, i) for r in range(world) for i in range(counts[r])]
    lengths = [np.array([length_of((r, i)) for i in range(counts[r])]) for r in range(world)]
    weights = [cost(x, quadratic=quadratic) for x in lengths]
    labels = [np.arange(c) // 4 if group_key else None for c in counts]
    want_plan = make_plan(
        rank=rank,
        costs=weights,
        volumes=lengths,
        group_labels=labels,
        equal_size=is_equal_size,
        tolerance=tolerance,
    )
    assert np.array_equal(plan.destination, want_plan.destination), where
    held = [keys[g] for g in plan.held_by(rank).tolist()]
    assert_same_batch(got, build_batch(held), f"rebalance {where}")
    if group_key:
        homes: dict = {}
        for dst, part in enumerate(gather(held)):
            for r, i in part:
                assert homes.setdefault((r, i // 4), dst) == dst, f"a group is split: {where}"

    add_fields(got)
    back = got.restore(plan)
    assert_same_batch(back, build_batch(own, is_added=True), f"restore {where}")
    return got


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def check_mismatched_fields_raise() -> None:
    """2 ranks that swap one sample each; rank 0's batch has a field rank 1's lacks."""
    rank = dist.get_rank()
    lengths = [9, 1, 1] if rank == 0 else [6, 6, 3]
    batch = Batch.from_samples([{"input_ids": torch.arange(n)} for n in lengths])
    if rank == 0:
        batch.meta["extra"] = ["x"] * len(batch)
    try:
        batch.rebalance(tolerance=0.0)
    except ValueError as exc:
        assert "meta fields" in str(exc) and "extra" in str(exc), exc
    else:
        raise AssertionError("rows with different fields must not share a batch")


def check_mixed_dtypes_promote() -> None:
    """2 ranks that swap one sample each, one rank's fields int, the other's float: both get
    the promoted dtype (as torch.cat would), values exact."""
    rank = dist.get_rank()
    lengths = [9, 1, 1] if rank == 0 else [6, 6, 3]
    dtype = torch.int64 if rank == 0 else torch.float32
    batch = Batch.from_samples([{"input_ids": torch.arange(n)} for n in lengths])
    batch.tokens["score"] = batch["input_ids"].to(dtype) * 2
    batch.samples["reward"] = batch.lengths.to(dtype)
    got, _ = batch.rebalance(tolerance=0.0)
    assert got["score"].dtype == got["reward"].dtype == torch.float32
    assert torch.equal(got["score"], got["input_ids"].to(torch.float32) * 2)
    assert torch.equal(got["reward"], got.lengths.to(torch.float32))


def main() -> None:
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        # Uneven counts; with 4 ranks rank 0 starts empty, receives, and ends empty again.
        uneven = {2: [17, 4], 3: [0, 9, 14], 4: [0, 11, 3, 25]}[world]
        check_round_trip(uneven)
        check_round_trip(uneven, tolerance=0.0, quadratic=0.05)
        got = check_round_trip([8 * (r + 1) for r in range(world)], group_key="group_id")
        assert len({int(g) for g in got["group_id"]}) <= len(got)
        check_round_trip([8] * world, is_equal_size=True)
        # Fewer groups than ranks: the ranks without one start and end empty.
        got = check_round_trip([0, 8] + [0] * (world - 2), group_key="group_id", tolerance=0.0)
        num_empty = sum(n == 0 for n in gather(len(got)))
        assert num_empty == world - 2, num_empty
        if world == 2:
            check_mismatched_fields_raise()
            check_mixed_dtypes_promote()
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
