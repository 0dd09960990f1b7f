"""Micro-batch shapes: what a padded [rows, longest row] batch costs in memory."""

from __future__ import annotations


def split_padded(bins: list[list[int]], lengths: list[int], cap: int) -> list[list[int]]:
    """Split bins whose padded size (rows x longest row) exceeds `cap` into length-sorted parts.

    `pack` caps the sum of lengths and spreads long sequences over the bins, so a bin of one
    long and many short samples pads every row to the long one: memory (the float32 logits over
    the vocabulary) follows the padded size. A sample longer than `cap` keeps a bin of its own.
    """
    out: list[list[int]] = []
    for index in bins:
        if not index or len(index) * max(lengths[i] for i in index) <= cap:
            out.append(index)
            continue
        part: list[int] = []
        for i in sorted(index, key=lambda i: -lengths[i]):
            # part[0] is the part's longest row: every row pads to it.
            if part and (len(part) + 1) * lengths[part[0]] > cap:
                out.append(part)
                part = []
            part.append(i)
        out.append(part)
    return out
