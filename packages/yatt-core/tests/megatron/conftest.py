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
    """Run _cpu_workers.py on `world_size` gloo ranks (one per TP rank); each rank's result.
    Skips the test without megatron-core."""
    pytest.importorskip(
        "megatron.core", reason="megatron-core is not installed (yatt-core[megatron])"
    )
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
    tp = request.param
    out_dir = tmp_path_factory.mktemp("megatron-cpu") / f"tp{tp}"
    results = launch_megatron(out_dir, "all", tp, model_dirs=tiny_model_dirs, cases=CASES[tp])
    return tp, results


# Layouts compared in one 2-rank launch (see _cpu_workers.layouts); {} is pp=1 (dp=2 on the
# same batch: the same mean loss and gradient as one rank).
# The cross-layout checkpoint scenario's key in the layouts' results (_cpu_workers).
CHECKPOINTS = "checkpoints"
LAYOUTS = [
    {},
    {"pp_size": 2},
    {"pp_size": 2, "virtual_pp_size": 2},
    {"pack_sequences": True},
    {"pp_size": 2, "pack_sequences": True},
    {"cp_size": 2},
    # Full activation recompute under the 1F1B schedule and under context parallelism (the
    # recomputed layers rerun CP's key/value all-gather in the backward).
    {"pp_size": 2, "recompute_granularity": "full"},
    {"cp_size": 2, "recompute_granularity": "full"},
]


@pytest.fixture(scope="session")
def megatron_layout_results(tmp_path_factory):
    """{layout key: [rank 0's result, rank 1's]} of a 4-layer Qwen2 (the interleaved schedule
    needs layers divisible by pp x virtual stages)."""
    model_dir = tmp_path_factory.mktemp("tiny-qwen2-4layers")
    make_tiny_causal_lm(model_dir, arch="qwen2", num_heads=8, num_kv_heads=4, num_layers=4, seed=1)
    out_dir = tmp_path_factory.mktemp("megatron-layouts") / "out"
    results = launch_megatron(out_dir, "layouts", 2, model_dir=str(model_dir), cases=LAYOUTS)
    keys = [json.dumps(case, sort_keys=True) for case in LAYOUTS] + [CHECKPOINTS]
    return {key: [r[key] for r in results] for key in keys}


# Activation-recompute cases of one 1-rank launch (see _cpu_workers.recompute); {} is off.
RECOMPUTE_CASES = [
    {},
    {"recompute_granularity": "full"},
    {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
]


@pytest.fixture(scope="session")
def megatron_recompute_results(tmp_path_factory, tiny_model_dirs):
    """{case key: rank 0's result} of the 2-layer Qwen2 at each RECOMPUTE_CASES case."""
    out_dir = tmp_path_factory.mktemp("megatron-recompute") / "out"
    (results,) = launch_megatron(
        out_dir, "recompute", 1, model_dir=tiny_model_dirs["qwen2"], cases=RECOMPUTE_CASES
    )
    return results


@pytest.fixture(scope="session")
def megatron_sequential_runtimes_result(tmp_path_factory, tiny_model_dirs):
    """Rank 0's result of two runtimes one after the other, each with a MegatronPolicy."""
    out_dir = tmp_path_factory.mktemp("megatron-runtimes") / "out"
    (result,) = launch_megatron(
        out_dir, "sequential_runtimes", 1, model_dir=tiny_model_dirs["qwen2"]
    )
    return result
