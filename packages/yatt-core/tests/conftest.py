"""Fixtures: a tiny local model, and a launcher for multi-process gloo scenarios."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).with_name("_workers.py")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from yatt.testing import make_tiny_causal_lm

    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_causal_lm(path, arch="llama", max_position_embeddings=64)
    return str(path)


@pytest.fixture
def launch(tmp_path):
    """launch(scenario, world_size, **kwargs) runs tests/_workers.py on `world_size` ranks (gloo
    on CPU; NCCL, one GPU each, with cuda=True) and returns each rank's result (a dict loaded
    with torch.load)."""

    def run(scenario: str, world_size: int, timeout_s: float = 120, cuda: bool = False, **kwargs):
        import torch

        from yatt.testing import run_ranks

        out_dir = tmp_path / f"{scenario}-{world_size}"
        out_dir.mkdir()
        args = [sys.executable, str(WORKERS), scenario, str(out_dir), json.dumps(kwargs)]
        run_ranks(
            args, world_size, env={} if cuda else {"CUDA_VISIBLE_DEVICES": ""}, timeout_s=timeout_s
        )
        return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]

    return run
