"""Micro-batches of a policy's batch: packed by cost, bounded in padded size, counted alike.

    bins = pack(costs, max_tokens=cap, lengths=lengths)      yatt.balance: cost-balanced bins
    bins = split_padded(bins, lengths, cap)                  rows x longest row <= cap
                                                             (+ the bin's image patches), cut
                                                             by length where padding costs more
                                                             than one more micro-batch
    with a count group: repeat with min_bins = the ranks' largest count until all agree;
                        a rank still short runs empty bins (zero-loss dummies)

The costs are the policy's own (`estimate_costs`), the same that cross-rank balancing uses, so
a sample weighs the same in both. A vision-language sample's image patches (`extra_tokens`)
count toward the memory cap on top of its padded row: the vision tower's activations grow with
them, unpadded (it packs a micro-batch's images end to end).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from yatt.balance import pack

# Rounds of re-packing to agree on a micro-batch count before padding with dummies.
_MAX_AGREEMENT_ROUNDS = 8


# What one more micro-batch costs, in padded tokens: its fixed work (a 0.5B model's forward
# and backward are ~2,000 kernel launches, 10-20 ms, about what ~1,000 tokens of its compute
# take on an H100-class GPU; small GEMMs also run below peak). A bin is cut by length only
# where that saves more padding than this. An estimate, not yet measured per model.
MICRO_BATCH_OVERHEAD_TOKENS = 1024


def split_padded(
    bins: list[list[int]],
    lengths: list[int],
    cap: int,
    extra_tokens: Sequence[int] | None = None,
    overhead_tokens: int = MICRO_BATCH_OVERHEAD_TOKENS,
) -> list[list[int]]:
    """Split each bin into length-sorted parts of padded size (rows x longest row, plus the
    rows' `extra_tokens`: image patches) at most `cap`, choosing the cuts that compute the
    fewest padded tokens, counting `overhead_tokens` for each part.

    `pack` caps the sum of lengths and spreads long sequences over the bins, so a bin of one
    long and many short samples pads every row to the long one: compute and memory (the float32
    logits over the vocabulary) follow the padded size. A long-tail batch (10% of responses
    5x longer) packed that way pads 1.7x its real tokens; cut at the right rows, the long
    samples pad only each other. A sample over `cap` keeps a part of its own.
    """
    extra = extra_tokens if extra_tokens is not None else [0] * len(lengths)
    out: list[list[int]] = []
    for index in bins:
        if len(index) <= 1:
            out.append(index)
            continue
        out.extend(_cheapest_parts(index, lengths, extra, cap, overhead_tokens))
    return out


def _cheapest_parts(
    index: list[int], lengths: list[int], extra: Sequence[int], cap: int, overhead: int
) -> list[list[int]]:
    """Contiguous parts of `index` sorted longest first (a part pads to its first row) that
    minimize padded tokens + overhead per part, each part within `cap` (dynamic programme:
    best[j] is the cheapest cover of the first j rows)."""
    rows = sorted(index, key=lambda i: -lengths[i])
    n = len(rows)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        extras = 0
        for i in range(j - 1, -1, -1):  # the part rows[i:j], padded to lengths[rows[i]]
            extras += extra[rows[i]]
            size = (j - i) * lengths[rows[i]] + extras
            if size > cap and j - i > 1:
                break  # longer parts only grow (rows sorted longest first)
            cost = best[i] + size + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    parts: list[list[int]] = []
    j = n
    while j > 0:
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
    costs: Sequence[float],
    lengths: list[int],
    *,
    max_tokens: int,
    count_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    extra_tokens: Sequence[int] | None = None,
) -> list[list[int]]:
    """Bins of sample indices, each at most `max_tokens` padded tokens (a longer sample alone).

    count_group: ranks that must run the same number of micro-batches (FSDP2 all-gathers in
    every forward, so a rank with fewer would leave the others waiting); collective over it.
    Empty bins are then dummies to run with zero loss. None: this rank's count alone.
    device: where the count's all-reduce runs under NCCL (CPU under gloo).
    extra_tokens: per sample, tokens that count toward the cap besides its padded row (a
    vision-language sample's image patches); None: none.
    """
    bins = _pack_padded(costs, lengths, max_tokens, extra_tokens=extra_tokens)
    if count_group is None or dist.get_world_size(count_group) == 1:
        return bins
    for _ in range(_MAX_AGREEMENT_ROUNDS):
        # Both reductions run on every rank every round (they are collectives).
        target = _all_reduce_max(len(bins), count_group, device)
        smallest = -_all_reduce_max(-len(bins), count_group, device)
        if smallest == target:
            return bins
        bins = _pack_padded(costs, lengths, max_tokens, min_bins=target, extra_tokens=extra_tokens)
    # Splits can overshoot the agreed count: the short ranks run zero-loss dummies.
    target = _all_reduce_max(len(bins), count_group, device)
    return bins + [[] for _ in range(target - len(bins))]


def _pack_padded(
    costs: Sequence[float],
    lengths: list[int],
    cap: int,
    min_bins: int | None = None,
    extra_tokens: Sequence[int] | None = None,
) -> list[list[int]]:
    sizes = lengths
    if extra_tokens is not None:
        sizes = [length + extra for length, extra in zip(lengths, extra_tokens, strict=True)]
    bins = pack(costs, max_tokens=cap, lengths=sizes, min_bins=min_bins, allow_oversize=True)
    return split_padded(bins, lengths, cap, extra_tokens)


def _all_reduce_max(value: int, group: dist.ProcessGroup, device: torch.device | None) -> int:
    on_device = dist.get_backend(group) == "nccl" and device is not None
    t = torch.tensor([value], dtype=torch.int64, device=device if on_device else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())  # host sync: the count decides the loop
