NUM_GPUS = 1  # the TP=2 test needs 2 and skips otherwise

"""MegatronPolicy on CUDA (megatron-core calls CUDA directly; nothing here runs on CPU).

Each test runs _gpu_workers.py under torchrun on a small saved model and checks its report:
logprobs vs the float32 HF model (bf16 tolerance), first-step loss vs TorchPolicy, bitwise weight
export, bitwise logprobs after sleep/wake_up, bitwise checkpoint round trip, TP=2 vs TP=1,
full activation recompute vs none (the same step, less peak memory).
bench/megatron/megatron_parity.py runs the same worker over all three families and more layouts.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from yatt.testing import make_tiny_causal_lm

WORKER = Path(__file__).with_name("_gpu_workers.py")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="MegatronPolicy needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None,
        reason="megatron-core is not installed (yatt-core[megatron])",
    ),
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3")
    make_tiny_causal_lm(
        path,
        arch="qwen3",
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=512,
        seed=3,
    )
    return str(path)


def _run(nproc: int, tp: int, model_dir: str, out: Path, *extra: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKER),
        "--tp",
        str(tp),
        "--model-dirs",
        json.dumps({"qwen3": model_dir}),
        "--out",
        str(out),
        *extra,
    ]
    subprocess.run(cmd, check=True, timeout=600)
    results = json.loads(out.read_text())
    return {
        **results["families"]["qwen3"],
        "packing": results.get("packing"),
        "recompute": results.get("recompute"),
    }


@pytest.fixture(scope="module")
def tp1(qwen3_dir, tmp_path_factory) -> dict:
    return _run(
        1,
        1,
        qwen3_dir,
        tmp_path_factory.mktemp("tp1") / "r.json",
        "--torch-ref",
        "--pack-check",
        "--recompute-check",
    )


def test_logprobs_match_hf_in_bf16(tp1):
    assert tp1["logprobs_vs_hf"]["mean_abs"] < 2e-2
    assert tp1["logprobs_vs_hf"]["max_abs"] < 0.25


def test_first_step_loss_matches_torch_policy(tp1):
    assert tp1["megatron_losses"][0] == pytest.approx(tp1["torch_losses"][0], abs=2e-2)
    # The step changed the model: the second loss differs from the first.
    assert tp1["megatron_losses"][1] != tp1["megatron_losses"][0]


def test_weight_export_sleep_and_checkpoint_are_exact(tp1):
    assert tp1["weights_bitwise_equal"]
    assert tp1["sleep"]["logprobs_bitwise_after_wake"]
    # Sleep frees what the policy owns (its buffers, parameters, optimizer state, counted from
    # its objects): the allocator's drop must cover nearly all of it. Comparing the totals
    # instead counts memory that is not the policy's (cuBLAS's workspaces, 64 MiB each on an
    # H200, stay for the process's life), which made a tiny model's sleep look like a failure.
    sleep = tp1["sleep"]
    freed = sleep["allocated_awake_bytes"] - sleep["allocated_asleep_bytes"]
    assert sleep["policy_bytes"] > 0
    assert freed >= 0.9 * sleep["policy_bytes"], sleep
    assert tp1["ckpt_weights_bitwise"]
    resumed, continued = tp1["ckpt_loss_resumed_vs_continued"]
    assert resumed == pytest.approx(continued, abs=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs")
def test_tp2_equals_tp1(tp1, qwen3_dir, tmp_path):
    tp2 = _run(2, 2, qwen3_dir, tmp_path / "r.json")
    diffs = [
        abs(a - b)
        for sid, lp in tp2["logprobs"].items()
        for a, b in zip(lp, tp1["logprobs"][sid], strict=True)
    ]
    assert sum(diffs) / len(diffs) < 1e-2
    assert tp2["megatron_losses"][0] == pytest.approx(tp1["megatron_losses"][0], abs=1e-2)
    assert tp2["weights_bitwise_equal"] and tp2["ckpt_weights_bitwise"]


def test_packed_sequences_match_padded(tp1):
    """pack_sequences=True (THD, per-row SDPA) against the padded batch on one GPU, bf16."""
    packing = tp1["packing"]
    assert packing["logprobs_packed_vs_padded"]["mean_abs"] < 1e-2
    assert packing["loss_packed"] == pytest.approx(packing["loss_padded"], abs=1e-2)
    assert packing["num_padding_tokens_saved"] > 0


def test_full_recompute_keeps_the_step_and_holds_fewer_activations(tp1):
    """recompute_granularity="full" (uniform, 1 layer) against none, bf16 on one GPU: the
    forward is the same computation (the same loss, up to the kernel SDPA picks without
    grad), the backward reruns it (the same gradient norm up to kernel order), and the step's peak memory above its start is smaller: 4 layers
    keep their inputs (h values per token) instead of every activation (~18 h)."""
    off, full = tp1["recompute"]["None"], tp1["recompute"]["full"]
    assert (off["tf_granularity"], full["tf_granularity"]) == (None, "full")
    assert full["loss"] == pytest.approx(off["loss"], abs=1e-3)
    assert full["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-2)
    assert full["step_peak_bytes"] < off["step_peak_bytes"], tp1["recompute"]
