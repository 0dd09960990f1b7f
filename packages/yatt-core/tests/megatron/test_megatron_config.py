NUM_GPUS = 0

"""HF config -> Megatron-Core config translation: supported families and clear errors."""

import pytest
import torch
import transformers

from yatt.core.megatron import MegatronPolicyConfig
from yatt.core.policy.megatron._config import (
    gpt_model_kwargs,
    layout_from_hf_config,
    padded_vocab_size,
    transformer_config_kwargs,
)

SMALL = {
    "vocab_size": 264,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


def _config(cls: str, **overrides):
    return getattr(transformers, cls)(**{**SMALL, **overrides})


@pytest.mark.parametrize(
    ("cls", "has_bias", "has_qk_norm"),
    [("LlamaConfig", False, False), ("Qwen2Config", True, False), ("Qwen3Config", False, True)],
)
def test_families_map_to_their_features(cls, has_bias, has_qk_norm):
    layout = layout_from_hf_config(_config(cls, head_dim=16, rms_norm_eps=1e-5))
    kwargs = transformer_config_kwargs(layout, tp_size=2, dtype=torch.bfloat16)
    assert kwargs["add_qkv_bias"] is has_bias
    assert kwargs["qk_layernorm"] is has_qk_norm
    assert kwargs["num_query_groups"] == 4 and kwargs["kv_channels"] == 16
    assert kwargs["layernorm_epsilon"] == 1e-5 and kwargs["bf16"] and not kwargs["fp16"]
    assert kwargs["transformer_impl"] == "local" and kwargs["add_bias_linear"] is False


def test_qwen3_head_dim_may_differ_from_hidden_over_heads():
    layout = layout_from_hf_config(_config("Qwen3Config", head_dim=32))
    assert layout.head_dim == 32 != SMALL["hidden_size"] // SMALL["num_attention_heads"]


def test_gpt_kwargs_pad_vocab_and_tie():
    layout = layout_from_hf_config(_config("LlamaConfig", tie_word_embeddings=True, rope_theta=5e5))
    kwargs = gpt_model_kwargs(layout, tp_size=4)
    assert kwargs["vocab_size"] == 512 == padded_vocab_size(264, tp_size=4)
    assert kwargs["share_embeddings_and_output_weights"] is True
    assert kwargs["rotary_base"] == 5e5
    assert padded_vocab_size(151936, tp_size=1) == 151936  # Qwen2.5-0.5B: already aligned
    assert padded_vocab_size(151936, tp_size=2) == 152064  # 128 x 2 alignment adds rows


def test_llama3_rope_scaling_maps_to_megatron_and_linear_to_interpolation():
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 5e5,
    }
    layout = layout_from_hf_config(_config("LlamaConfig", rope_scaling=llama3))
    kwargs = gpt_model_kwargs(layout)
    assert kwargs["rope_scaling"] is True and kwargs["rope_scaling_factor"] == 8.0
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    kwargs = gpt_model_kwargs(layout_from_hf_config(_config("LlamaConfig", rope_scaling=linear)))
    assert kwargs["seq_len_interpolation_factor"] == 2.0


@pytest.mark.parametrize(
    ("cls", "overrides", "match"),
    [
        ("MistralConfig", {}, "model_type='mistral'"),
        ("LlamaConfig", {"hidden_act": "gelu"}, "hidden_act"),
        ("LlamaConfig", {"attention_bias": True}, "attention_bias"),
        ("LlamaConfig", {"mlp_bias": True}, "mlp_bias"),
        ("Qwen2Config", {"use_sliding_window": True}, "sliding_window"),
        (
            "LlamaConfig",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "yarn",
        ),
        (
            "LlamaConfig",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 2.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                    "rope_theta": 5e5,
                }
            },
            "low_freq_factor",
        ),
    ],
    ids=["mistral", "gelu", "o-bias", "mlp-bias", "sliding", "yarn", "llama3-custom"],
)
def test_unsupported_features_raise(cls, overrides, match):
    with pytest.raises(ValueError, match=match):
        layout_from_hf_config(_config(cls, **overrides))


def test_tp_must_divide_heads_groups_and_ffn():
    layout = layout_from_hf_config(_config("LlamaConfig"))
    with pytest.raises(ValueError, match="num_key_value_heads=4"):
        transformer_config_kwargs(layout, tp_size=8)
    with pytest.raises(ValueError, match="sequence_parallel"):
        transformer_config_kwargs(layout, tp_size=1, sequence_parallel=True)


def test_policy_config_validates(tmp_path):
    with pytest.raises(ValueError, match="model_dir"):
        MegatronPolicyConfig(model_dir=str(tmp_path / "missing"))
    _config("Qwen2Config").save_pretrained(tmp_path)  # 2 layers, 8 heads in 4 groups
    for field, value in [("tp_size", 0), ("attention", "flash"), ("lr", 0.0), ("dtype", "fp8")]:
        with pytest.raises(ValueError, match=field):
            MegatronPolicyConfig(model_dir=str(tmp_path), **{field: value})
    assert MegatronPolicyConfig(model_dir=str(tmp_path), tp_size=2).attention == "sdpa"


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ({"tp_size": 8}, r"MegatronPolicyConfig\.tp_size=8 must divide num_key_value_heads=4"),
        ({"pp_size": 4}, r"MegatronPolicyConfig\.pp_size=4 must divide num_hidden_layers=2"),
        ({"pp_size": 0}, r"MegatronPolicyConfig\.pp_size=0"),
        ({"cp_size": -1}, r"MegatronPolicyConfig\.cp_size=-1"),
        ({"pp_size": 2, "virtual_pp_size": 2}, r"virtual_pp_size=2 x pp_size=2 must divide"),
        ({"virtual_pp_size": 2}, r"virtual_pp_size=2: the interleaved schedule needs"),
        ({"cp_size": 2, "attention": "megatron"}, r"cp_size=2 with attention='megatron'"),
        (
            {"pack_sequences": True, "attention": "megatron"},
            r"pack_sequences=True with attention='megatron'",
        ),
        (
            {"pack_sequences": True, "pp_size": 2, "virtual_pp_size": 1},
            r"pack_sequences=True with virtual_pp_size=1",
        ),
    ],
)
def test_parallel_sizes_that_do_not_split_the_model_raise_before_it_loads(tmp_path, sizes, match):
    _config("Qwen2Config").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        MegatronPolicyConfig(model_dir=str(tmp_path), **sizes)


def test_model_parallel_size_and_world_checks(tmp_path):
    from yatt.core.policy.megatron._parallel import _init_megatron_parallel, megatron_rank_order

    _config("Qwen2Config").save_pretrained(tmp_path)
    config = MegatronPolicyConfig(model_dir=str(tmp_path), tp_size=2, pp_size=2, cp_size=2)
    assert config.model_parallel_size == 8

    class OneRank:  # a runtime of one process (no process group)
        tp_size = 1

    # Raised before megatron-core is imported or any weight is read.
    with pytest.raises(ValueError, match="= 8 ranks, more than the world's 1"):
        _init_megatron_parallel(OneRank(), config)
    two = MegatronPolicyConfig(model_dir=str(tmp_path), pp_size=1, tp_size=1)
    OneRank.tp_size = 2
    with pytest.raises(ValueError, match=r"init_runtime\(tp_size=config\.model_parallel_size\)"):
        _init_megatron_parallel(OneRank(), two)
    # DP outermost, as yatt's runtime mesh; pp with cp only where every order agrees (dp = 1).
    assert megatron_rank_order(2, 1, 4) == "tp-cp-ep-pp-dp"
    assert megatron_rank_order(2, 2, 1) == "tp-cp-ep-dp-pp"
    with pytest.raises(ValueError, match="pp_size=2 with cp_size=2 needs one data-parallel rank"):
        megatron_rank_order(2, 2, 2)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"recompute_method": "uniform"}, r"recompute_method='uniform' without recompute_gran"),
        ({"recompute_num_layers": 1}, r"recompute_num_layers=1 without recompute_granularity"),
        ({"recompute_modules": ("mlp",)}, r"recompute_modules=\('mlp',\) without recompute_gr"),
        ({"recompute_granularity": "partial"}, r"recompute_granularity='partial': use one of"),
        (
            {"recompute_granularity": "full", "recompute_method": "interleaved"},
            r"recompute_method='interleaved': use one of \('uniform', 'block'\)",
        ),
        (
            {"recompute_granularity": "full", "recompute_num_layers": 0},
            r"recompute_num_layers=0: must be an int >= 1",
        ),
        (
            {"recompute_granularity": "full", "recompute_num_layers": 3},
            r"recompute_num_layers=3: more than the 2 layers of a model chunk",
        ),
        (  # per pipeline stage: 2 layers over pp=2
            {"recompute_granularity": "full", "recompute_num_layers": 2, "pp_size": 2},
            r"recompute_num_layers=2: more than the 1 layers .* / pp_size=2\)",
        ),
        (
            {"recompute_granularity": "full", "recompute_modules": ("mlp",)},
            r"recompute_modules=\('mlp',\) with recompute_granularity='full'",
        ),
        (
            {"recompute_granularity": "selective", "recompute_method": "uniform"},
            r"recompute_method='uniform' with recompute_granularity='selective'",
        ),
        (
            {"recompute_granularity": "selective", "recompute_num_layers": 1},
            r"recompute_num_layers=1 with recompute_granularity='selective'",
        ),
        (  # megatron-core 0.16.1 recomputes layernorms only with TransformerEngine
            {"recompute_granularity": "selective", "recompute_modules": ("layernorm",)},
            r"recompute_modules=\('layernorm',\): a non-empty list of \('core_attn', 'mlp'\)",
        ),
        (
            {"recompute_granularity": "selective", "recompute_modules": ()},
            r"recompute_modules=\(\): a non-empty list",
        ),
        (
            {"recompute_granularity": "selective", "recompute_modules": "mlp"},
            r"recompute_modules='mlp': a non-empty list",
        ),
    ],
)
def test_recompute_options_megatron_would_reject_or_ignore_raise_before_the_model_loads(
    tmp_path, fields, match
):
    _config("Qwen2Config").save_pretrained(tmp_path)  # 2 layers: no weights to read
    with pytest.raises(ValueError, match=r"MegatronPolicyConfig\." + match):
        MegatronPolicyConfig(model_dir=str(tmp_path), **fields)


def test_uniform_recompute_units_must_divide_a_chunk_and_block_need_not(tmp_path):
    _config("Qwen2Config", num_hidden_layers=3).save_pretrained(tmp_path)
    full = {"model_dir": str(tmp_path), "recompute_granularity": "full", "recompute_num_layers": 2}
    # megatron-core's uniform loop steps 2 layers at a time and would index a fourth layer.
    with pytest.raises(ValueError, match=r"recompute_num_layers=2 must divide the 3 layers"):
        MegatronPolicyConfig(**full)
    assert MegatronPolicyConfig(**full, recompute_method="block").recompute_num_layers == 2


def test_recompute_options_translate_to_transformer_config_keywords(tmp_path):
    """What reaches TransformerConfig (megatron-core 0.16.1's recompute_* fields)."""
    _config("Qwen2Config", num_hidden_layers=4).save_pretrained(tmp_path)
    layout = layout_from_hf_config(transformers.AutoConfig.from_pretrained(tmp_path))
    off = MegatronPolicyConfig(model_dir=str(tmp_path))
    assert off.recompute_options is None
    assert (
        transformer_config_kwargs(layout, recompute=off.recompute_options)["recompute_granularity"]
        is None
    )
    block = MegatronPolicyConfig(
        model_dir=str(tmp_path),
        pp_size=2,
        recompute_granularity="full",
        recompute_method="block",
        recompute_num_layers=2,
    )
    kwargs = transformer_config_kwargs(layout, pp_size=2, recompute=block.recompute_options)
    assert (kwargs["recompute_method"], kwargs["recompute_num_layers"]) == ("block", 2)
    # A YAML list of modules becomes the config's tuple; megatron-core receives a list.
    selective = MegatronPolicyConfig(
        model_dir=str(tmp_path), recompute_granularity="selective", recompute_modules=["mlp"]
    )
    assert selective.recompute_modules == ("mlp",)
    kwargs = transformer_config_kwargs(layout, recompute=selective.recompute_options)
    assert kwargs["recompute_granularity"] == "selective"
    assert kwargs["recompute_modules"] == ["mlp"]
    assert "recompute_num_layers" not in kwargs  # megatron requires None for selective


@pytest.mark.parametrize("packed", [False, True])
def test_sdpa_attention_never_runs_on_cudnn(monkeypatch, packed):
    """cuDNN's attention builds a graph per new shape (hundreds of ms) and packed sequences run
    one call per sequence length: SDPAttention keeps SDPA off cuDNN in every call (read where it
    calls SDPA), and its result is plain causal attention."""
    from types import SimpleNamespace

    from yatt.core.policy.megatron._model import SDPAttention

    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    config = SimpleNamespace(kv_channels=8, context_parallel_size=1)
    attention = SDPAttention(config, layer_number=1, attn_mask_type=None, attention_type="self")
    gen = torch.Generator().manual_seed(0)
    if packed:  # two sequences of 3 and 5 tokens end to end: q [t, heads, dim]
        q, k, v = (torch.randn(8, 2, 8, generator=gen) for _ in range(3))
        params = SimpleNamespace(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 8]))
        out = attention(q, k, v, None, packed_seq_params=params)
        want = (
            torch.cat(
                [
                    sdpa(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True)
                    for a, b in ((0, 3), (3, 8))
                ],
                dim=1,
            )
            .transpose(0, 1)
            .reshape(8, 16)
        )
    else:  # q [s, b, heads, dim]
        q, k, v = (torch.randn(5, 2, 2, 8, generator=gen) for _ in range(3))
        out = attention(q, k, v, None)
        want = sdpa(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
        want = want.permute(2, 0, 1, 3).reshape(5, 2, 16)
    torch.testing.assert_close(out, want)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()
