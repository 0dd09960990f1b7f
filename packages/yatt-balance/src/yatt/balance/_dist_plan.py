"""The rebalance plan: which rank every sample goes to, computed identically on every rank.

Global sample index: the samples of rank 0 in their local order, then rank 1's, and so on.
`destination[g]` is the rank that trains global sample g; a rank's samples after rebalance are
its global indices in ascending order (so by origin rank, then by origin position).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from yatt.balance._partition import partition


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
) -> RebalancePlan:
    """Partition all ranks' samples into world_size parts, then give each part to the rank that
    already holds most of its volume, so the least data moves."""
    world_size = len(costs)
    counts = tuple(int(c.shape[0]) for c in costs)
    all_costs = np.concatenate(costs) if costs else np.zeros(0)
    groups = None
    if any(labels is not None for labels in group_labels):
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
        groups = np.concatenate(dense)
    parts = partition(all_costs, world_size, equal_size=equal_size, groups=groups)
    origin = np.repeat(np.arange(world_size), counts)
    volume = np.concatenate(volumes) if volumes else np.zeros(0)
    overlap = np.zeros((world_size, world_size))
    for p, members in enumerate(parts):
        np.add.at(overlap[p], origin[members], volume[members])
    rank_of_part = _assign_parts(overlap)
    destination = np.empty(all_costs.shape[0], dtype=np.int64)
    for p, members in enumerate(parts):
        destination[members] = rank_of_part[p]
    return RebalancePlan(world_size=world_size, rank=rank, counts=counts, destination=destination)


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
