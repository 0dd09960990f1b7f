"""A minimal-movement placement: start where every unit (a sample, or a whole group) already
sits and move as few units as possible until no rank's load is above a target T.

One step, repeated while the heaviest rank h (ties: lowest index) is above T. A receiver is a
rank below T; its spare is T - load; h's excess is e = load[h] - T.
1. One move that finishes h: the cheapest unit on h with cost >= e that fits some spare.
2. Else progress: the costliest unit on h that fits some spare (it leaves the least excess,
   so the fewest further moves).
3. Else (every unit on h is too big for every spare) a swap of x on h for y on a receiver p
   with 0 < x - y <= spare[p]: the smallest x - y >= e if any (finishes h), else the largest.
4. Else a relaxed exchange (move, or swap) with any lighter rank p that minimises the larger
   of the two new loads, p possibly ending above T (it sheds later): the local search step
   of _search.py, so a stall near T is not the end.
With swap_first, rule 3 is tried before rules 1-2. A moved unit goes to the best-fitting
receiver (smallest spare that holds it), keeping large spares for large units. Every step lowers h and leaves the other rank below h's old load, so
the sum of squared loads strictly falls and no state repeats; a step cap bounds the loop anyway.

Under equal_size a move changes two counts, so the counts are evened first (from ranks above
n/k to ranks below it, each move the unit that best fits the source's excess and the
receiver's spare: the fewest moves equal counts allow), and then only swaps are used.

Ties break by cost, then volume (smaller payload first), then unit index, then rank index:
no hashing, no clock, so every rank computes the same placement from the same input.
"""

from __future__ import annotations

import bisect
import math

import numpy as np


def place_with_few_moves(
    costs: np.ndarray,
    volumes: np.ndarray,
    origin: np.ndarray,
    k: int,
    *,
    target: float,
    equal_size: bool,
    swap_first: bool = False,
) -> np.ndarray | None:
    """Rank of every unit after the steps above, or None when no step applies while some rank
    is still above `target` (the caller falls back to the balanced partition).

    costs, volumes: float64 [units]; origin: int64 [units], the rank each unit sits on now.
    `target` is compared with incrementally updated loads; the caller checks the result with
    exactly rounded sums."""
    state = _State(costs, volumes, origin, k, target)
    if equal_size:
        assert costs.shape[0] % k == 0, "caller checks divisibility"
        state.even_counts(costs.shape[0] // k)
    # Every step lowers the sum of squared loads, so this cap is never the reason to stop on
    # real inputs; it is a count (not a clock) so all ranks stop at the same step.
    for _ in range(2 * costs.shape[0] + 2 * k):
        h = int(np.argmax(state.loads))
        if state.loads[h] <= target:
            return state.rank_of
        if swap_first or equal_size:
            ok = state.swap_from(h) or (not equal_size and state.move_from(h))
        else:
            ok = state.move_from(h) or state.swap_from(h)
        if not ok and not state.exchange_from(h, allow_moves=not equal_size):
            return None
    return None


class _State:
    def __init__(
        self, costs: np.ndarray, volumes: np.ndarray, origin: np.ndarray, k: int, target: float
    ) -> None:
        self.costs = costs
        self.target = target
        self.rank_of = origin.astype(np.int64).copy()
        # Per rank: (cost, volume, unit) ascending, and the costs alone for bisect.
        self.keys: list[list[tuple[float, float, int]]] = [[] for _ in range(k)]
        for u in np.lexsort((np.arange(costs.shape[0]), volumes, costs)).tolist():
            self.keys[int(origin[u])].append((float(costs[u]), float(volumes[u]), u))
        self.vals = [[key[0] for key in keys] for keys in self.keys]
        # fsum: exactly rounded, the same bits on every rank whatever its SIMD paths.
        self.loads = np.array([math.fsum(v) for v in self.vals])

    def spares(self, h: int) -> np.ndarray:
        spare = self.target - self.loads
        spare[h] = -np.inf
        return spare

    def move_from(self, h: int) -> bool:
        spare = self.spares(h)
        most = float(spare.max())
        vals = self.vals[h]
        excess = float(self.loads[h]) - self.target
        i = bisect.bisect_left(vals, excess)
        if i == len(vals) or vals[i] > most:  # rule 2: no single unit finishes h
            i = bisect.bisect_right(vals, most) - 1
            if i < 0 or vals[i] <= 0:
                return False
            i = bisect.bisect_left(vals, vals[i])  # equal cost: the smallest payload
        self._move(h, i, _best_fit(spare, vals[i]))
        return True

    def swap_from(self, h: int) -> bool:
        spare = self.spares(h)
        excess = float(self.loads[h]) - self.target
        xs = np.array(self.vals[h])
        if xs.size == 0:
            return False
        finish: tuple[float, int, int, int] | None = None  # (x - y, p, index x, index y)
        progress: tuple[float, int, int, int] | None = None
        for p in np.flatnonzero(spare > 0).tolist():
            ys = np.array(self.vals[p])
            if ys.size == 0:
                continue
            room = float(spare[p])
            # Smallest d >= excess: for each x the largest y <= x - excess.
            j = np.searchsorted(ys, xs - excess, side="right") - 1
            ok = j >= 0
            d = np.where(ok, xs - ys[np.maximum(j, 0)], np.inf)
            d = np.where((d > 0) & (d <= room), d, np.inf)
            i = int(np.argmin(d))
            if d[i] < np.inf and (finish is None or d[i] < finish[0]):
                finish = (float(d[i]), p, i, int(j[i]))
            # Largest d <= room: for each x the smallest y >= x - room.
            j = np.searchsorted(ys, xs - room, side="left")
            ok = j < ys.size
            d = np.where(ok, xs - ys[np.minimum(j, ys.size - 1)], -np.inf)
            d = np.where((d > 0) & (d <= room), d, -np.inf)
            i = int(np.argmax(d))
            if d[i] > -np.inf and (progress is None or d[i] > progress[0]):
                progress = (float(d[i]), p, i, int(j[i]))
        best = finish or progress
        if best is None:
            return False
        _, p, i, j = best
        y_key = self.keys[p][j]
        self._move(h, i, p)
        self._move(p, self.keys[p].index(y_key), h)
        return True

    def exchange_from(self, h: int, *, allow_moves: bool) -> bool:
        best: tuple[float, int, int, int] | None = None  # (new pair max, p, index x, index y)
        xs = np.array(self.vals[h])
        if xs.size == 0:
            return False
        for p in np.flatnonzero(self.loads < self.loads[h]).tolist():
            gap = float(self.loads[h] - self.loads[p])
            ys = np.array(([0.0] if allow_moves else []) + self.vals[p])
            if ys.size == 0:
                continue
            pos = np.searchsorted(ys, xs - 0.5 * gap)
            for j in (np.maximum(pos - 1, 0), np.minimum(pos, ys.size - 1)):
                d = xs - ys[j]
                top = np.maximum(self.loads[h] - d, self.loads[p] + d)
                top = np.where((d > 0) & (d < gap), top, np.inf)
                i = int(np.argmin(top))
                if top[i] < np.inf and (best is None or top[i] < best[0]):
                    best = (float(top[i]), p, i, int(j[i]) - allow_moves)
        if best is None:
            return False
        _, p, i, j = best
        y_key = self.keys[p][j] if j >= 0 else None
        self._move(h, i, p)
        if y_key is not None:
            self._move(p, self.keys[p].index(y_key), h)
        return True

    def even_counts(self, per_rank: int) -> None:
        while True:
            counts = np.array([len(keys) for keys in self.keys])
            over = np.flatnonzero(counts > per_rank)
            if over.size == 0:
                return
            under = np.flatnonzero(counts < per_rank)
            src = int(over[np.argmax(self.loads[over])])
            dst = int(under[np.argmin(self.loads[under])])
            vals = self.vals[src]
            low = max(float(self.loads[src]) - self.target, 0.0)
            high = self.target - float(self.loads[dst])
            i = bisect.bisect_left(vals, low)
            if i == len(vals) or vals[i] > high:
                # Nothing keeps both ends within T: the unit that best evens the two ranks.
                half = 0.5 * float(self.loads[src] - self.loads[dst])
                at = bisect.bisect_left(vals, half)
                near = [c for c in (at - 1, at) if 0 <= c < len(vals)]
                i = min(near, key=lambda c: (abs(vals[c] - half), c))
                i = bisect.bisect_left(vals, vals[i])
            self._move(src, i, dst)

    def _move(self, src: int, i: int, dst: int) -> None:
        key = self.keys[src].pop(i)
        self.vals[src].pop(i)
        at = bisect.bisect_left(self.keys[dst], key)
        self.keys[dst].insert(at, key)
        self.vals[dst].insert(at, key[0])
        self.loads[src] -= key[0]
        self.loads[dst] += key[0]
        self.rank_of[key[2]] = dst


def _best_fit(spare: np.ndarray, cost: float) -> int:
    """The rank with the smallest spare that still holds `cost` (ties: lowest index)."""
    fits = np.where(spare >= cost, spare, np.inf)
    return int(np.argmin(fits))
