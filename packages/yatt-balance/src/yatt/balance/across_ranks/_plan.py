"""The rebalance plan: which rank every sample goes to, computed identically on every rank.

Global sample index: the samples of rank 0 in their local order, then rank 1's, and so on.
`destination[g]` is the rank that trains global sample g; a rank's samples after rebalance are
its global indices in ascending order (so by origin rank, then by origin position).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from yatt.balance._partition import partition
from yatt.balance.across_ranks._moves import place_with_few_moves


@dataclass(frozen=True, kw_only=True, eq=False)
class RebalancePlan:
    """What `restore` needs to send results home; small and picklable (no tensors, no group)."""

    world_size: int  # ranks in the process group the plan was made for
    rank: int  # this rank's index in that group
    counts: tuple[int, ...]  # samples each rank held before rebalance
    destination: np.ndarray  # int64 [sum(counts)]: rank that holds each global sample after

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.counts))).astype(np.int64)

    def held_by(self, rank: int) -> np.ndarray:
        """Global indices that `rank` holds after rebalance, in its local order."""
        return np.flatnonzero(self.destination == rank)

    def origin_rank(self, global_index: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, global_index, side="right") - 1


def make_plan(
    *,
    rank: int,
    costs: list[np.ndarray],
    volumes: list[np.ndarray],
    group_labels: list[np.ndarray | None],
    equal_size: bool,
    tolerance: float = 1e-3,
) -> RebalancePlan:
    """One plan for every rank: balanced to within `tolerance` of the best partition found,
    moving as little as that allows.

    The rule. L* is the heaviest part of `partition` (Karmarkar-Karp plus local search, with
    groups and equal_size), the best balance we know how to reach; the target is
    T = L* * (1 + tolerance). Candidate A starts from the current placement (nothing moves)
    and moves or swaps units (samples, or whole groups) from ranks above T to ranks below it
    (across_ranks/_moves.py) until every rank is within T; if that greedy stalls, it is run once more
    trying swaps before moves. Candidate B is the balanced partition itself, each part given
    to the rank already holding most of its volume. A is taken if its heaviest rank, summed
    exactly, is within T and it moves no more volume than B; otherwise B. So the plan is
    never heavier than L* * (1 + tolerance), and never heavier than plain KK beyond that
    tolerance (L* <= plain KK's heaviest part); tolerance=0 asks for L* itself, whatever the
    movement.
    """
    world_size = len(costs)
    counts = tuple(int(c.shape[0]) for c in costs)
    all_costs = np.concatenate(costs) if costs else np.zeros(0)
    volume = np.concatenate(volumes) if volumes else np.zeros(0)
    origin = np.repeat(np.arange(world_size), counts)
    groups = _global_groups(group_labels, counts)
    parts = partition(all_costs, world_size, equal_size=equal_size, groups=groups)
    balanced = partition_destination(parts, origin, volume, world_size)
    target = _heaviest(all_costs, balanced, world_size) * (1.0 + tolerance)
    destination = balanced
    if groups is None:
        units = np.arange(all_costs.shape[0])
        num_units = all_costs.shape[0]
    else:
        units, num_units = groups, int(groups.max()) + 1 if groups.size else 0
    unit_origin = np.zeros(num_units, dtype=np.int64)
    unit_origin[units] = origin
    unit_costs = np.bincount(units, weights=all_costs, minlength=num_units)
    unit_volumes = np.bincount(units, weights=volume, minlength=num_units)
    # Moves first, then (only if that stalls or misses the target) swaps first: each greedy
    # can stall where the other does not. Under equal_size only swaps keep counts equal, so
    # the two orders are one.
    for swap_first in (False, True) if not equal_size else (False,):
        rank_of_unit = place_with_few_moves(
            unit_costs,
            unit_volumes,
            unit_origin,
            world_size,
            target=target,
            equal_size=equal_size,
            swap_first=swap_first,
        )
        if rank_of_unit is None:
            continue
        local = rank_of_unit[units]
        if _heaviest(all_costs, local, world_size) <= target:
            # Rarely the balanced partition already sits mostly in place: keep the lighter move.
            if _moved_volume(local, origin, volume) <= _moved_volume(balanced, origin, volume):
                destination = local
            break
    return RebalancePlan(world_size=world_size, rank=rank, counts=counts, destination=destination)


def partition_destination(
    parts: list[list[int]], origin: np.ndarray, volume: np.ndarray, world_size: int
) -> np.ndarray:
    """Each part to the rank that already holds most of its volume (the plan before locality
    mattered; kept as the fallback, and for the benchmark's comparison)."""
    overlap = np.zeros((world_size, world_size))
    for p, members in enumerate(parts):
        np.add.at(overlap[p], origin[members], volume[members])
    rank_of_part = _assign_parts(overlap)
    destination = np.empty(origin.shape[0], dtype=np.int64)
    for p, members in enumerate(parts):
        destination[members] = rank_of_part[p]
    return destination


def _global_groups(
    group_labels: list[np.ndarray | None], counts: tuple[int, ...]
) -> np.ndarray | None:
    if all(labels is None for labels in group_labels):
        return None
    # Group labels are local to a rank (a GRPO group is generated on one rank), so the
    # global group id is (rank, label); samples without labels are their own group.
    dense = []
    next_id = 0
    for labels, count in zip(group_labels, counts, strict=True):
        if labels is None:
            ids = np.arange(count, dtype=np.int64)
        else:
            _, ids = np.unique(labels, return_inverse=True)
            ids = ids.reshape(-1).astype(np.int64)
        dense.append(ids + next_id)
        next_id += int(ids.max()) + 1 if count else 0
    return np.concatenate(dense)


def _heaviest(costs: np.ndarray, destination: np.ndarray, world_size: int) -> float:
    # fsum per rank: exactly rounded, so every rank compares the same numbers.
    if destination.size == 0:
        return 0.0
    order = np.argsort(destination, kind="stable")
    bounds = np.cumsum(np.bincount(destination, minlength=world_size))[:-1]
    return max(math.fsum(chunk.tolist()) for chunk in np.split(costs[order], bounds))


def _moved_volume(destination: np.ndarray, origin: np.ndarray, volume: np.ndarray) -> float:
    return math.fsum(volume[destination != origin].tolist())


def _assign_parts(overlap: np.ndarray) -> np.ndarray:
    """Greedy maximum-overlap matching of parts to ranks (largest overlap first, ties by part
    then rank index): deterministic, and within a factor 2 of the optimal matching."""
    k = overlap.shape[0]
    order = np.lexsort((np.tile(np.arange(k), k), np.repeat(np.arange(k), k), -overlap.ravel()))
    rank_of_part = np.full(k, -1, dtype=np.int64)
    taken = np.zeros(k, dtype=bool)
    for flat in order.tolist():
        p, r = divmod(flat, k)
        if rank_of_part[p] < 0 and not taken[r]:
            rank_of_part[p] = r
            taken[r] = True
    return rank_of_part
