"""Fixtures for the Megatron backend's tests: megatron-core CPU scenarios on gloo ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from yatt.testing import make_tiny_causal_lm, run_ranks

CPU_WORKERS = Path(__file__).with_name("_cpu_workers.py")
ARCHS = ("llama", "qwen2", "qwen3")
# (attention, temperature) cases of the parity scenario, per tensor-parallel size.
CASES = {1: [("megatron", 1.0), ("sdpa", 0.7)], 2: [("sdpa", 1.0)]}


def launch_megatron(
    out_dir: Path, scenario: str, world_size: int, timeout_s: float = 400, **kwargs
):
    """Run _cpu_workers.py on `world_size` gloo ranks (one per TP rank); each rank's result."""
    out_dir.mkdir(parents=True)
    args = [sys.executable, str(CPU_WORKERS), scenario, str(out_dir), json.dumps(kwargs)]
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    run_ranks(args, world_size, env=env, timeout_s=timeout_s)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """A saved tiny model per family: 8 query heads in 4 groups, so tp=2 splits whole groups."""
    dirs = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        make_tiny_causal_lm(path, arch=arch, num_heads=8, num_kv_heads=4, seed=1)
        dirs[arch] = str(path)
    return dirs


@pytest.fixture(scope="session", params=sorted(CASES), ids=lambda tp: f"tp{tp}")
def megatron_cpu_results(request, tmp_path_factory, tiny_model_dirs):
    """Every rank's results of the 'all' scenario at one TP size (one launch per size)."""
    pytest.importorskip(
        "megatron.core", reason="megatron-core is not installed (yatt-core[megatron])"
    )
    tp = request.param
    out_dir = tmp_path_factory.mktemp("megatron-cpu") / f"tp{tp}"
    results = launch_megatron(out_dir, "all", tp, model_dirs=tiny_model_dirs, cases=CASES[tp])
    return tp, results
