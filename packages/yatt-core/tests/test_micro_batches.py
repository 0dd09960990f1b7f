"""yatt.core.data._micro_batches: padded micro-batches cut where padding costs more than a
micro-batch. Expected cuts are worked out by hand from rows x longest row + overhead."""

NUM_GPUS = 0

import random

import pytest

from yatt.core.data._micro_batches import plan_micro_batches, split_padded


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
    # 16,384 // 384 = 42 rows at most: 4 parts, no fewer (padding is the same for any cut)
    assert len(bins) == 4 and max(len(b) for b in bins) <= 42
    assert _padded(bins, lengths) == 128 * 384


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
    costs = [n + n * n / 4096 for n in lengths]
    bins = plan_micro_batches(costs, lengths, max_tokens=16384)
    assert sorted(i for b in bins for i in b) == list(range(128))
    assert all(len(b) * max(lengths[i] for i in b) <= 16384 for b in bins)
    # Rows cut by length pad within 20% of the real tokens (cut only at the cap, ~1.7x)
    assert _padded(bins, lengths) <= 1.2 * sum(lengths)
