"""rebalance/restore round trips across real gloo process groups (CPU)."""

NUM_GPUS = 0

import sys
from pathlib import Path

import pytest

from yatt.testing import run_ranks

WORKER = Path(__file__).with_name("across_ranks_worker.py")


@pytest.mark.parametrize("world_size", [2, 4], ids=["2-ranks", "4-ranks"])
def test_rebalance_restore_round_trip_gloo(world_size):
    # Uneven and empty ranks, nested dict/namedtuple/bool/bf16 payloads, GRPO groups,
    # equal_size, and bad input on one rank raising on all: see dist_worker.main.
    run_ranks([sys.executable, str(WORKER), "--backend", "gloo"], world_size)
