"""Mini-batches: one optimizer step each, several per rollout batch (so PPO's clip can act).

    batch (this rank's, already balanced across ranks by Batch.rebalance)
      -> split_mini_batches(batch, n, costs=policy.estimate_costs(lengths), seed=epoch's)
      -> n batches of near-equal cost, GRPO groups kept whole; each goes to one train_step

Not to be confused with micro-batches (yatt.core.data._micro_batches): those split one optimizer
step's forward/backward to fit memory; a mini-batch is a whole optimizer step. Every rank
splits into the same n (a config constant), so the ranks' train_step calls pair up; a rank
short of groups (DAPO filtering) gets empty mini-batches, which train_step runs as dummies.

Without a seed the split is yatt.balance.partition's (the best balance it finds, the same
every time). With several epochs over one batch, PPO-style trainers reshuffle the batch
before each pass (verl's actor `shuffle`, OpenRLHF's per-epoch sampler), so that a group
meets different neighbours in each optimizer step; `seed` gives such a split: groups dealt
in a seeded random order to the mini-batches in turn, then moves and swaps between the
heaviest and the lightest while they narrow the gap (see `_seeded_parts`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from yatt.balance import partition
from yatt.core.data._batch import Batch

# Local search steps per group: each step strictly lowers the sum of squared loads, so it
# stops by itself; the bound only guards against float ties cycling.
_MAX_SEARCH_STEPS_PER_GROUP = 8


def split_mini_batches(
    batch: Batch,
    num_mini_batches: int,
    *,
    costs: Sequence[float] | None = None,
    group_key: str | None = "group_id",
    seed: int | None = None,
) -> list[Batch]:
    """`num_mini_batches` batches of this rank's samples, cost sums near-equal, each sample
    in exactly one.

    costs: one per sample (the policy's estimate_costs, as for Batch.rebalance); None: lengths.
    group_key: a sample field whose equal values stay in one mini-batch (the GRPO group, so a
    mini-batch holds whole groups, as verl and TRL split); None: split freely.
    seed: None gives yatt.balance.partition's split (best balance, deterministic). An int
    gives a seeded random split, a different one per seed (pass one per epoch, the same on
    every rank: the split depends only on the seed and this rank's batch), whose heaviest
    and lightest mini-batches differ by at most the smallest group cost in the heaviest one.
    Mini-batches come in order of their first sample; empty ones (fewer groups than
    mini-batches) come last.
    """
    if isinstance(num_mini_batches, bool) or not isinstance(num_mini_batches, int):
        raise ValueError(f"num_mini_batches={num_mini_batches!r}: must be an int >= 1")
    if num_mini_batches < 1:
        raise ValueError(f"num_mini_batches={num_mini_batches!r}: must be an int >= 1")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed={seed!r}: must be an int or None")
    if num_mini_batches == 1:
        return [batch]
    if costs is None:
        costs = batch.lengths.tolist()
    if len(costs) != len(batch):
        raise ValueError(f"costs has {len(costs)} entries for a batch of {len(batch)} samples")
    groups = None
    if group_key is not None:
        if group_key not in batch:
            raise ValueError(
                f"group_key={group_key!r} is not a field of the batch; pass the GRPO group's "
                "field name, or group_key=None to split samples freely"
            )
        groups = batch[group_key].tolist()
    if seed is None:
        parts = partition(list(costs), num_mini_batches, groups=groups)
    else:
        parts = _seeded_parts(list(costs), groups, num_mini_batches, random.Random(seed))
    parts = sorted(parts, key=lambda part: (not part, part[0] if part else 0))
    return [batch.select(part) for part in parts]


def _seeded_parts(
    costs: list[float], groups: list | None, k: int, rng: random.Random
) -> list[list[int]]:
    """Sample indices of k parts: whole groups dealt in a random order, in turn to each part
    (a uniformly random split of equal group counts), then local search. A step moves one group from the
    heaviest part to the lightest, or swaps one of each, choosing the exchange of cost d
    nearest half their gap g (0 < d < g): it narrows that pair and lowers the sum of squared
    part costs by 2 d (g - d) > 0. At the end no such d exists, so the gap is at most the
    smallest group cost in the heaviest part."""
    members: dict = {}
    for index, label in enumerate(groups if groups is not None else range(len(costs))):
        members.setdefault(label, []).append(index)
    group_members = list(members.values())
    group_costs = [sum(float(costs[i]) for i in indices) for indices in group_members]
    order = list(range(len(group_members)))
    rng.shuffle(order)
    part_groups: list[list[int]] = [[] for _ in range(k)]
    loads = [0.0] * k
    for position, group in enumerate(order):  # a random deal, equal group counts
        part_groups[position % k].append(group)
        loads[position % k] += group_costs[group]
    for _ in range(_MAX_SEARCH_STEPS_PER_GROUP * len(order) + 1):
        heavy = max(range(k), key=lambda p: (loads[p], -p))
        light = min(range(k), key=lambda p: (loads[p], p))
        gap = loads[heavy] - loads[light]
        best = None  # (distance of d from gap / 2, group out of heavy, group out of light)
        for out in part_groups[heavy]:
            for back in (None, *part_groups[light]):
                d = group_costs[out] - (0.0 if back is None else group_costs[back])
                if 0.0 < d < gap and (best is None or abs(d - gap / 2) < best[0]):
                    best = (abs(d - gap / 2), out, back)
        if best is None:
            break
        _, out, back = best
        part_groups[heavy].remove(out)
        part_groups[light].append(out)
        loads[heavy] -= group_costs[out]
        loads[light] += group_costs[out]
        if back is not None:
            part_groups[light].remove(back)
            part_groups[heavy].append(back)
            loads[light] -= group_costs[back]
            loads[heavy] += group_costs[back]
    return [sorted(i for group in part for i in group_members[group]) for part in part_groups]
