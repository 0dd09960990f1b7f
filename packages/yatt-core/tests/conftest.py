"""Fixtures: a tiny local model, and a launcher for multi-process gloo scenarios."""

from __future__ import annotations

import json
import os
import socket
import subprocess
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def launch(tmp_path):
    """launch(scenario, world_size, **kwargs) runs tests/_workers.py on `world_size` ranks (gloo
    on CPU; NCCL, one GPU each, with cuda=True) and returns each rank's result (a dict loaded
    with torch.load)."""

    def run(scenario: str, world_size: int, timeout_s: float = 120, cuda: bool = False, **kwargs):
        import torch

        out_dir = tmp_path / f"{scenario}-{world_size}"
        out_dir.mkdir()
        port = _free_port()
        procs = []
        for rank in range(world_size):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            if not cuda:
                env["CUDA_VISIBLE_DEVICES"] = ""
            args = [sys.executable, str(WORKERS), scenario, str(out_dir), json.dumps(kwargs)]
            procs.append(
                subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            )
        logs = []
        for proc in procs:
            try:
                stdout, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise
            logs.append(stdout.decode(errors="replace"))
        failed = [r for r, proc in enumerate(procs) if proc.returncode != 0]
        # Every failed rank's log: the first rank to fail is often not the one listed first.
        assert not failed, "\n".join(f"--- rank {r} ---\n{logs[r][-3000:]}" for r in failed)
        return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]

    return run
