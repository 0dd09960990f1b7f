"""Helpers shared by this package's tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dist_worker.py")


@pytest.fixture
def run_ranks():
    """`run_ranks(world_size, backend)`: run dist_worker.py on that many local processes."""
    return _run_ranks


def _run_ranks(world_size: int, backend: str, timeout_s: float = 120.0) -> None:
    """Run dist_worker.py as `world_size` processes on localhost; fail with their output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), "--backend", backend],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    failed = [
        (r, p.returncode, out)
        for r, (p, out) in enumerate(zip(procs, outputs, strict=True))
        if p.returncode
    ]
    assert not failed, "\n".join(f"rank {r} exited {code}:\n{out}" for r, code, out in failed)
