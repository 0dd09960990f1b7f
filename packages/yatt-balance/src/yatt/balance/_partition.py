"""Balanced k-way partition of items by cost, and the imbalance metric.

method="kk" is plain Karmarkar-Karp (largest differencing, see _kk.py); "greedy" is LPT;
"auto" starts from KK (or from LPT under equal_size, when LPT is better) and runs the bounded
local search of _search.py, unless KK is already within _TOLERANCE of the lower bound.
"auto" is never worse than "kk" by construction: KK's plan is the incumbent, and a different
plan is returned only if its heaviest part, summed exactly with math.fsum, is no heavier.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np

from yatt.balance._checks import (
    as_group_ids,
    as_int,
    as_nonnegative_array,
    describe_equal_size_fix,
)
from yatt.balance._kk import greedy_lpt, karmarkar_karp
from yatt.balance._search import improve

Method = Literal["auto", "kk", "greedy"]
_METHODS = ("auto", "kk", "greedy")
# Pair evaluations allowed to the local search (10-20 us each): bounds "auto" to a few ms
# beyond KK whatever the input, and is a count, so the plan is the same on every rank.
_MAX_EVALS = 256
# A plan within this fraction of the lower bound max(mean part, largest item) is taken as
# optimal: gains below 1e-5 are far inside the cost model's own error (and the search would
# spend its budget chasing them).
_TOLERANCE = 1e-5


def partition(
    costs: Any,
    k: int,
    equal_size: bool = False,
    *,
    groups: Any = None,
    method: Method = "auto",
) -> list[list[int]]:
    """Split item indices 0..n-1 into k parts whose cost sums are as equal as possible.

    `groups` (one label per item) keeps all items with the same label in one part, e.g. the n
    responses of a GRPO prompt. `equal_size` gives every part the same number of items, or of
    groups when `groups` is given. Parts are lists of item indices in ascending order; the list
    of parts has no particular order, and some parts are empty when there are fewer than k
    items. The same input gives the same plan on every machine.

    The first three arguments take verl's call shape, so `partition(seqlens, k, equal_size)`
    replaces `get_seqlen_balanced_partitions(seqlen_list, k_partitions, equal_size)`.
    """
    values = as_nonnegative_array(costs, "costs")
    k = as_int(k, "k", minimum=1)
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}; got {method!r}")
    if groups is None:
        if equal_size and values.shape[0] % k:
            raise ValueError(describe_equal_size_fix(values.shape[0], k, "items"))
        return _solve(values, k, bool(equal_size), method)
    group_of_item, num_groups = as_group_ids(groups, values.shape[0])
    if equal_size and num_groups % k:
        raise ValueError(describe_equal_size_fix(num_groups, k, "groups"))
    group_costs = np.bincount(group_of_item, weights=values, minlength=num_groups)
    group_parts = _solve(group_costs, k, bool(equal_size), method)
    part_of_group = np.empty(num_groups, dtype=np.int64)
    for p, members in enumerate(group_parts):
        part_of_group[members] = p
    part_of_item = part_of_group[group_of_item]
    order = np.argsort(part_of_item, kind="stable")
    bounds = np.cumsum(np.bincount(part_of_item, minlength=k))[:-1]
    return [chunk.tolist() for chunk in np.split(order, bounds)]


def imbalance(parts: Any, costs: Any) -> float:
    """Heaviest part cost / mean part cost (1.0 is perfect; 1.0 too when all costs are 0)."""
    values = as_nonnegative_array(costs, "costs")
    parts = list(parts)
    if not parts:
        raise ValueError("parts must hold at least one part; got an empty list")
    sums = []
    for p, part in enumerate(parts):
        idx = np.asarray(part, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= values.shape[0]):
            raise ValueError(f"parts[{p}] holds an index outside 0..{values.shape[0] - 1}")
        sums.append(math.fsum(values[idx].tolist()))
    total = math.fsum(sums)
    if total == 0:
        return 1.0
    return max(sums) * len(sums) / total


def _heaviest(costs: np.ndarray, parts: list[list[int]]) -> float:
    return max(math.fsum(costs[part].tolist()) for part in parts)


def _solve(costs: np.ndarray, k: int, equal_size: bool, method: str) -> list[list[int]]:
    if method == "greedy":
        return greedy_lpt(costs, k, equal_size=equal_size)
    kk = karmarkar_karp(costs, k, equal_size=equal_size)
    if method == "kk" or costs.shape[0] <= 1 or k == 1:
        return kk
    kk_max = _heaviest(costs, kk)
    lower_bound = max(math.fsum(costs.tolist()) / k, float(costs.max())) * (1.0 + _TOLERANCE)
    if kk_max <= lower_bound:
        return kk
    start, start_max = kk, kk_max
    if equal_size:
        # Under equal_size, KK starts from runs of k sorted items and can end far from the
        # optimum on long tails, where LPT with a count cap does much better; without the
        # constraint KK is the better start in practice, and LPT would only cost time.
        lpt = greedy_lpt(costs, k, equal_size=True)
        lpt_max = _heaviest(costs, lpt)
        if lpt_max < start_max:
            start, start_max = lpt, lpt_max
    refined = improve(
        costs, start, allow_moves=not equal_size, max_evals=_MAX_EVALS, lower_bound=lower_bound
    )
    best = min((_heaviest(costs, refined), 0, refined), (start_max, 1, start))[2]
    return best if _heaviest(costs, best) <= kk_max else kk
