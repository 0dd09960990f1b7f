"""A policy's cost model: flops_cost's shape from Hugging Face configs as families name it, and
TorchPolicy.estimate_costs as the one weight of micro-batch packing and rank balancing."""

import logging

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Qwen2VLConfig

from yatt.balance import flops_cost
from yatt.core import TorchPolicy, TorchPolicyConfig
from yatt.core._cost_model import (
    estimate_flops_costs,
    flops_shape,
    flops_shape_from_hf_config,
    has_gated_mlp,
)

NUM_GPUS = 0


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        pytest.param(
            LlamaConfig(
                hidden_size=64,
                num_hidden_layers=3,
                intermediate_size=160,
                num_attention_heads=8,
                num_key_value_heads=2,
                vocab_size=300,
            ),
            {"hidden_size": 64, "num_layers": 3, "ffn_hidden_size": 160, "num_heads": 8}
            | {"num_kv_heads": 2, "vocab_size": 300},
            id="llama",
        ),
        pytest.param(
            # GPT-2 names the MLP width n_inner and leaves it None: flops_cost's 4 h default.
            GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=100),
            {"hidden_size": 48, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4}
            | {"vocab_size": 100},
            id="gpt2",
        ),
        pytest.param(
            # A multimodal config: the text decoder's shape.
            Qwen2VLConfig(
                text_config={
                    "hidden_size": 32,
                    "num_hidden_layers": 2,
                    "intermediate_size": 96,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "vocab_size": 128,
                }
            ),
            {"hidden_size": 32, "num_layers": 2, "ffn_hidden_size": 96, "num_heads": 4}
            | {"num_kv_heads": 2, "vocab_size": 128},
            id="qwen2-vl-text",
        ),
    ],
)
def test_shape_from_hf_configs_as_families_name_it(config, expected):
    assert flops_shape_from_hf_config(config, is_gated_mlp=False) == expected | {
        "is_gated_mlp": False
    }


def test_shape_leaves_out_what_flops_cost_cannot_take():
    assert flops_shape(hidden_size=None, num_layers=2) is None
    assert flops_shape(hidden_size=64, num_layers=0) is None
    # A head size apart from hidden_size / heads (Qwen3-style): heads are left out, not an error.
    assert flops_shape(hidden_size=64, num_layers=2, num_heads=6) == {
        "hidden_size": 64,
        "num_layers": 2,
        "is_gated_mlp": False,
    }
    assert estimate_flops_costs([3, 5], None) == [3.0, 5.0]


def test_policy_estimates_its_model_shape(tiny_model_dir):
    policy = TorchPolicy(TorchPolicyConfig(model_dir=tiny_model_dir, parallel="none"))
    assert has_gated_mlp(policy.module)  # llama: gate_proj
    lengths = [4, 17, 64]
    costs = policy.estimate_costs(lengths)
    assert isinstance(costs, list) and all(isinstance(c, float) for c in costs)
    c = policy.model_config
    expected = flops_cost(
        lengths,
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        ffn_hidden_size=c.intermediate_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        vocab_size=c.vocab_size,
        is_gated_mlp=True,
    )
    assert costs == expected.tolist()
    # Attention is quadratic: 16x the tokens cost more than 16x.
    assert costs[2] > 16 * costs[0]


def test_micro_batches_are_packed_by_the_policy_costs(tiny_model_dir, monkeypatch):
    from yatt.core import Batch

    policy = TorchPolicy(
        TorchPolicyConfig(model_dir=tiny_model_dir, parallel="none", max_tokens_per_microbatch=64)
    )
    seen = []
    estimate = policy.estimate_costs
    monkeypatch.setattr(
        policy, "estimate_costs", lambda lengths: seen.append(lengths) or estimate(lengths)
    )
    lengths = [30, 3, 3, 3, 3, 3, 3, 3, 3, 30]
    batch = Batch.from_samples([{"input_ids": torch.arange(n)} for n in lengths])
    bins = policy.plan_micro_batches(batch)
    assert seen == [lengths]
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))


def test_a_config_without_a_shape_weighs_by_tokens_and_says_so(tiny_model_dir, caplog, monkeypatch):
    import yatt.core._torch_policy as torch_policy

    monkeypatch.setattr(torch_policy, "flops_shape_from_hf_config", lambda *a, **k: None)
    with caplog.at_level(logging.WARNING, logger="yatt.core"):
        policy = TorchPolicy(TorchPolicyConfig(model_dir=tiny_model_dir, parallel="none"))
    assert "by token count" in caplog.text
    assert policy.estimate_costs([4, 9]) == [4.0, 9.0]
