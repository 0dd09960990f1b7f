NUM_GPUS = 0

"""Megatron-Core's activation recompute through MegatronPolicy on CPU (gloo, 1 rank; see
_cpu_shim.py): the options reach the TransformerConfig the policy builds, megatron-core's
checkpoint runs where each option says, and recomputing changes none of the math (logprobs,
losses, gradients and the optimizer steps equal the run that keeps every activation).
Skipped without megatron-core."""

import json

import pytest
import torch

# The keys of conftest.RECOMPUTE_CASES.
OFF = json.dumps({}, sort_keys=True)
FULL = json.dumps({"recompute_granularity": "full"}, sort_keys=True)
BLOCK = json.dumps(
    {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    sort_keys=True,
)
SELECTIVE = json.dumps(
    {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
    sort_keys=True,
)


@pytest.mark.parametrize("key", [FULL, BLOCK, SELECTIVE], ids=["full", "block", "selective"])
def test_recompute_gives_the_same_logprobs_losses_gradients_and_steps(
    megatron_recompute_results, key
):
    reference, got = megatron_recompute_results[OFF], megatron_recompute_results[key]
    # The same kernels on the same inputs in float32: recompute only reruns them.
    torch.testing.assert_close(got["logprobs"], reference["logprobs"], atol=1e-6, rtol=0)
    for step, want in zip(got["metrics"], reference["metrics"], strict=True):
        for name in ("loss", "grad_norm", "pg_loss", "entropy", "num_loss_tokens"):
            assert step[name] == pytest.approx(want[name], rel=1e-6, abs=1e-7), name
    assert reference["metrics"][0]["loss"] != reference["metrics"][1]["loss"]  # a step moved
    assert set(got["grads"]) == set(reference["grads"])
    assert any(g.abs().sum() > 0 for g in reference["grads"].values())
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, atol=1e-6, rtol=0, msg=name)


def test_the_built_transformer_config_carries_the_recompute_options(megatron_recompute_results):
    configs = {key: r["tf_config"] for key, r in megatron_recompute_results.items()}
    assert configs[OFF]["recompute_granularity"] is None
    # "full" alone means every layer, one at a time: uniform units of one layer.
    assert configs[FULL] == {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
        "recompute_modules": ["core_attn"],  # megatron's default, unused by "full"
    }
    assert configs[BLOCK]["recompute_method"] == "block"
    assert configs[BLOCK]["recompute_num_layers"] == 1
    assert configs[SELECTIVE]["recompute_granularity"] == "selective"
    assert configs[SELECTIVE]["recompute_modules"] == ["core_attn", "mlp"]


def test_megatron_checkpoints_what_each_option_names(megatron_recompute_results):
    """Calls of megatron-core's tensor_parallel.checkpoint in the two train steps: each call
    is one unit whose activations are dropped and recomputed in the backward."""
    for key, r in megatron_recompute_results.items():
        layers = r["num_layers"]
        forwards = sum(int(m["num_micro_batches"]) for m in r["metrics"])
        expected = {
            OFF: 0,
            FULL: layers * forwards,  # each layer its own unit
            BLOCK: 1 * forwards,  # the first layer of the chunk only
            SELECTIVE: 2 * layers * forwards,  # core attention and the MLP of every layer
        }[key]
        assert layers == 2 and forwards > 2
        # megatron-core also wraps the MLP in no-grad forwards (logprobs); those keep nothing.
        assert r["checkpoint_calls"] - r["checkpoint_calls_in_logprobs"] == expected, key
