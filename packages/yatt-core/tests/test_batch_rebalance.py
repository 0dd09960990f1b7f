"""Batch.rebalance and Batch.restore on 2, 3 and 4 gloo ranks: each rank ends with exactly the
padded batch the plan gives it, and restore brings every sample home with the fields added on
the way (see _rebalance_worker.py for the cases)."""

NUM_GPUS = 0

import sys
from pathlib import Path

import pytest

from yatt.testing import run_ranks

WORKER = Path(__file__).with_name("_rebalance_worker.py")


@pytest.mark.parametrize("world_size", [2, 3, 4], ids=["2-ranks", "3-ranks", "4-ranks"])
def test_rebalance_and_restore_give_each_rank_its_expected_batch(world_size):
    # Uneven counts and lengths, GRPO groups, equal_size, tolerance 0 with costs, ranks that
    # start or end empty, every field kind (multi-dim tokens, bf16, bool, numpy metadata),
    # fields added before restore; with 2 ranks also rows with differing fields refused and
    # differing dtypes promoted.
    run_ranks([sys.executable, str(WORKER)], world_size, env={"CUDA_VISIBLE_DEVICES": ""})
