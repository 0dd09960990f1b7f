"""TorchPolicy on CUDA: matches CPU, bf16 steps, sleep frees GPU memory; DDP/FSDP2 on NCCL.

Run on a GPU machine:  pytest packages/yatt-core/tests/test_cuda.py
The NCCL test needs 2 GPUs and is skipped with fewer.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from yatt.core import PolicyLoss, TorchPolicy, TorchPolicyConfig, init_runtime

NUM_GPUS = 1

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_spec = importlib.util.spec_from_file_location("_workers", Path(__file__).with_name("_workers.py"))
workers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workers)


def _policy(model_dir, runtime=None, **overrides):
    config = workers.policy_config(model_dir, "none", max_tokens=24)
    return TorchPolicy(TorchPolicyConfig(**{**config.__dict__, **overrides}), runtime)


def test_cuda_step_matches_cpu(tiny_model_dir):
    results = {}
    for device in ("cpu", "cuda"):
        with init_runtime(device=device) as rt:
            policy = _policy(tiny_model_dir, rt)
            assert policy.device.type == device
            # compile_head_logprobs=None (the default): compiled on CUDA, eager on CPU.
            assert policy._should_compile_head == (device == "cuda")
            batch = workers.make_global_batch()
            results[device] = workers.run_policy_step(policy, batch, PolicyLoss())
    cpu, gpu = results["cpu"], results["cuda"]
    torch.testing.assert_close(gpu["old_logprobs"], cpu["old_logprobs"], atol=1e-4, rtol=0)
    assert gpu["metrics"]["loss"] == pytest.approx(cpu["metrics"]["loss"], rel=1e-4, abs=1e-5)
    assert gpu["metrics"]["grad_norm"] == pytest.approx(cpu["metrics"]["grad_norm"], rel=1e-3)
    for name, tensor in cpu["weights"].items():
        torch.testing.assert_close(gpu["weights"][name], tensor, atol=2e-4, rtol=0)


def test_bf16_step_and_sleep_frees_gpu_memory(tiny_model_dir):
    policy = _policy(tiny_model_dir, dtype="bfloat16")
    batch = workers.make_global_batch()
    batch.tokens["old_logprobs"] = policy.logprobs(batch)
    metrics = policy.train_step(batch, PolicyLoss())
    assert metrics["is_skipped"] == 0.0 and metrics["grad_norm"] > 0
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    policy.sleep()
    asleep = torch.cuda.memory_allocated()
    # Weights and AdamW moments (3 x params in float32) leave the GPU.
    params = sum(p.numel() * 4 for p in policy.module.parameters())
    assert awake - asleep >= 2.5 * params
    policy.wake_up()
    assert policy.train_step(batch, PolicyLoss())["is_skipped"] == 0.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_nccl_data_parallel_matches_single_process(launch, tiny_model_dir):
    runs = [("ddp", "token_mean"), ("fsdp2", "token_mean")]
    ranks = launch("policy", 2, cuda=True, model_dir=tiny_model_dir, runs=runs)
    config = workers.policy_config(tiny_model_dir, "none", max_tokens=10_000)
    loss_fn = PolicyLoss(clip_high=0.28)  # as the workers use
    ref = workers.run_policy_step(TorchPolicy(config), workers.make_global_batch(), loss_fn)
    for run in runs:
        for result in ranks:
            out = result[run]
            # The sleep before the step freed this rank's weights (shards under FSDP2).
            assert out["freed_bytes"] >= 0.9 * out["param_bytes"], (run, out["freed_bytes"])
            got = {k: out["metrics"][k] for k in ("loss", "grad_norm")}
            want = {k: ref["metrics"][k] for k in ("loss", "grad_norm")}
            assert got == pytest.approx(want, rel=1e-3), f"{run}: {got} != {want}"
            for name, tensor in ref["weights"].items():
                torch.testing.assert_close(out["weights"][name], tensor, atol=2e-4, rtol=0)
