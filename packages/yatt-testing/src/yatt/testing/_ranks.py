"""Run one script as N local ranks (torch.distributed env vars set), for multi-process tests;
run_rank_script also writes the script and reads each rank's JSON result line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port free on the loopback interface now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    args: Sequence[str],
    world_size: int,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
) -> list[str]:
    """Start `args` once per rank with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* set; wait for all.

    Returns each rank's output. Raises AssertionError carrying the output of every rank that
    failed (the first rank to fail is often not rank 0), and kills all ranks on a timeout.
    """
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        rank_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        rank_env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                list(args), env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
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
    assert not failed, "\n".join(f"--- rank {r} ---\n{logs[r][-3000:]}" for r in failed)
    return logs


RESULT_PREFIX = "RESULT "  # a rank script's result line: this prefix, then one JSON value


def run_rank_script(
    source: str,
    world_size: int,
    folder: str | os.PathLike[str],
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run the Python `source` (dedented) as `world_size` ranks (run_ranks) and return the JSON
    value each rank printed on its line `RESULT <json>`, in rank order. The script is written
    to `folder` (a test's tmp_path) and gets `args` after its path.

    The rank script's side: `print("RESULT " + json.dumps(value), flush=True)`. AssertionError
    unless every rank printed exactly one such line."""
    script = Path(folder) / "rank_script.py"
    script.write_text(textwrap.dedent(source))
    logs = run_ranks([sys.executable, str(script), *args], world_size, env=env, timeout_s=timeout_s)
    results = []
    for rank, log in enumerate(logs):
        lines = [line for line in log.splitlines() if line.startswith(RESULT_PREFIX)]
        assert len(lines) == 1, f"rank {rank} printed {len(lines)} result lines:\n{log[-3000:]}"
        results.append(json.loads(lines[0].removeprefix(RESULT_PREFIX)))
    return results
