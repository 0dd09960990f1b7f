"""A policy's cost model: flops_cost's shape from Hugging Face configs as families name it, and
TorchPolicy.estimate_costs as the one weight of rank balancing; micro-batches are cut by length."""

import logging
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Qwen2VLConfig

from yatt.balance import flops_cost
from yatt.core import VISION_INPUTS_KEY, TorchPolicy, TorchPolicyConfig
from yatt.core.cost._cost_model import (
    estimate_flops_costs,
    estimate_megatron_memory,
    flops_shape,
    flops_shape_from_hf_config,
    has_gated_mlp,
)

NUM_GPUS = 0

VLM_WORKERS = Path(__file__).with_name("_vlm_workers.py")


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


def test_policy_micro_batches_cut_long_rows_apart_within_the_cap(tiny_model_dir):
    from yatt.core import Batch

    policy = TorchPolicy(
        TorchPolicyConfig(model_dir=tiny_model_dir, parallel="none", max_tokens_per_microbatch=64)
    )
    lengths = [30, 3, 3, 3, 3, 3, 3, 3, 3, 30]
    batch = Batch.from_samples([{"input_ids": torch.arange(n)} for n in lengths])
    bins = policy.plan_micro_batches(batch)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    # By hand: {both 30s} pads 60 <= 64 and {eight 3s} 24, 2 parts; any part mixing a 30 with
    # a 3 pads the 3 to 30, and one part (10 x 30 = 300) is over the cap.
    assert sorted(sorted(b) for b in bins) == [[0, 9], [1, 2, 3, 4, 5, 6, 7, 8]]


def test_batch_costs_are_the_costs_of_its_samples_lengths(tiny_model_dir):
    from yatt.core import Batch

    policy = TorchPolicy(TorchPolicyConfig(model_dir=tiny_model_dir, parallel="none"))
    lengths = [7, 2, 40, 2, 13]  # right-padded to 40 in the batch: padding is no cost
    batch = Batch.from_samples([{"input_ids": torch.arange(n)} for n in lengths])
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
    assert policy.estimate_batch_costs(batch) == expected.tolist()


def test_a_vision_language_policy_costs_the_images_its_batch_holds(tmp_path):
    # The trainer passes the batch alone; the policy finds the images (or none) in it.
    import importlib.util

    from yatt.testing import make_tiny_vlm

    spec = importlib.util.spec_from_file_location("_vlm_workers", VLM_WORKERS)
    workers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workers)
    make_tiny_vlm(tmp_path, arch="qwen2_vl")
    policy = TorchPolicy(workers.policy_config(str(tmp_path), "none", 10_000))
    batch = workers.make_global_batch(str(tmp_path))
    lengths = batch.lengths.tolist()
    # Each image's patches, straight from its (t, h, w) grid.
    patches = [
        [] if v is None else [int(t * h * w) for t, h, w in v.image_grid_thw.tolist()]
        for v in batch[VISION_INPUTS_KEY]
    ]
    assert any(patches) and not all(patches)
    costs = policy.estimate_batch_costs(batch)
    assert costs == policy.estimate_costs(lengths, image_patches=patches)
    text = policy.estimate_costs(lengths)
    for cost, text_cost, images in zip(costs, text, patches, strict=True):
        assert (cost > text_cost) if images else (cost == text_cost)
    # A text-only batch (no vision field at all) costs its tokens.
    text_batch = workers.make_global_batch(str(tmp_path), images_per_prompt=(0, 0))
    assert VISION_INPUTS_KEY not in text_batch
    assert policy.estimate_batch_costs(text_batch) == policy.estimate_costs(
        text_batch.lengths.tolist()
    )


def test_a_config_without_a_shape_weighs_by_tokens_and_says_so(tiny_model_dir, caplog, monkeypatch):
    import yatt.core.policy._torch_policy as torch_policy

    monkeypatch.setattr(torch_policy, "flops_shape_from_hf_config", lambda *a, **k: None)
    with caplog.at_level(logging.WARNING, logger="yatt.core"):
        policy = TorchPolicy(TorchPolicyConfig(model_dir=tiny_model_dir, parallel="none"))
    assert "by token count" in caplog.text
    assert policy.estimate_costs([4, 9]) == [4.0, 9.0]


def _causal_pairs_on_rank(length: int, cp_size: int, rank: int) -> int:
    """Query-key pairs of causal attention that CP rank `rank` computes: its two chunks (r and
    2cp-1-r of 2cp), query j seeing j + 1 keys; counted one query at a time."""
    chunk = length // (2 * cp_size)
    queries = [
        j
        for index in (rank, 2 * cp_size - 1 - rank)
        for j in range(index * chunk, (index + 1) * chunk)
    ]
    return sum(j + 1 for j in queries)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_context_parallel_cost_is_each_ranks_share(cp_size):
    shape = flops_shape(hidden_size=64, num_layers=2, ffn_hidden_size=160, is_gated_mlp=True)
    length = 48  # a multiple of 2 x cp: no padding
    per_rank = estimate_flops_costs([length], shape, cp_size=cp_size)[0]
    # Hand-built: linear FLOPs of length / cp tokens, attention of the rank's own pairs
    # (2 FLOPs per multiply-add, scores and values, per layer: flops_cost's 2 h L (L + 1)).
    linear_per_token = (flops_cost([1], **shape)[0] - 2 * 2 * 64 * 1 * 2) / 1
    for rank in range(cp_size):
        attention = 2 * 2 * 2 * 64 * _causal_pairs_on_rank(length, cp_size, rank)
        expected = linear_per_token * length / cp_size + attention
        assert per_rank == pytest.approx(expected, rel=1e-12)
    # A length off the 2 x cp grid is padded up to it, as the policy pads the sequence.
    assert estimate_flops_costs([length - 1], shape, cp_size=cp_size) == [per_rank]
    assert estimate_flops_costs([10], None, cp_size=2) == [12 / 2]
    with pytest.raises(ValueError, match="cp_size=0"):
        estimate_flops_costs([10], shape, cp_size=0)


QWEN25_7B = flops_shape(
    hidden_size=3584,
    num_layers=28,
    ffn_hidden_size=18944,
    num_heads=28,
    num_kv_heads=4,
    vocab_size=152064,
    is_gated_mlp=True,
)


def test_memory_estimate_counts_parameters_and_activations_by_hand():
    # Qwen2.5-7B's published size is 7.62e9 parameters (untied, 28 layers).
    one = estimate_megatron_memory(QWEN25_7B, tokens=8192)
    assert one.weights / 2 == pytest.approx(7.62e9, rel=0.01)
    assert one.grads == 2 * one.weights and one.optimizer == 6 * one.weights
    # Activations: 8192 tokens x 28 layers x 2 bytes x (6 h + 3 h + 3 kv + 4 f) values.
    h, kv, f = 3584, 512, 18944
    assert one.activations == pytest.approx(8192 * 28 * 2 * (9 * h + 3 * kv + 4 * f))
    assert one.gathered_kv == 0
    # TP 4 divides the weights (and the TP-region activations); the distributed optimizer
    # shards over dp x cp; CP halves the tokens a rank holds but gathers the keys and values.
    split = estimate_megatron_memory(QWEN25_7B, tokens=8192, tp_size=4, cp_size=2, dp_size=2)
    assert split.weights == pytest.approx(one.weights / 4)
    assert split.optimizer == pytest.approx(one.optimizer / 4 / 4)
    assert split.activations == pytest.approx(
        8192 / 2 * 28 * 2 * (6 * h + (3 * h + 3 * kv + 4 * f) / 4)
    )
    assert split.gathered_kv == pytest.approx(2 * 2 * kv / 4 * 8192 * 28)
    # PP 4: the first stage holds 7 layers plus the embedding, and 4 micro-batches in flight.
    staged = estimate_megatron_memory(QWEN25_7B, tokens=8192, pp_size=4)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    assert staged.weights == pytest.approx(2 * (7 * per_layer + 152064 * h))
    assert staged.activations == pytest.approx(one.activations)
    assert estimate_megatron_memory(
        QWEN25_7B, tokens=8192, pp_size=4, num_microbatches=1
    ).activations == pytest.approx(one.activations / 4)
    assert set(one.gib()) == {
        "weights",
        "grads",
        "optimizer",
        "activations",
        "gathered_kv",
        "total",
    }
    with pytest.raises(ValueError, match="cp_size=0"):
        estimate_megatron_memory(QWEN25_7B, tokens=8, cp_size=0)


def test_full_recompute_keeps_unit_inputs_and_rebuilds_one_unit():
    """Hand-computed: h 8, 4 layers, SwiGLU f 16, 2 heads over 1 KV head (kv = 4), 10 tokens.
    Kept per token and layer without recompute: 2 bytes x (6 h + 3 h + 3 kv + 4 f) = 296 B.
    Full recompute keeps each unit's input (2 bytes x h = 16 B per token) for every micro-batch
    in flight, and rebuilds one unit of layers for one micro-batch in the backward."""
    shape = flops_shape(
        hidden_size=8,
        num_layers=4,
        ffn_hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        is_gated_mlp=True,
    )
    assert estimate_megatron_memory(shape, tokens=10).activations == 296 * 10 * 4
    # One layer per unit: 4 inputs of 10 x 16 B, plus one layer's 10 x 296 B.
    assert estimate_megatron_memory(shape, tokens=10, recompute_num_layers=1).activations == (
        640 + 2960
    )
    # Two layers per unit: 2 inputs, plus two layers rebuilt.
    assert estimate_megatron_memory(shape, tokens=10, recompute_num_layers=2).activations == (
        320 + 5920
    )
    # PP 2 (1F1B, 2 micro-batches in flight on the first stage): 2 layers x 2 micro-batches of
    # inputs, one layer of one micro-batch rebuilt.
    staged = estimate_megatron_memory(shape, tokens=10, pp_size=2, recompute_num_layers=1)
    assert staged.activations == 2 * 2 * 160 + 2960
    # CP 2: a rank holds 5 tokens; the gathered keys and values (2 B x 2 kv x 10 tokens per
    # layer) are kept for the rebuilt layer only, not for all 4.
    split = estimate_megatron_memory(shape, tokens=10, cp_size=2, recompute_num_layers=1)
    assert split.activations == 4 * 5 * 16 + 296 * 5
    assert split.gathered_kv == 2 * 2 * 4 * 10 * 1
    assert estimate_megatron_memory(shape, tokens=10, cp_size=2).gathered_kv == 160 * 4
    for bad, pp in ((0, 1), (3, 2), (True, 1)):
        with pytest.raises(ValueError, match=f"recompute_num_layers={bad!r}"):
            estimate_megatron_memory(shape, tokens=10, pp_size=pp, recompute_num_layers=bad)
