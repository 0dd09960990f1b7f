"""The trainer's response-length quantiles (grpo_metrics.response_length_metrics), one rank."""

NUM_GPUS = 0

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from grpo_metrics import response_length_metrics

from yatt.core import Batch


def _batch(lengths: list[int]) -> Batch:
    rows = [
        {"input_ids": [1, 2] + [3] * n, "loss_mask": [0, 0] + [1] * n, "reward": 0.0}
        for n in lengths
    ]  # rows padded to the longest: the mask, not the width, is a response's length
    return Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])


def test_quantiles_are_lengths_a_response_had_by_nearest_rank():
    lengths = list(range(1, 11))
    random.Random(0).shuffle(lengths)
    # 10 responses of 1..10 tokens: the median is the 5th smallest (5, not 5.5), p90 the 9th
    assert response_length_metrics(_batch(lengths), None) == {
        "response/length_p50": 5.0,
        "response/length_p90": 9.0,
        "response/length_max": 10.0,
    }
    # one long response among short ones moves the max, not the median
    assert response_length_metrics(_batch([4, 4, 4, 4, 512]), None) == {
        "response/length_p50": 4.0,
        "response/length_p90": 512.0,
        "response/length_max": 512.0,
    }


def test_an_empty_batch_logs_zeros():
    empty = Batch.from_samples([], token_keys=["input_ids", "loss_mask"], like=_batch([1]))
    assert set(response_length_metrics(empty, None).values()) == {0.0}
