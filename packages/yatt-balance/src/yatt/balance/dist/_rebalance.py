"""Rebalance samples across data-parallel ranks by cost, and send results back.

every rank: lengths --all_gather--> all lengths --partition--> one plan (same everywhere)
every rank: samples --p2p, only what moves--> samples of its part (ascending global order)
... train, score ...
every rank: results --p2p, reverse--> results in the original ranks and order (restore)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch.distributed as dist

from yatt.balance._checks import as_nonnegative_array
from yatt.balance.dist._exchange import exchange
from yatt.balance.dist._plan import RebalancePlan, make_plan


def rebalance(
    samples: Sequence[Any],
    lengths: Any,
    *,
    group: dist.ProcessGroup | None = None,
    groups: Any = None,
    costs: Any = None,
    equal_size: bool = False,
    tolerance: float = 1e-3,
) -> tuple[list[Any], RebalancePlan]:
    """Move samples between the ranks of `group` so every rank gets about the same cost.

    `lengths` holds each local sample's token count; it is the balancing cost unless `costs`
    (e.g. `flops_cost(lengths, ...)`) is given, and it weighs how much data a move costs, so
    each balanced part goes to the rank that already holds most of it. `groups` labels local
    samples that must stay together (a GRPO prompt's responses); labels are local to a rank.
    `equal_size` gives every rank the same number of samples (or groups). `tolerance` trades
    balance for locality: the plan starts from where samples are and moves as few (and as
    small) as it takes to bring every rank within (1 + tolerance) of the best balanced
    partition found, falling back to that partition when it cannot; 0 asks for the best
    balance whatever the movement (see make_plan for the exact rule). A sample is any
    picklable object; tensors inside dicts, lists and tuples move without pickling (on NCCL,
    GPU to GPU; call torch.cuda.set_device first). Collective: every rank of `group` calls it.
    Returns this rank's new samples and the plan that `restore` needs.
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    samples = list(samples)
    local, error = _validate(samples, lengths, groups, costs)
    if error is None:
        error = _validate_settings(tolerance)
    settings = (bool(equal_size), float(tolerance) if error is None else None)
    # Errors travel with the gathered data so every rank raises together instead of the
    # healthy ranks hanging in the next collective.
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (local, error, settings), group=group)
    errors = [f"rank {r}: {err}" for r, (_, err, _) in enumerate(gathered) if err]
    if errors:
        raise ValueError("rebalance got bad input on " + "; ".join(errors))
    # Each rank computes the plan itself, so differing settings would silently give
    # different plans (and a hang in the exchange): refuse them on every rank together.
    if len({g[2] for g in gathered}) > 1:
        seen = ", ".join(f"rank {r}: {g[2]}" for r, g in enumerate(gathered))
        raise ValueError(
            f"rebalance needs the same (equal_size, tolerance) on every rank; got {seen}"
        )
    plan = make_plan(
        rank=rank,
        costs=[g[0]["costs"] for g in gathered],
        volumes=[g[0]["lengths"] for g in gathered],
        group_labels=[g[0]["groups"] for g in gathered],
        equal_size=equal_size,
        tolerance=float(tolerance),
    )
    origin = plan.origin_rank(np.arange(plan.destination.shape[0]))
    offsets = plan.offsets
    mine = slice(offsets[rank], offsets[rank + 1])
    outgoing: dict[int, list[Any]] = {}
    for i, dst in enumerate(plan.destination[mine].tolist()):
        if dst != rank:
            outgoing.setdefault(dst, []).append(samples[i])
    held = plan.held_by(rank)
    incoming = np.bincount(origin[held], minlength=world_size)
    received = exchange(outgoing, {r: int(c) for r, c in enumerate(incoming) if r != rank}, group)
    return _assemble(held, origin[held], offsets, rank, samples, received), plan


def restore(
    results: Sequence[Any], plan: RebalancePlan, *, group: dist.ProcessGroup | None = None
) -> list[Any]:
    """Send each result (one per sample `rebalance` returned here, same order) back to the
    rank the sample came from; returns this rank's results in its original sample order.
    Collective over the same `group` as the rebalance that made `plan`."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if (plan.world_size, plan.rank) != (world_size, rank):
        raise ValueError(
            f"plan was made for rank {plan.rank} of {plan.world_size}, but this is rank {rank} "
            f"of {world_size}: pass the group that rebalance used and this rank's own plan"
        )
    results = list(results)
    held = plan.held_by(rank)
    if len(results) != held.shape[0]:
        raise ValueError(
            f"results has {len(results)} entries but this rank holds {held.shape[0]} samples "
            "after rebalance: pass exactly one result per rebalanced sample, in the same order"
        )
    origin = plan.origin_rank(held)
    outgoing: dict[int, list[Any]] = {}
    for result, src in zip(results, origin.tolist(), strict=True):
        if src != rank:
            outgoing.setdefault(src, []).append(result)
    offsets = plan.offsets
    home = plan.destination[offsets[rank] : offsets[rank + 1]]
    incoming = np.bincount(home, minlength=world_size)
    received = exchange(outgoing, {r: int(c) for r, c in enumerate(incoming) if r != rank}, group)
    kept = iter(r for r, src in zip(results, origin.tolist(), strict=True) if src == rank)
    streams = {peer: iter(objs) for peer, objs in received.items()}
    return [next(kept) if dst == rank else next(streams[dst]) for dst in home.tolist()]


def _assemble(
    held: np.ndarray,
    origin: np.ndarray,
    offsets: np.ndarray,
    rank: int,
    samples: list[Any],
    received: dict[int, list[Any]],
) -> list[Any]:
    # Held global indices ascend, and each peer sent its samples in ascending local order, so
    # taking from each peer's stream in turn restores the global order.
    streams = {peer: iter(objs) for peer, objs in received.items()}
    return [
        samples[g - offsets[rank]] if src == rank else next(streams[src])
        for g, src in zip(held.tolist(), origin.tolist(), strict=True)
    ]


def _validate_settings(tolerance: Any) -> str | None:
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float | np.number):
        return f"tolerance must be a number >= 0 (e.g. 1e-3); got {tolerance!r}"
    if not np.isfinite(tolerance) or tolerance < 0:
        return f"tolerance must be a finite number >= 0 (e.g. 1e-3, or 0 for the best balance); got {tolerance!r}"
    return None


def _validate(
    samples: list[Any], lengths: Any, groups: Any, costs: Any
) -> tuple[dict[str, Any] | None, str | None]:
    try:
        lens = as_nonnegative_array(lengths, "lengths")
        weights = lens if costs is None else as_nonnegative_array(costs, "costs")
        for name, arr in (("lengths", lens), ("costs", weights)):
            if arr.shape[0] != len(samples):
                raise ValueError(f"{name} has {arr.shape[0]} entries for {len(samples)} samples")
        labels = None
        if groups is not None:
            labels = np.asarray(groups)
            if labels.ndim != 1 or labels.shape[0] != len(samples):
                raise ValueError(
                    f"groups must hold one label per sample ({len(samples)}); got shape {labels.shape}"
                )
    except ValueError as exc:
        return None, str(exc)
    return {"costs": weights, "lengths": lens, "groups": labels}, None
