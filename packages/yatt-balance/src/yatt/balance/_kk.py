"""Karmarkar-Karp largest differencing and greedy LPT, on validated float64 costs.

Largest differencing, k-way (Korf's extension), as specified here so that an independent
implementation reproduces the same part sums:
- Items are ordered by cost descending, ties by index ascending.
- Initial states: one per item (that item in one part, k - 1 empty parts); with equal_size, one
  per run of k consecutive items in that order (one item in each part).
- A state's spread is its largest part sum minus its smallest. A heap pops the state with the
  largest spread first, ties to the older state (initial states in item order, then merged
  states in creation order). The two popped states A, B merge by pairing A's parts in
  descending sum with B's parts in ascending sum, so heavy meets light.
- When one state is left, its parts are the answer.

A state keeps only its non-empty parts, as (sum, slot id) ascending; the empty parts are
implicit zeros at the front. Part membership is not copied on merge: merging two slots links
one id under the other in a union-find forest (`parent`), resolved once at the end. That keeps
a merge O(k) in the worst case and O(log k) for the common case of one item joining a full state.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np


def order_by_cost(costs: np.ndarray) -> np.ndarray:
    """Item indices by cost descending, ties by index ascending."""
    return np.lexsort((np.arange(costs.shape[0]), -costs))


def karmarkar_karp(costs: np.ndarray, k: int, *, equal_size: bool) -> list[list[int]]:
    n = costs.shape[0]
    if n == 0:
        return [[] for _ in range(k)]
    order = order_by_cost(costs)
    parent = np.arange(n)
    # Single-item states are never built: their spread is their cost, so they leave in item
    # order, and a cursor into the sorted items stands in for their heap entries. The heap
    # holds only states with more than one item (and every initial state under equal_size).
    if equal_size:
        assert n % k == 0, "caller checks divisibility"
        runs = order.reshape(-1, k)
        initial = [sorted(zip(costs[run].tolist(), run.tolist(), strict=True)) for run in runs]
        heap = [(s[0][0] - s[-1][0], seq, s) for seq, s in enumerate(initial)]
        heapq.heapify(heap)
        values, items, cursor = [], [], 0
    else:
        heap = []
        values, items, cursor = costs[order].tolist(), order.tolist(), 0
    seq = len(heap) + len(values)
    remaining = len(heap) + len(values)
    links: list[tuple[int, int]] = []  # (child id, parent id), applied to `parent` at the end
    num_values = len(values)
    while remaining > 1:
        # The next two states by spread; a single ties with an older seq than any merged
        # state, so it wins ties.
        if cursor < num_values and (not heap or values[cursor] >= -heap[0][0]):
            a = None
            va, ia = values[cursor], items[cursor]
            cursor += 1
        else:
            a = heapq.heappop(heap)[2]
        if cursor < num_values and (not heap or values[cursor] >= -heap[0][0]):
            b = None
            vb, ib = values[cursor], items[cursor]
            cursor += 1
        else:
            b = heapq.heappop(heap)[2]
        if a is not None and b is not None:
            merged = _merge(a, b, k, links)
        elif a is None and b is None:
            if k == 1:
                merged = _merge([(va, ia)], [(vb, ib)], k, links)
            else:  # two parts of one item each, ascending as a state keeps them
                merged = [(vb, ib), (va, ia)] if vb < va else [(va, ia), (vb, ib)]
        else:
            full, (v, i) = (a, (vb, ib)) if b is None else (b, (va, ia))
            if len(full) < k:
                merged = full
                bisect.insort(merged, (v, i))
            else:
                # The single joins the lightest part (merged in place: states are not shared).
                s0, i0 = full[0]
                links.append((i, i0))
                del full[0]
                bisect.insort(full, (s0 + v, i0))
                merged = full
        spread = merged[-1][0] - merged[0][0] if len(merged) == k else merged[-1][0]
        heapq.heappush(heap, (-spread, seq, merged))
        seq += 1
        remaining -= 1
    final = heap[0][2] if heap else [(values[0], items[0])]
    if links:
        child, par = np.array(links, dtype=np.int64).T
        parent[child] = par
    root = _find_roots(parent)
    part_of_root = np.full(n, -1, dtype=np.int64)
    # Heaviest part first; empty parts (implicit in the state) come last.
    slot_ids = [i for _, i in reversed(final)]
    part_of_root[slot_ids] = np.arange(len(slot_ids))
    return _split(part_of_root[root], k)


def _merge(
    a: list[tuple[float, int]], b: list[tuple[float, int]], k: int, links: list[tuple[int, int]]
) -> list[tuple[float, int]]:
    overlap = len(a) + len(b) - k
    if overlap <= 0:
        # Fewer than k non-empty parts in total: every non-empty part meets an empty one.
        return sorted(a + b)
    if len(b) == 1 or len(a) == 1:
        # One part joins the lightest part of a full state (keeps the list sorted in O(k)).
        full, single = (a, b) if len(b) == 1 else (b, a)
        (s0, i0), (s1, i1) = full[0], single[0]
        links.append((i1, i0))
        merged = full[1:]
        bisect.insort(merged, (s0 + s1, i0))
        return merged
    # The `overlap` lightest parts of each meet, lightest of one with heaviest of the other
    # (that is where A-descending meets B-ascending); the rest meet empty parts.
    paired = []
    for t in range(overlap):
        sa, ia = a[overlap - 1 - t]
        sb, ib = b[t]
        links.append((ib, ia))
        paired.append((sa + sb, ia))
    return sorted(a[overlap:] + b[overlap:] + paired)


def _find_roots(parent: np.ndarray) -> np.ndarray:
    # Pointer jumping: each pass halves every path, so log2(depth) passes.
    while True:
        grand = parent[parent]
        if np.array_equal(grand, parent):
            return parent
        parent = grand


def _split(part_of_item: np.ndarray, k: int) -> list[list[int]]:
    order = np.argsort(part_of_item, kind="stable")
    counts = np.bincount(part_of_item, minlength=k)
    bounds = np.cumsum(counts)[:-1]
    return [chunk.tolist() for chunk in np.split(order, bounds)]


def greedy_lpt(costs: np.ndarray, k: int, *, equal_size: bool) -> list[list[int]]:
    """Longest processing time first: each item, heaviest first, to the lightest part (ties to
    the lowest part index); with equal_size, a part stops taking items at n / k."""
    n = costs.shape[0]
    cap = n // k if equal_size else n
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, p) for p in range(k)]
    for i, c in zip(
        order_by_cost(costs).tolist(), costs[order_by_cost(costs)].tolist(), strict=True
    ):
        total, p = heapq.heappop(heap)
        parts[p].append(i)
        if len(parts[p]) < cap:
            heapq.heappush(heap, (total + c, p))
    return [sorted(part) for part in parts]
