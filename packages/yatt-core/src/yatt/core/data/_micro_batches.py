"""Micro-batches of a policy's batch: cut by length over all the rank's rows, bounded in padded
size, counted alike.

    parts = split_by_length(lengths, cap)       rows sorted longest first, cut into contiguous
                                                parts of rows x longest row (+ the part's image
                                                patches) <= cap, minimizing padded tokens +
                                                MICRO_BATCH_OVERHEAD_TOKENS per part (a row over
                                                the cap runs alone)
    with a count group: all-reduce MAX of the parts; a rank with fewer re-cuts into exactly
                        that many (a row each and empty zero-loss dummies if it has fewer rows)

The cut is planned over all the rank's rows at once, not within cost-balanced bins: `pack` bounds
the sum of lengths and spreads the long rows over every bin, so each bin was cut again: a
long-tail batch (bench/step's, 128 rows) ran 9 micro-batches where one plan needs 4, with fewer
padded tokens.
A vision-language sample's image patches (`extra_tokens`) count toward the memory cap on top of
its padded row: the vision tower's activations grow with them, unpadded (it packs a
micro-batch's images end to end).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# What one more micro-batch costs, in padded tokens. Measured on one H200
# (bench/train/train_step_profile.py, bench/results/train_step_profile_nvidia_h200.md; Qwen2.5-0.5B,
# bf16, cap 16,384, 128 samples): 128 rows of 384 tokens in 4 micro-batches, no padding, take
# 0.84 s, ~17 us a padded token. A long-tail batch in 9 micro-batches (45.1k padded tokens) took
# 1.19 s, the same rows in 4 (48.6k) 0.99 s: 5 more micro-batches cost 0.20 s plus the 3.5k
# padded tokens they saved (~0.06 s), ~52 ms each, ~3,000 tokens' worth (kernel launches of a
# forward and backward, small GEMMs below peak); the earlier estimate, 1,024, was ~3x too low.
MICRO_BATCH_OVERHEAD_TOKENS = 3072


def split_by_length(
    lengths: Sequence[int],
    cap: int,
    *,
    extra_tokens: Sequence[int] | None = None,
    overhead_tokens: int = MICRO_BATCH_OVERHEAD_TOKENS,
    num_parts: int | None = None,
) -> list[list[int]]:
    """Cut all the rows into length-sorted parts of padded size (rows x longest row, plus the
    rows' `extra_tokens`: image patches) at most `cap`, choosing the cuts that compute the
    fewest padded tokens, counting `overhead_tokens` for each part. A row over `cap` gets a part
    of its own. Parts come longest first.

    num_parts: exactly that many parts (the fewest padded tokens among such cuts), for ranks
    that must agree on a count; it must be at least the parts that the cap needs and at most
    the number of rows. None: the count that minimizes padded tokens + overhead.
    """
    extra = extra_tokens if extra_tokens is not None else [0] * len(lengths)
    if len(extra) != len(lengths):
        raise ValueError(
            f"extra_tokens has {len(extra)} entries for {len(lengths)} lengths; pass one per sample"
        )
    rows = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties by index
    if num_parts is None:
        return _best_parts(rows, lengths, extra, cap, overhead_tokens)
    return _cheapest_k_parts(rows, lengths, extra, cap, num_parts)


def split_padded(
    bins: list[list[int]],
    lengths: list[int],
    cap: int,
    extra_tokens: Sequence[int] | None = None,
    overhead_tokens: int = MICRO_BATCH_OVERHEAD_TOKENS,
) -> list[list[int]]:
    """Split each of the given bins on its own into length-sorted parts, as `split_by_length`
    cuts all the rows (padded size at most `cap`, fewest padded tokens + `overhead_tokens` per
    part). For explicit bins; a policy's plan cuts all its rows at once (`plan_micro_batches`).
    """
    extra = extra_tokens if extra_tokens is not None else [0] * len(lengths)
    out: list[list[int]] = []
    for index in bins:
        if len(index) <= 1:
            out.append(index)
            continue
        rows = sorted(index, key=lambda i: -lengths[i])
        out.extend(_best_parts(rows, lengths, extra, cap, overhead_tokens))
    return out


def _windows(
    rows: list[int], lengths: Sequence[int], extra: Sequence[int], cap: int
) -> list[list[tuple[int, int]]]:
    """For each end j, the parts rows[i:j] within `cap` as (i, padded size), i from j - 1 down
    (rows sorted longest first, so a part pads to its first row; one row always fits)."""
    windows: list[list[tuple[int, int]]] = [[]]
    for j in range(1, len(rows) + 1):
        ends: list[tuple[int, int]] = []
        extras = 0
        for i in range(j - 1, -1, -1):
            extras += extra[rows[i]]
            size = (j - i) * lengths[rows[i]] + extras
            if size > cap and j - i > 1:
                break  # longer parts only grow
            ends.append((i, size))
        windows.append(ends)
    return windows


def _parts_from_cuts(rows: list[int], cut: list[int]) -> list[list[int]]:
    parts: list[list[int]] = []
    j = len(rows)
    while j > 0:
        parts.append(rows[cut[j] : j])
        j = cut[j]
    return parts[::-1]


def _cheapest_parts(
    rows: list[int], lengths: Sequence[int], extra: Sequence[int], cap: int, overhead: int
) -> list[list[int]]:
    """Contiguous parts of `rows` (sorted longest first) that minimize padded tokens + overhead
    per part, each within `cap` (dynamic programme: best[j] is the cheapest cover of the first
    j rows)."""
    n = len(rows)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j, ends in enumerate(_windows(rows, lengths, extra, cap)):
        for i, size in ends:
            cost = best[i] + size + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    return _parts_from_cuts(rows, cut)


def _best_parts(
    rows: list[int], lengths: Sequence[int], extra: Sequence[int], cap: int, overhead: int
) -> list[list[int]]:
    """The cheapest parts (`_cheapest_parts`), re-cut into as even parts as that cost allows:
    the exact-count cut at the cheapest count has the same padded tokens (fewer would have
    made a cheaper plan), and among equal cuts it takes the most even sizes (equal rows cut
    4 x 32, not 42 + 42 + 42 + 2: a smaller peak, no near-empty micro-batch)."""
    parts = _cheapest_parts(rows, lengths, extra, cap, overhead)
    if len(parts) <= 1:
        return parts
    return _cheapest_k_parts(rows, lengths, extra, cap, len(parts))


def _cheapest_k_parts(
    rows: list[int], lengths: Sequence[int], extra: Sequence[int], cap: int, k: int
) -> list[list[int]]:
    """Exactly `k` contiguous parts of `rows` (sorted longest first), each within `cap`, with
    the fewest padded tokens (the overhead is the same for every such cut), and among those the
    smallest sum of squared part sizes (the most even). Dynamic programme: best[p][j] is the
    cheapest cover of the first j rows by p parts, as (padded tokens, squared sizes); O(k n^2)
    at worst."""
    n = len(rows)
    if not 1 <= k <= n:
        raise ValueError(f"num_parts={k} must be between 1 and the number of rows ({n})")
    windows = _windows(rows, lengths, extra, cap)
    inf = (float("inf"), float("inf"))
    best = [(0, 0)] + [inf] * n  # p = 0 parts cover only the first 0 rows
    cuts: list[list[int]] = []
    for _ in range(k):
        nxt = [inf] * (n + 1)
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            for i, size in windows[j]:
                cost = (best[i][0] + size, best[i][1] + size * size)
                if cost < nxt[j]:
                    nxt[j], cut[j] = cost, i
        best = nxt
        cuts.append(cut)
    if best[n] == inf:
        raise ValueError(f"num_parts={k} is too few to keep every part within the cap of {cap}")
    parts: list[list[int]] = []
    j = n
    for cut in reversed(cuts):
        parts.append(rows[cut[j] : j])
        j = cut[j]
    return parts[::-1]


def check_context(lengths: Sequence[int], max_context_tokens: int | None) -> None:
    """Raise ValueError when a sample is longer than the model's context."""
    if max_context_tokens is not None and lengths and max(lengths) > max_context_tokens:
        raise ValueError(
            f"a sample has {max(lengths)} tokens, over the model's context of "
            f"{max_context_tokens}; lower the rollout's max_new_tokens or the loader's "
            "max_prompt_tokens"
        )


def plan_micro_batches(
    lengths: list[int],
    *,
    max_tokens: int,
    count_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    extra_tokens: Sequence[int] | None = None,
) -> list[list[int]]:
    """Bins of sample indices, each at most `max_tokens` padded tokens (a longer sample alone),
    cut by length over all the rows (`split_by_length`), longest first.

    Padding, not cost balance, decides the cuts: a rank's micro-batches run one after another,
    so only their total (padded tokens + a fixed cost each) matters.
    count_group: ranks that must run the same number of micro-batches (FSDP2 all-gathers in
    every forward, so a rank with fewer would leave the others waiting). Collective over it:
    every rank all-reduces its count (MAX) exactly once; a rank with fewer re-cuts its rows
    into exactly that many parts, and a rank with fewer rows than that adds empty bins,
    dummies to run with zero loss. None: this rank's count alone, no collective.
    device: where the count's all-reduce runs under NCCL (CPU under gloo).
    extra_tokens: per sample, tokens that count toward the cap besides its padded row (a
    vision-language sample's image patches); None: none.
    """
    bins = split_by_length(lengths, max_tokens, extra_tokens=extra_tokens)
    if count_group is None or dist.get_world_size(count_group) == 1:
        return bins
    # One collective, called by every rank whatever its count.
    target = _all_reduce_max(len(bins), count_group, device)
    if len(bins) == target:
        return bins
    if len(lengths) < target:
        # Too few rows for that many parts: a row each, then zero-loss dummies.
        rows = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        return [[i] for i in rows] + [[] for _ in range(target - len(lengths))]
    return split_by_length(lengths, max_tokens, extra_tokens=extra_tokens, num_parts=target)


def _all_reduce_max(value: int, group: dist.ProcessGroup, device: torch.device | None) -> int:
    on_device = dist.get_backend(group) == "nccl" and device is not None
    t = torch.tensor([value], dtype=torch.int64, device=device if on_device else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())  # host sync: the count decides the plan
