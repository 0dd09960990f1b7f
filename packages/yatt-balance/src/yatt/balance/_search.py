"""Bounded local search that lowers the heaviest part of a partition.

Each step takes the heaviest part H and tries the other parts P from lightest up. For a pair it
picks the exchange that brings both sums closest to their midpoint: move one item x from H to P,
or swap x in H with y in P (swaps only, under equal_size, so counts stay equal). With the gap
g = sum(H) - sum(P) and d = x - y (y = 0 for a move), an exchange is taken only if 0 < d < g:
then both new sums are below the old sum(H), so the maximum never rises and the sum of squared
part sums strictly falls, which rules out cycles. The search stops at a local optimum, at the
lower bound, or after `max_evals` pair evaluations: a count, never a clock, so every rank
computes the same plan.
"""

from __future__ import annotations

import math

import numpy as np


def improve(
    costs: np.ndarray,
    parts: list[list[int]],
    *,
    allow_moves: bool,
    max_evals: int,
    lower_bound: float,
) -> list[list[int]]:
    k = len(parts)
    # Per part: item ids and their costs, both ordered by cost ascending (ties by id).
    # With moves allowed, every part starts with a phantom item (id -1, cost 0): swapping x for
    # the phantom is moving x, so one search covers both, and x = phantom is never valid (d <= 0).
    ids: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    for part in parts:
        members = np.array(sorted(part), dtype=np.int64)
        members = members[np.argsort(costs[members], kind="stable")]
        if allow_moves:
            members = np.concatenate(([-1], members))
        ids.append(members)
        vals.append(np.where(members >= 0, costs[members], 0.0))
    # fsum is exactly rounded, so every rank gets the same bits whatever its SIMD paths.
    sums = np.array([math.fsum(v.tolist()) for v in vals])
    evals = 0
    while evals < max_evals:
        h = int(np.argmax(sums))
        if sums[h] <= lower_bound:
            break
        improved = False
        for p in np.argsort(sums, kind="stable").tolist():
            gap = sums[h] - sums[p]
            if p == h or gap <= 0 or evals >= max_evals:
                break
            evals += 1
            found = _best_exchange(vals[h], vals[p], gap)
            if found is None:
                continue
            xi, yi = found
            _apply(ids, vals, sums, h, p, xi, yi)
            improved = True
            break
        if not improved:
            break
    return [sorted(i for i in part.tolist() if i >= 0) for part in ids[:k]]


def _best_exchange(hv: np.ndarray, ys: np.ndarray, gap: float) -> tuple[int, int] | None:
    """(index in H, index in P) minimising |d - gap/2| over 0 < d < gap, d = x - y."""
    if hv.size == 0 or ys.size == 0:
        return None
    # For each x the best partner is the y nearest x - gap/2: one of its two sorted neighbours.
    half = 0.5 * gap
    pos = np.searchsorted(ys, hv - half)
    best: tuple[float, int, int] | None = None
    for cand in (np.maximum(pos - 1, 0), np.minimum(pos, ys.size - 1)):
        d = hv - ys[cand]
        score = np.where((d > 0) & (d < gap), np.abs(d - half), np.inf)
        i = int(np.argmin(score))
        if score[i] < np.inf and (best is None or score[i] < best[0]):
            best = (float(score[i]), i, int(cand[i]))
    return None if best is None else (best[1], best[2])


def _apply(
    ids: list[np.ndarray],
    vals: list[np.ndarray],
    sums: np.ndarray,
    h: int,
    p: int,
    xi: int,
    yi: int,
) -> None:
    x_id, x = ids[h][xi], vals[h][xi]
    h_ids, h_vals = _without(ids[h], xi), _without(vals[h], xi)
    p_ids, p_vals = ids[p], vals[p]
    y_id, y = p_ids[yi], p_vals[yi]
    if y_id >= 0:  # a swap; the phantom (a move) stays where it is
        p_ids, p_vals = _without(p_ids, yi), _without(p_vals, yi)
        at = int(np.searchsorted(h_vals, y, side="right"))
        h_ids, h_vals = _with(h_ids, at, y_id), _with(h_vals, at, y)
    at = int(np.searchsorted(p_vals, x, side="right"))
    ids[p], vals[p] = _with(p_ids, at, x_id), _with(p_vals, at, x)
    ids[h], vals[h] = h_ids, h_vals
    sums[h] -= x - y
    sums[p] += x - y


# np.insert / np.delete cost ~10x more than this on the short arrays a part holds.
def _without(a: np.ndarray, i: int) -> np.ndarray:
    return np.concatenate((a[:i], a[i + 1 :]))


def _with(a: np.ndarray, i: int, value: float) -> np.ndarray:
    return np.concatenate((a[:i], np.array([value], dtype=a.dtype), a[i:]))
