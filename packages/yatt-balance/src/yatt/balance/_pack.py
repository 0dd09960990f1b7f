"""Micro-batches under a token cap, balanced by cost, in pipeline-friendly order.

The number of micro-batches is the smallest count that is a multiple of `multiple_of`, at
least `min_bins`, and fits the items under the cap. DP ranks pass the same `min_bins` (the
all-reduced maximum of their own counts) so that every rank runs the same number of
micro-batches and no rank waits in a collective with nothing to do.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from yatt.balance._checks import as_int, as_nonnegative_array, as_positive_number
from yatt.balance._partition import partition


def pack(
    costs_or_lengths: Any,
    *,
    max_tokens: float,
    lengths: Any = None,
    multiple_of: int = 1,
    min_bins: int | None = None,
    allow_oversize: bool = False,
) -> list[list[int]]:
    """Group item indices into micro-batches of at most `max_tokens` tokens each.

    The first argument is what to balance (a cost per item); `lengths` gives each item's token
    count and defaults to the first argument. A sequence longer than `max_tokens` is an error,
    unless `allow_oversize=True`, which gives it a micro-batch of its own and warns. When
    there are fewer items than micro-batches, the extra micro-batches are empty lists: the
    caller runs a dummy (zero-loss) micro-batch there to keep collectives in step.
    """
    costs = as_nonnegative_array(costs_or_lengths, "costs_or_lengths")
    if lengths is None:
        tokens = costs
    else:
        tokens = as_nonnegative_array(lengths, "lengths")
        if tokens.shape != costs.shape:
            raise ValueError(
                f"lengths must have one entry per item ({costs.shape[0]}); got {tokens.shape[0]}"
            )
    cap = as_positive_number(max_tokens, "max_tokens")
    multiple_of = as_int(multiple_of, "multiple_of", minimum=1)
    min_bins = 0 if min_bins is None else as_int(min_bins, "min_bins", minimum=0)
    oversize = np.flatnonzero(tokens > cap)
    if oversize.size and not allow_oversize:
        i = int(oversize[0])
        raise ValueError(
            f"lengths[{i}] is {tokens[i]:g} tokens, over max_tokens={cap:g} "
            f"({oversize.size} such sequences); raise max_tokens, truncate or drop them, or "
            "pass allow_oversize=True to give each its own micro-batch"
        )
    if oversize.size:
        warnings.warn(
            f"{oversize.size} sequences exceed max_tokens={cap:g} (first: index "
            f"{int(oversize[0])}, {tokens[oversize[0]]:g} tokens); each gets its own micro-batch",
            stacklevel=2,
        )
    rest = np.flatnonzero(tokens <= cap)
    needed = math.ceil(float(tokens[rest].sum()) / cap) if rest.size else 0
    num_bins = max(needed + oversize.size, min_bins, 1 if costs.size else 0)
    num_bins = -(-num_bins // multiple_of) * multiple_of
    while True:
        filled = _fill(costs[rest], tokens[rest], num_bins - oversize.size, cap)
        if filled is not None:
            break
        # Greedy packing can miss a tight fit; one more round of bins always fits eventually
        # (at num_bins >= len(rest) every item has a bin to itself).
        num_bins += multiple_of
    bins = [rest[b].tolist() for b in filled] + [[int(i)] for i in oversize]
    return _order_for_pipeline(bins, costs)


def _fill(costs: np.ndarray, tokens: np.ndarray, m: int, cap: float) -> list[list[int]] | None:
    """m bins balanced by cost with every bin's tokens <= cap, or None if none was found."""
    if m == 0:
        return [] if costs.size == 0 else None
    parts = partition(costs, m)
    if all(tokens[p].sum() <= cap for p in parts):
        return parts
    # The cost-balanced plan overfills some bin: fall back to a cap-aware greedy that takes
    # items by tokens descending (ties by cost, then index) and puts each into the cheapest
    # bin that still has room, so the cap holds by construction.
    bin_cost = np.zeros(m)
    bin_tokens = np.zeros(m)
    bins: list[list[int]] = [[] for _ in range(m)]
    for i in np.lexsort((np.arange(costs.size), -costs, -tokens)).tolist():
        fits = bin_tokens + tokens[i] <= cap
        if not fits.any():
            return None
        b = int(np.argmin(np.where(fits, bin_cost, np.inf)))
        bins[b].append(i)
        bin_cost[b] += costs[i]
        bin_tokens[b] += tokens[i]
    return [sorted(b) for b in bins]


def _order_for_pipeline(bins: list[list[int]], costs: np.ndarray) -> list[list[int]]:
    """Lightest micro-batches at both ends, heaviest in the middle.

    In a 1F1B pipeline schedule the first micro-batch's forward fills the pipeline (every later
    stage waits for it) and the last one's backward drains it, while the micro-batches between
    run with all stages busy. Putting the lightest at the ends shortens the fill and the drain,
    which is the bubble. Order: bins by cost descending (ties by first index), then the even
    positions reversed followed by the odd positions, so costs rise to the middle and fall.
    """
    keyed = sorted(bins, key=lambda b: (-math.fsum(costs[b].tolist()), b[0] if b else -1))
    return keyed[::2][::-1] + keyed[1::2]
