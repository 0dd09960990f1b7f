"""DAPO dynamic sampling: keep only groups with reward variance, refill from further prompts.

    round k (every rank, in step):
        new = generate(num_missing)           this rank's next prompts, rolled out and scored
        keep groups of `new` with reward variance (DAPO arXiv:2503.14476, eq. 11)
        all_reduce(min kept groups)           one integer crosses ranks per round
    until every rank has num_groups groups, or max_rounds rounds ran

Ranks run the same number of rounds, so a rollout engine whose generate() is itself collective
(tensor parallel across ranks) stays in step; `generate` receives how many groups this rank
still misses (0 once it is full) and may skip the rollout then, but should still draw its
prompts so data loaders stay in lockstep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from yatt.core._advantages import mask_groups_with_reward_variance
from yatt.core._batch import Batch
from yatt.core._repeated_log import RepeatedWarning

logger = logging.getLogger("yatt.core")
_NOT_FILLED = RepeatedWarning(logger, metric="dynamic_sampling/is_filled")


def _renumber(group_ids_B: torch.Tensor, offset: int) -> tuple[torch.Tensor, int]:
    """Group ids as offset, offset + 1, ... in order of first appearance."""
    ids = group_ids_B.tolist()
    order: dict[int, int] = {}
    for g in ids:
        order.setdefault(g, offset + len(order))
    return torch.as_tensor([order[g] for g in ids], dtype=torch.int64), len(order)


def _all_reduce_min(value: int, group: dist.ProcessGroup | None) -> int:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())  # host sync: decides whether another round runs


def sample_dynamically(
    generate: Callable[[int], Batch],
    *,
    num_groups: int,
    max_rounds: int,
    group: dist.ProcessGroup | None = None,
    group_key: str = "group_id",
    reward_key: str = "reward",
    tolerance: float = 0.0,
) -> tuple[Batch, dict[str, float]]:
    """This rank's batch of up to `num_groups` groups with reward variance, and local stats.

    generate(num_missing) returns a scored batch with sample fields `group_key` and
    `reward_key`. Group ids are renumbered 0..K-1 in order of arrival (ids from different
    rounds may repeat). If max_rounds end first, the batch has fewer groups (stats report
    is_filled=0); collective over `group`.
    """
    if not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups={num_groups!r} must be an int >= 1 (groups per rank)")
    if not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"max_rounds={max_rounds!r} must be an int >= 1")
    kept: list[Batch] = []
    num_kept = num_generated = num_rounds = 0
    schema: Batch | None = None
    while num_rounds < max_rounds:
        new = generate(max(num_groups - num_kept, 0))
        num_rounds += 1
        schema = new
        if len(new):
            for key in (group_key, reward_key):
                if key not in new.samples:
                    raise ValueError(f"generate() returned a batch without sample field {key!r}")
            has_variance_B = mask_groups_with_reward_variance(
                new.samples[reward_key], new.samples[group_key], tolerance=tolerance
            )
            num_generated += len(torch.unique(new.samples[group_key]))
            new = new.select(has_variance_B)
            if len(new):
                renumbered, count = _renumber(new.samples[group_key], num_kept)
                new.samples[group_key] = renumbered.to(new.samples[group_key].device)
                kept.append(new)
                num_kept += count
        if _all_reduce_min(num_kept, group) >= num_groups:
            break
    if schema is None:
        raise AssertionError("max_rounds >= 1 guarantees one round")
    batch = Batch.concat(kept) if kept else schema.select([])
    if len(batch):
        batch = batch.select(batch.samples[group_key] < num_groups)
    is_filled = num_kept >= num_groups
    if not is_filled:
        _NOT_FILLED.warn(
            "dynamic sampling: %d of %d groups with reward variance after %d rounds",
            num_kept,
            num_groups,
            num_rounds,
        )
    stats = {
        "num_rounds": float(num_rounds),
        "num_groups_generated": float(num_generated),
        "num_groups_kept": float(min(num_kept, num_groups)),
        "num_groups_dropped": float(num_generated - num_kept),
        "is_filled": float(is_filled),
    }
    return batch, stats
