"""pack: token caps, bin counts, coverage, balance and pipeline order."""

NUM_GPUS = 0

import itertools
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yatt.balance import cost, imbalance, pack


@st.composite
def pack_inputs(draw):
    lengths = draw(st.lists(st.integers(0, 100), max_size=60))
    max_tokens = draw(st.integers(100, 400))
    multiple_of = draw(st.integers(1, 4))
    min_bins = draw(st.one_of(st.none(), st.integers(0, 12)))
    return lengths, max_tokens, multiple_of, min_bins


def bin_costs(bins, costs):
    return [math.fsum(costs[i] for i in b) for b in bins]


@settings(max_examples=300, deadline=None)
@given(pack_inputs(), st.booleans())
def test_caps_counts_and_coverage(inp, quadratic):
    lengths, max_tokens, multiple_of, min_bins = inp
    costs = cost(lengths, quadratic=0.05) if quadratic else None
    if quadratic:
        bins = pack(
            costs,
            lengths=lengths,
            max_tokens=max_tokens,
            multiple_of=multiple_of,
            min_bins=min_bins,
        )
    else:
        bins = pack(lengths, max_tokens=max_tokens, multiple_of=multiple_of, min_bins=min_bins)
    assert len(bins) % multiple_of == 0
    assert len(bins) >= (min_bins or 0)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths))), "every index once"
    assert all(sum(lengths[i] for i in b) <= max_tokens for b in bins), "token cap"
    if lengths:
        # Never more than one round of bins beyond what the tokens strictly need (or min_bins).
        need = max(math.ceil(sum(lengths) / max_tokens), 1, min_bins or 0)
        assert len(bins) <= 2 * need + multiple_of


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=80), st.integers(1, 9))
def test_bins_rise_to_the_middle_then_fall(lengths, min_bins):
    bins = pack(lengths, max_tokens=10**6, min_bins=min_bins)
    sums = bin_costs(bins, lengths)
    peak = int(np.argmax(sums))
    assert all(a <= b for a, b in itertools.pairwise(sums[: peak + 1]))
    assert all(a >= b for a, b in itertools.pairwise(sums[peak:]))
    if len(sums) >= 2:
        assert sorted([sums[0], sums[-1]]) == sorted(sums)[:2], "the lightest two at the ends"


def test_uses_the_fewest_bins_the_tokens_allow():
    assert len(pack([100] * 10, max_tokens=250)) == 5
    assert len(pack([100] * 10, max_tokens=250, multiple_of=3)) == 6
    assert len(pack([100] * 10, max_tokens=250, min_bins=7)) == 7


def test_balanced_by_cost_not_only_by_count():
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 4000, 400)
    costs = cost(lengths, quadratic=1 / 2000)
    bins = pack(costs, lengths=lengths, max_tokens=16384, multiple_of=4)
    assert all(lengths[b].sum() <= 16384 for b in bins)
    assert imbalance(bins, costs) < 1.05


def test_fewer_items_than_bins_gives_empty_bins():
    bins = pack([5, 3], max_tokens=10, min_bins=4)
    assert sorted(map(len, bins)) == [0, 0, 1, 1]
    assert pack([], max_tokens=10) == []
    assert pack([], max_tokens=10, min_bins=3, multiple_of=2) == [[], [], [], []]


def test_oversize_raises_unless_allowed():
    with pytest.raises(
        ValueError, match=r"lengths\[2\] is 500 tokens, over max_tokens=100.*allow_oversize"
    ):
        pack([10, 20, 500], max_tokens=100)
    with pytest.warns(UserWarning, match="exceed max_tokens"):
        bins = pack([10, 20, 500, 30], max_tokens=100, multiple_of=2, allow_oversize=True)
    assert [2] in bins and len(bins) % 2 == 0
    assert all(sum([10, 20, 500, 30][i] for i in b) <= 100 for b in bins if b != [2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack([10, 20], max_tokens=100, allow_oversize=True)  # nothing oversize: no warning


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ([1, 2], {"max_tokens": 0}, "max_tokens must be a finite number > 0"),
        ([1, 2], {"max_tokens": 10, "lengths": [1]}, "lengths must have one entry per item"),
        ([1, -2], {"max_tokens": 10}, r"costs_or_lengths\[1\] is -2"),
        ([1, 2], {"max_tokens": 10, "multiple_of": 0}, "multiple_of must be >= 1"),
        ([1, 2], {"max_tokens": 10, "min_bins": -1}, "min_bins must be >= 0"),
        ([1, 2], {"max_tokens": 10, "lengths": [1, float("nan")]}, r"lengths\[1\] is nan"),
    ],
    ids=["cap", "lengths-len", "negative", "multiple", "min-bins", "nan-length"],
)
def test_bad_input_names_the_argument(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack(args, **kwargs)
