"""rebalance/restore over NCCL with CUDA tensors (2 GPUs); skipped without them."""

NUM_GPUS = 2

import sys
from pathlib import Path

import pytest
import torch

from yatt.testing import run_ranks

WORKER = Path(__file__).with_name("across_ranks_worker.py")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL"),
]


def test_rebalance_restore_round_trip_nccl():
    # Same checks as the gloo test, with payload tensors on cuda:rank (and one CPU tensor,
    # which must come back on the CPU) travelling GPU to GPU.
    run_ranks([sys.executable, str(WORKER), "--backend", "nccl"], 2)
