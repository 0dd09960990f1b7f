NUM_GPUS = 0

"""HF <-> Megatron weight mapping and tensor-parallel shards, on plain CPU tensors."""

import pytest
import torch

from yatt.core.policy.megatron._config import layout_from_hf_config, padded_vocab_size
from yatt.core.policy.megatron._weights import (
    global_layer_name,
    hf_to_megatron,
    megatron_names,
    megatron_shapes,
    megatron_to_hf,
    tp_gather,
    tp_partition_dim,
    tp_split,
)
from yatt.testing import make_tiny_causal_lm

ARCHS = ["llama", "qwen2", "qwen3"]


def _model(arch: str, **kwargs):
    # 8 heads in 4 groups, so tp=4 still gives every rank a whole group.
    kwargs.setdefault("num_heads", 8)
    kwargs.setdefault("num_kv_heads", 4)
    kwargs.setdefault("hidden_size", 64)
    return make_tiny_causal_lm(arch=arch, **kwargs)


def _hf_state(model) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # saved once, as safetensors does
    # Make every row distinct, so a mapping that moved rows around could not pass by luck.
    return {
        k: v + torch.arange(v.numel(), dtype=v.dtype).reshape(v.shape) * 1e-3
        for k, v in state.items()
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("is_tied", [False, True], ids=["untied", "tied"])
def test_round_trip_is_bitwise(arch, is_tied):
    model = _model(arch, tie_word_embeddings=is_tied)
    layout = layout_from_hf_config(model.config)
    hf = _hf_state(model)
    padded = padded_vocab_size(layout.vocab_size, tp_size=2, divisible_by=128)
    mg = hf_to_megatron(hf, layout, padded_vocab=padded)
    assert list(mg) == megatron_names(layout)
    assert ("output_layer.weight" in mg) == (not is_tied)
    back = megatron_to_hf(mg, layout)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_qkv_groups_query_heads_with_their_key_and_value(arch):
    model = _model(arch)
    layout = layout_from_hf_config(model.config)
    hf = _hf_state(model)
    qkv = hf_to_megatron(hf, layout)["decoder.layers.1.self_attention.linear_qkv.weight"]
    d, per_group = layout.head_dim, layout.num_heads // layout.num_query_groups
    block = (per_group + 2) * d
    q, k, v = (hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    for g in range(layout.num_query_groups):
        rows = qkv[g * block : (g + 1) * block]
        assert torch.equal(rows[: per_group * d], q[g * per_group * d : (g + 1) * per_group * d])
        assert torch.equal(rows[per_group * d : per_group * d + d], k[g * d : (g + 1) * d])
        assert torch.equal(rows[per_group * d + d :], v[g * d : (g + 1) * d])


def test_vocab_rows_are_zero_padded():
    model = _model("llama")
    layout = layout_from_hf_config(model.config)
    padded = padded_vocab_size(layout.vocab_size, tp_size=4)
    assert padded % (128 * 4) == 0 and padded >= layout.vocab_size
    mg = hf_to_megatron(_hf_state(model), layout, padded_vocab=padded)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert mg[name].shape == (padded, layout.hidden_size)
        assert not mg[name][layout.vocab_size :].any()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_tp_split_then_gather_is_identity_and_shapes_match(arch, tp_size):
    model = _model(arch)
    layout = layout_from_hf_config(model.config)
    padded = padded_vocab_size(layout.vocab_size, tp_size=tp_size, divisible_by=8)
    mg = hf_to_megatron(_hf_state(model), layout, padded_vocab=padded)
    shapes = megatron_shapes(layout, tp_size=tp_size, padded_vocab=padded)
    for name, tensor in mg.items():
        shards = tp_split(name, tensor, tp_size)
        assert len(shards) == tp_size
        assert all(tuple(s.shape) == shapes[name] for s in shards), name
        assert torch.equal(tp_gather(name, shards), tensor), name


def test_fc1_shard_holds_its_gate_rows_then_its_up_rows():
    model = _model("llama")
    layout = layout_from_hf_config(model.config)
    hf = _hf_state(model)
    fc1 = hf_to_megatron(hf, layout)["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    f = layout.ffn_hidden_size // 2
    shard1 = tp_split("decoder.layers.0.mlp.linear_fc1.weight", fc1, 2)[1]
    assert torch.equal(shard1, torch.cat([gate[f:], up[f:]]))


def test_partition_dims():
    assert tp_partition_dim("decoder.layers.3.self_attention.linear_qkv.weight") == 0
    assert tp_partition_dim("decoder.layers.3.self_attention.linear_qkv.bias") == 0
    assert tp_partition_dim("decoder.layers.3.self_attention.linear_proj.weight") == 1
    assert tp_partition_dim("decoder.layers.3.mlp.linear_fc2.weight") == 1
    assert tp_partition_dim("embedding.word_embeddings.weight") == 0
    assert tp_partition_dim("decoder.layers.3.self_attention.q_layernorm.weight") is None
    assert tp_partition_dim("decoder.final_layernorm.weight") is None


def test_global_layer_name_adds_the_stage_offset():
    assert (
        global_layer_name("decoder.layers.1.mlp.linear_fc2.weight", 4)
        == "decoder.layers.5.mlp.linear_fc2.weight"
    )
    assert (
        global_layer_name("decoder.final_layernorm.weight", 4) == "decoder.final_layernorm.weight"
    )


def test_missing_hf_tensor_is_named():
    model = _model("qwen2")
    layout = layout_from_hf_config(model.config)
    hf = _hf_state(model)
    del hf["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"k_proj\.bias"):
        hf_to_megatron(hf, layout)
