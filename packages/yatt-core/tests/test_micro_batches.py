"""yatt.core.data._micro_batches: padded micro-batches cut where padding costs more than a
micro-batch. Expected cuts are worked out by hand from rows x longest row + overhead, or found
by trying every partition of a few rows."""

NUM_GPUS = 0

import json
import random
import sys
import warnings

import pytest

from yatt.balance import pack
from yatt.core.data import _micro_batches
from yatt.core.data._micro_batches import (
    MICRO_BATCH_OVERHEAD_TOKENS,
    plan_micro_batches,
    split_by_length,
    split_padded,
)
from yatt.testing import run_ranks


def _padded(bins, lengths):
    return sum(len(b) * max(lengths[i] for i in b) for b in bins if b)


def test_long_rows_pad_only_each_other():
    # 4 rows of 1000 and 36 of 200 in one bin, cap 16384, 1024 tokens a micro-batch:
    #   one part: 40 x 1000 = 40,000 > cap, not allowed
    #   {4 long} + {36 short}: 4,000 + 7,200 + 2 x 1,024 = 13,248
    #   cap-greedy (16 rows of 1000, then 24 of 200): 16,000 + 4,800 + 2,048 = 22,848
    lengths = [1000] * 4 + [200] * 36
    bins = split_padded([list(range(40))], lengths, 16384, overhead_tokens=1024)
    assert sorted(map(sorted, bins)) == [list(range(4)), list(range(4, 40))]
    assert _padded(bins, lengths) == 11_200


def test_a_small_spread_stays_one_micro_batch():
    # 10 rows of 100 and 1 of 150: one part pads 11 x 150 = 1,650 (+1,024); cutting the long
    # row off saves 500 padded tokens for another 1,024: not worth it
    lengths = [150] + [100] * 10
    assert split_padded([list(range(11))], lengths, 16384, overhead_tokens=1024) == [
        list(range(11))
    ]
    # with a cheaper micro-batch (overhead 100) the cut pays: 150 + 1,000 + 200 < 1,650 + 100
    cut = split_padded([list(range(11))], lengths, 16384, overhead_tokens=100)
    assert sorted(map(sorted, cut)) == [[0], list(range(1, 11))]


def test_equal_lengths_are_cut_only_by_the_cap():
    lengths = [384] * 128
    bins = split_padded([list(range(128))], lengths, 16384)
    # 16,384 // 384 = 42 rows at most: 4 parts, no fewer (padding is the same for any cut),
    # and the most even of them: 4 x 32 (not 42 + 42 + 42 + 2)
    assert [len(b) for b in bins] == [32, 32, 32, 32]
    assert _padded(bins, lengths) == 128 * 384
    assert [len(b) for b in split_by_length(lengths, 16384)] == [32, 32, 32, 32]
    # 10 equal rows in 3 parts: sizes 4, 3, 3 in some order (squares 34, the least)
    assert sorted(len(b) for b in split_by_length([7] * 10, 28, num_parts=3)) == [3, 3, 4]


def test_a_row_over_the_cap_runs_alone_and_image_patches_count():
    lengths = [500, 10, 10]
    bins = split_padded([[0, 1, 2]], lengths, 100, overhead_tokens=1)
    assert sorted(map(sorted, bins)) == [[0], [1, 2]]
    # 2 rows of 10 plus 90 patches each: 200 > cap 100, so each row runs alone
    bins = split_padded([[1, 2]], lengths, 110, extra_tokens=[0, 90, 90], overhead_tokens=1)
    assert sorted(map(sorted, bins)) == [[1], [2]]


@pytest.mark.parametrize("seed", range(5))
def test_a_long_tail_batch_computes_less_padding_within_the_cap(seed):
    rng = random.Random(seed)
    # bench/step's long tail: 128-token prompts, 90% of responses 64-192 tokens, 10% 512-1024
    lengths = [
        128 + (rng.randint(512, 1024) if rng.random() < 0.1 else rng.randint(64, 192))
        for _ in range(128)
    ]
    bins = plan_micro_batches(lengths, max_tokens=16384)
    assert sorted(i for b in bins for i in b) == list(range(128))
    assert all(len(b) * max(lengths[i] for i in b) <= 16384 for b in bins)
    # Rows cut by length pad within 20% of the real tokens (cut only at the cap, ~1.7x)
    assert _padded(bins, lengths) <= 1.2 * sum(lengths)


def _long_tail(rng, count=128):
    # bench/step's long tail: 128-token prompts, 90% of responses 64-192 tokens, 10% 512-1024
    return [
        128 + (rng.randint(512, 1024) if rng.random() < 0.1 else rng.randint(64, 192))
        for _ in range(count)
    ]


def _size(part, lengths, extra):
    return len(part) * max(lengths[i] for i in part) + sum(extra[i] for i in part)


def _within_cap(bins, lengths, cap, extra=None):
    extra = extra or [0] * len(lengths)
    return all(_size(b, lengths, extra) <= cap or len(b) == 1 for b in bins if b)


def test_one_plan_over_all_rows_runs_the_long_rows_together():
    # 4 rows of 1000 among 36 of 200 (every 10th row long), cap 8192. The real tokens (11,200)
    # exceed the cap, so 2 micro-batches at least; {4 long} (4,000) + {36 short} (7,200) are 2
    # within the cap with no padding at all: the cheapest plan for any per-part overhead.
    lengths = [1000 if i % 10 == 0 else 200 for i in range(40)]
    costs = [float(n) for n in lengths]
    bins = plan_micro_batches(lengths, max_tokens=8192)
    assert sorted(map(sorted, bins)) == [[0, 10, 20, 30], [i for i in range(40) if i % 10]]
    # Cutting pack's bins instead: pack bounds the sum of lengths, so its bins (2 or more)
    # each hold long rows, and each bin is cut in two at least: the case this plan is for.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = split_padded(pack(costs, max_tokens=8192, lengths=lengths), lengths, 8192)
    assert len(old) > 2


def test_an_exact_count_takes_the_cheapest_cut_of_that_many_parts():
    # Rows by length: 10 (index 1), 9 (3), 3 (0), 1 (2); exactly k contiguous parts:
    lengths = [3, 10, 1, 9]
    # cap 100, k = 3: {10}{9}{3,1} = 10+9+6 = 25; {10,9}{3}{1} = 20+3+1 = 24;
    #                 {10}{9,3}{1} = 10+18+1 = 29                          -> {10,9}{3}{1}
    assert split_by_length(lengths, 100, num_parts=3) == [[1, 3], [0], [2]]
    # cap 100, k = 2: {10,9}{3,1} = 26; {10}{9,3,1} = 37; {10,9,3}{1} = 31   -> {10,9}{3,1}
    assert split_by_length(lengths, 100, num_parts=2) == [[1, 3], [0, 2]]
    # cap 19 forbids {10,9} (20): k = 3 -> {10}{9}{3,1} = 25 ({10}{9,3}{1}: 18 fits, 29)
    assert split_by_length(lengths, 19, num_parts=3) == [[1], [3], [0, 2]]
    # ... and every 2-part cut: {10}{9,3,1} is 27 > 19, the others hold {10,9}
    with pytest.raises(ValueError, match="too few"):
        split_by_length(lengths, 19, num_parts=2)
    assert split_by_length(lengths, 19, num_parts=4) == [[1], [3], [0], [2]]
    with pytest.raises(ValueError, match="num_parts=5"):
        split_by_length(lengths, 19, num_parts=5)


def _partitions(items):
    """Every set partition of `items` (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        yield [[first], *partition]
        for b in range(len(partition)):
            yield [*partition[:b], [first, *partition[b]], *partition[b + 1 :]]


@pytest.mark.parametrize("seed", range(30))
def test_the_cut_is_the_cheapest_of_every_partition(seed):
    # Any grouping of the rows, not only contiguous runs of the sorted rows, tried in full.
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    lengths = [rng.choice([5, 20, 30, 100, 400]) for _ in range(n)]
    cap, overhead = rng.choice([150, 400, 1000]), rng.choice([0, 30, 300])

    def cost(partition):
        return sum(_size(b, lengths, [0] * n) + overhead for b in partition)

    feasible = [p for p in _partitions(list(range(n))) if _within_cap(p, lengths, cap)]
    got = split_by_length(lengths, cap, overhead_tokens=overhead)
    assert sorted(i for b in got for i in b) == list(range(n))
    assert _within_cap(got, lengths, cap)
    assert cost(got) == min(cost(p) for p in feasible)
    for k in range(1, n + 1):
        of_k = [p for p in feasible if len(p) == k]
        if not of_k:
            continue
        got = split_by_length(lengths, cap, num_parts=k)
        assert len(got) == k and _within_cap(got, lengths, cap)
        assert sorted(i for b in got for i in b) == list(range(n))
        assert cost(got) == min(cost(p) for p in of_k)


@pytest.mark.parametrize("seed", range(8))
def test_a_long_tail_plan_costs_no_more_than_cutting_packs_bins(seed):
    rng = random.Random(100 + seed)
    lengths = _long_tail(rng, rng.choice([16, 64, 128, 256]))
    # Some seeds as a vision-language batch: image patches count toward the cap.
    extra = [rng.choice([0, 0, 256, 1024]) for _ in lengths] if seed % 2 else None
    cap = rng.choice([4096, 16384])
    costs = [n + n * n / 4096 for n in lengths]
    bins = plan_micro_batches(lengths, max_tokens=cap, extra_tokens=extra)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b for b in bins)  # no dummies without a count group
    assert _within_cap(bins, lengths, cap, extra)
    # The old plan: pack's cost-balanced bins (sum of row + patches within the cap), each cut
    # by length on its own.
    sizes = [n + e for n, e in zip(lengths, extra or [0] * len(lengths), strict=True)]
    old = split_padded(pack(costs, max_tokens=cap, lengths=sizes), lengths, cap, extra)

    def cost(plan):
        return _padded(plan, lengths) + MICRO_BATCH_OVERHEAD_TOKENS * len(plan)

    assert cost(bins) <= cost(old)


def _as_ranks(monkeypatch, others_count):
    """This process as one of two ranks whose other rank plans `others_count` parts; counts
    the all-reduces."""
    calls = []

    def all_reduce_max(value, group, device):
        calls.append(value)
        return max(value, others_count)

    monkeypatch.setattr(_micro_batches, "_all_reduce_max", all_reduce_max)
    monkeypatch.setattr(_micro_batches.dist, "get_world_size", lambda group: 2)
    return calls


def test_a_rank_short_of_the_count_recuts_into_exactly_that_many(monkeypatch):
    lengths = _long_tail(random.Random(7))
    alone = plan_micro_batches(lengths, max_tokens=16384)
    calls = _as_ranks(monkeypatch, len(alone) + 3)
    bins = plan_micro_batches(lengths, max_tokens=16384, count_group=object())
    assert calls == [len(alone)]  # one all-reduce, of this rank's own count
    assert len(bins) == len(alone) + 3 and all(bins)  # real rows in every part, no dummy
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert _within_cap(bins, lengths, 16384)
    # The rank with the most parts keeps its plan, and all-reduces once all the same.
    calls = _as_ranks(monkeypatch, 1)
    assert plan_micro_batches(lengths, max_tokens=16384, count_group=object()) == alone
    assert calls == [len(alone)]


def test_a_rank_with_fewer_rows_than_the_count_runs_dummies(monkeypatch):
    calls = _as_ranks(monkeypatch, 5)
    bins = plan_micro_batches([10, 30], max_tokens=1000, count_group=object())
    assert bins == [[1], [0], [], [], []] and calls == [1]
    calls = _as_ranks(monkeypatch, 3)
    assert plan_micro_batches([], max_tokens=1000, count_group=object()) == [[], [], []]
    assert calls == [0]


_TWO_RANKS = """
import json, os, sys
import torch.distributed as dist
from yatt.core.data._micro_batches import plan_micro_batches
dist.init_process_group("gloo")
lengths = json.loads(sys.argv[1])[dist.get_rank()]
bins = plan_micro_batches(lengths, max_tokens=1000, count_group=dist.group.WORLD)
with open(os.path.join(sys.argv[2], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(bins, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_gloo_ranks_agree_on_the_count(tmp_path):
    # Rank 0: 6 rows of 500 at cap 1000, 2 a part at most -> 3 parts. Rank 1: 4 rows of 100,
    # one part alone, re-cut into exactly 3: parts of 2, 1 and 1 rows (400 padded tokens,
    # the same as one part).
    per_rank = [[500] * 6, [100] * 4]
    run_ranks(
        [sys.executable, "-c", _TWO_RANKS, json.dumps(per_rank), str(tmp_path)],
        2,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    bins = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [len(b) for b in bins] == [3, 3]
    assert sorted(len(b) for b in bins[0]) == [2, 2, 2]
    assert sorted(len(b) for b in bins[1]) == [1, 1, 2]
    for plan, lengths in zip(bins, per_rank, strict=True):
        assert sorted(i for b in plan for i in b) == list(range(len(lengths)))


def test_one_sample_over_the_context_is_refused_naming_its_length():
    # Only the longest sample is over: a check of any other row (the shortest) would pass it.
    with pytest.raises(
        ValueError, match="a sample has 5000 tokens, over the model's context of 4096"
    ):
        _micro_batches.check_context([12, 5000, 30], 4096)
    _micro_batches.check_context([12, 4096, 30], 4096)  # at the context: fits
    _micro_batches.check_context([], 4096)  # no samples: nothing to check
    _micro_batches.check_context([9000], None)  # no known context: nothing to check
