"""Hugging Face config -> Megatron-Core GPT config (local layer spec, no TransformerEngine).

    layout = layout_from_hf_config(AutoConfig.from_pretrained(path))   # validates, no megatron
    TransformerConfig(**transformer_config_kwargs(layout, tp_size=2, dtype=torch.bfloat16))
    GPTModel(config, transformer_layer_spec=local_spec, **gpt_model_kwargs(layout, tp_size=2))

Supported: Llama (1/2/3, llama3 rope scaling), Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).
Everything else raises a ValueError that names the config field, because a feature we do not
translate would give a model that loads but computes something else.

Why our own mapping and not mbridge 0.15.1 (read against megatron-core 0.16.1 and 0.19.2):
- mbridge builds its layer spec with `get_gpt_decoder_block_spec(config,
  use_transformer_engine=True)` unconditionally (LLMBridge._get_transformer_layer_spec). Without
  TransformerEngine that path references `TENorm`, which megatron-core only imports when TE is
  present: `NameError: name 'TENorm' is not defined` (seen on 0.16.1; 0.19.2 has the same code).
- Its weight names are TE's fused names (`linear_qkv.layer_norm_weight`,
  `linear_fc1.layer_norm_weight`); the local spec has `input_layernorm.weight` and
  `pre_mlp_layernorm.weight`, so overriding the spec also means rewriting the name tables.
- It reads `hf_config.rope_theta`, which transformers 5 (5.17 on the GPU machine) moved into
  `rope_parameters`: `AttributeError` before any model is built. It also maps any
  `rope_scaling` to linear interpolation, which is wrong for llama3-style scaling.
The mapping for three dense families is small (see _weights.py) and fully tested on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3")

# Megatron-Core's activation recompute (TransformerConfig.recompute_*): "full" reruns whole
# decoder layers in the backward, keeping only their inputs; "selective" reruns submodules.
RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]
RECOMPUTE_GRANULARITIES: tuple[str, ...] = ("full", "selective")
RECOMPUTE_METHODS: tuple[str, ...] = ("uniform", "block")
# The submodules of a dense local-spec layer megatron-core recomputes selectively. Its other
# choices are for MoE and MLA layers (refused by it, or a silent no-op on a dense model), and
# "layernorm" runs CheckpointWithoutOutput, which reads TransformerEngine's FP8 state
# (0.16.1: NameError 'FP8GlobalStateManager' without TE, which yatt does not install).
RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "mlp")

# Megatron's llama3 rope scaling hard-codes these (RotaryEmbedding._apply_scaling); only
# `factor` is a parameter, so a checkpoint with other values cannot be represented.
_LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(kw_only=True, frozen=True)
class GPTLayout:
    """What the weight mapping and the model builder need to know of one HF model."""

    family: str  # "llama", "qwen2" or "qwen3"
    num_layers: int
    hidden_size: int
    num_heads: int  # query heads
    num_query_groups: int  # key/value heads (GQA groups)
    head_dim: int  # per head; Qwen3 sets it apart from hidden_size / num_heads
    ffn_hidden_size: int  # the gated MLP's intermediate size
    vocab_size: int  # the HF vocabulary (rows of embed_tokens), before any padding
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    rope_kwargs: tuple[tuple[str, Any], ...] = ()  # extra GPTModel kwargs for rope scaling
    is_tied: bool  # lm_head shares embed_tokens
    has_qkv_bias: bool  # Qwen2: q/k/v projections carry a bias
    has_qk_norm: bool  # Qwen3: RMSNorm over each head's q and k before rope


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default)
    return default if value is None else value


def _rope(config: Any) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(rope_theta, GPTModel kwargs) from transformers 5 `rope_parameters` or 4.x fields."""
    params = dict(_get(config, "rope_parameters", {}) or {})
    scaling = dict(_get(config, "rope_scaling", {}) or {})
    theta = params.get("rope_theta", _get(config, "rope_theta", scaling.get("rope_theta")))
    if theta is None:
        raise ValueError("the HF config has no rope_theta (nor rope_parameters['rope_theta'])")
    spec = params or scaling
    rope_type = spec.get("rope_type", spec.get("type", "default")) or "default"
    if rope_type == "default":
        return float(theta), ()
    if rope_type == "linear":
        return float(theta), (("seq_len_interpolation_factor", float(spec["factor"])),)
    if rope_type == "llama3":
        for key, expected in _LLAMA3_FIXED.items():
            if float(spec.get(key, expected)) != expected:
                raise ValueError(
                    f"rope_scaling[{key!r}]={spec.get(key)!r}: Megatron-Core's llama3 rope scaling "
                    f"fixes it at {expected:g}; this checkpoint cannot be represented"
                )
        return float(theta), (
            ("rope_scaling", True),
            ("rope_scaling_factor", float(spec["factor"])),
        )
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported by the Megatron backend; supported: "
        "default, linear, llama3 (use backend='torch' for this model)"
    )


def layout_from_hf_config(config: Any) -> GPTLayout:
    """Validate an HF `PretrainedConfig` (or anything with its attributes) and describe it."""
    family = _get(config, "model_type", "")
    if family not in FAMILIES:
        raise ValueError(
            f"model_type={family!r} is not supported by the Megatron backend; supported: "
            f"{FAMILIES} (use backend='torch' for other models)"
        )
    act = _get(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: the Megatron backend maps only SwiGLU ('silu') MLPs")
    if _get(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True: the Megatron backend maps bias-free MLPs only")
    # Qwen2 always has q/k/v bias and no o_proj bias, which Megatron's add_qkv_bias expresses.
    # Llama's and Qwen3's attention_bias also puts a bias on o_proj, which needs
    # add_bias_linear (and then biases on every linear): not representable.
    if family != "qwen2" and _get(config, "attention_bias", False):
        raise ValueError(
            f"attention_bias=True on {family}: o_proj's bias has no Megatron counterpart here"
        )
    if _get(config, "use_sliding_window", False):
        raise ValueError(
            "use_sliding_window=True: the Megatron backend supports full attention only"
        )
    layer_types = _get(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"layer_types={sorted(set(layer_types))}: only 'full_attention' is supported"
        )
    if float(_get(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by the Megatron backend")
    num_heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    head_dim = int(_get(config, "head_dim", hidden // num_heads))
    groups = int(_get(config, "num_key_value_heads", num_heads))
    if num_heads % groups:
        raise ValueError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={groups}"
        )
    theta, rope_kwargs = _rope(config)
    return GPTLayout(
        family=family,
        num_layers=int(config.num_hidden_layers),
        hidden_size=hidden,
        num_heads=num_heads,
        num_query_groups=groups,
        head_dim=head_dim,
        ffn_hidden_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size),
        max_position_embeddings=int(config.max_position_embeddings),
        norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_kwargs=rope_kwargs,
        is_tied=bool(_get(config, "tie_word_embeddings", False)),
        has_qkv_bias=family == "qwen2",
        has_qk_norm=family == "qwen3",
    )


def padded_vocab_size(vocab_size: int, *, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron-LM's rule: pad to a multiple of divisible_by * tp, so every TP shard of the
    embedding and output layer has the same, aligned number of rows."""
    if divisible_by < 1 or tp_size < 1:
        raise ValueError(f"divisible_by={divisible_by}, tp_size={tp_size}: both must be >= 1")
    multiple = divisible_by * tp_size
    return math.ceil(vocab_size / multiple) * multiple


def check_parallel_sizes(
    layout: GPTLayout,
    *,
    tp_size: int,
    pp_size: int = 1,
    virtual_pp_size: int | None = None,
    cp_size: int = 1,
    prefix: str = "",
) -> None:
    """Raise ValueError if the model cannot be split tp_size x pp_size (x virtual) x cp_size ways.

    prefix: the dotted owner of the fields in the message (e.g. "MegatronPolicyConfig.").
    Context parallelism (Megatron's p2p ring) splits the sequence, not the heads: it only needs
    every sequence padded to a multiple of 2 x cp_size, which the policy does itself.
    """
    for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("cp_size", cp_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{prefix}{name}={value!r} must be an int >= 1")
    for what, count in (
        ("num_attention_heads", layout.num_heads),
        ("num_key_value_heads", layout.num_query_groups),
        ("intermediate_size", layout.ffn_hidden_size),
    ):
        if count % tp_size:
            raise ValueError(
                f"{prefix}tp_size={tp_size} must divide {what}={count}; pick a divisor"
            )
    if layout.num_layers % pp_size:
        raise ValueError(
            f"{prefix}pp_size={pp_size} must divide num_hidden_layers={layout.num_layers}"
        )
    if virtual_pp_size is not None:
        if not isinstance(virtual_pp_size, int) or isinstance(virtual_pp_size, bool):
            raise ValueError(f"{prefix}virtual_pp_size={virtual_pp_size!r} must be an int or None")
        if virtual_pp_size < 2 or pp_size < 2:
            raise ValueError(
                f"{prefix}virtual_pp_size={virtual_pp_size}: the interleaved schedule needs "
                f"virtual_pp_size >= 2 and pp_size >= 2 (pp_size={pp_size}); use None otherwise"
            )
        if layout.num_layers % (pp_size * virtual_pp_size):
            raise ValueError(
                f"{prefix}virtual_pp_size={virtual_pp_size} x pp_size={pp_size} must divide "
                f"num_hidden_layers={layout.num_layers}"
            )


def recompute_kwargs(
    layout: GPTLayout,
    *,
    granularity: str | None = None,
    method: str | None = None,
    num_layers: int | None = None,
    modules: Sequence[str] | None = None,
    pp_size: int = 1,
    virtual_pp_size: int | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    """TransformerConfig's recompute_* keywords, validated before any model is built.

    granularity None: no recompute (every activation kept). "full": each decoder layer's
    activations are dropped after its forward and recomputed in the backward from its input;
    method "uniform" checkpoints units of num_layers layers (the default: 1, every layer),
    "block" only the first num_layers layers of each model chunk (the rest keep theirs).
    "selective": only `modules` (default megatron's ["core_attn"]) of every layer.
    num_layers counts layers of one model chunk: num_hidden_layers / (pp x virtual stages).
    prefix: the dotted owner of the fields in the messages (e.g. "MegatronPolicyConfig.").
    """
    fields = {
        "recompute_method": method,
        "recompute_num_layers": num_layers,
        "recompute_modules": modules,
    }
    if granularity is None:
        for name, value in fields.items():
            if value is not None:
                raise ValueError(
                    f"{prefix}{name}={value!r} without recompute_granularity: set "
                    f"recompute_granularity to one of {RECOMPUTE_GRANULARITIES}, or {name}=None"
                )
        return {"recompute_granularity": None}
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(
            f"{prefix}recompute_granularity={granularity!r}: use one of "
            f"{RECOMPUTE_GRANULARITIES} or None (no recompute)"
        )
    if granularity == "selective":
        for name in ("recompute_method", "recompute_num_layers"):
            if fields[name] is not None:
                raise ValueError(
                    f"{prefix}{name}={fields[name]!r} with recompute_granularity='selective': "
                    "it applies to 'full' only (selective recomputes its modules in every "
                    f"layer); set {name}=None"
                )
        if modules is None:
            return {"recompute_granularity": "selective"}  # megatron's default: core_attn
        if (
            isinstance(modules, str)
            or not modules
            or any(m not in RECOMPUTE_MODULES for m in modules)
        ):
            raise ValueError(
                f"{prefix}recompute_modules={modules!r}: a non-empty list of {RECOMPUTE_MODULES} "
                "(the submodules of a dense layer Megatron-Core recomputes without "
                "TransformerEngine), or None for ['core_attn']"
            )
        return {"recompute_granularity": "selective", "recompute_modules": list(modules)}
    if modules is not None:
        raise ValueError(
            f"{prefix}recompute_modules={modules!r} with recompute_granularity='full': full "
            "recompute reruns whole layers; set recompute_modules=None (or granularity "
            "'selective')"
        )
    method = "uniform" if method is None else method
    if method not in RECOMPUTE_METHODS:
        raise ValueError(
            f"{prefix}recompute_method={method!r}: use one of {RECOMPUTE_METHODS} (or None for "
            "'uniform')"
        )
    num_layers = 1 if num_layers is None else num_layers
    chunk_layers = layout.num_layers // (pp_size * (virtual_pp_size or 1))
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"{prefix}recompute_num_layers={num_layers!r}: must be an int >= 1")
    if num_layers > chunk_layers:
        raise ValueError(
            f"{prefix}recompute_num_layers={num_layers}: more than the {chunk_layers} layers of "
            f"a model chunk (num_hidden_layers={layout.num_layers} / pp_size={pp_size}"
            f"{f' / virtual_pp_size={virtual_pp_size}' if virtual_pp_size else ''})"
        )
    if method == "uniform" and chunk_layers % num_layers:
        # megatron-core's uniform loop steps by num_layers and would index past the chunk.
        raise ValueError(
            f"{prefix}recompute_num_layers={num_layers} must divide the {chunk_layers} layers of "
            "a model chunk with recompute_method='uniform' (or use 'block')"
        )
    return {
        "recompute_granularity": "full",
        "recompute_method": method,
        "recompute_num_layers": num_layers,
    }


def transformer_config_kwargs(
    layout: GPTLayout,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    virtual_pp_size: int | None = None,
    cp_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    sequence_parallel: bool = False,
    use_cpu_initialization: bool = False,
    perform_initialization: bool = True,
    recompute: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for `megatron.core.transformer.TransformerConfig`.

    Every fusion that needs TransformerEngine, Apex or Megatron's compiled kernels is off: the
    GPU machine has none of them, and each falls back to plain PyTorch anyway (named here so
    megatron-core does not try and warn). Dropout is 0: RL logprobs must be deterministic.
    recompute: `recompute_kwargs`' keywords without the layout and sizes (granularity, method,
    num_layers, modules); None: no activation recompute.
    """
    check_parallel_sizes(
        layout, tp_size=tp_size, pp_size=pp_size, virtual_pp_size=virtual_pp_size, cp_size=cp_size
    )
    if sequence_parallel and tp_size == 1:
        raise ValueError("sequence_parallel=True needs tp_size > 1")
    recompute_options = recompute_kwargs(
        layout, pp_size=pp_size, virtual_pp_size=virtual_pp_size, **(recompute or {})
    )
    return {
        "num_layers": layout.num_layers,
        "hidden_size": layout.hidden_size,
        "num_attention_heads": layout.num_heads,
        "num_query_groups": layout.num_query_groups,
        "kv_channels": layout.head_dim,
        "ffn_hidden_size": layout.ffn_hidden_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": layout.norm_eps,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": layout.has_qkv_bias,
        "qk_layernorm": layout.has_qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "attention_softmax_in_fp32": True,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "tensor_model_parallel_size": tp_size,
        "pipeline_model_parallel_size": pp_size,
        "virtual_pipeline_model_parallel_size": virtual_pp_size,
        "context_parallel_size": cp_size,
        # Micro-batches differ in rows and length: 1F1B stages exchange each activation's shape
        # first. The interleaved schedule pads them to one shape instead (see _schedule.py).
        "variable_seq_lengths": pp_size > 1 and virtual_pp_size is None,
        # Dense models have no experts; megatron-core only refuses variable sequence lengths
        # with its default ("allgather") MoE dispatcher, unused here.
        "moe_token_dispatcher_type": "alltoall",
        "sequence_parallel": sequence_parallel,
        "transformer_impl": "local",
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "cross_entropy_loss_fusion": False,
        "use_cpu_initialization": use_cpu_initialization,
        "perform_initialization": perform_initialization,
        **recompute_options,
    }


def gpt_model_kwargs(
    layout: GPTLayout, *, tp_size: int = 1, vocab_divisible_by: int = 128
) -> dict[str, Any]:
    """Keyword arguments for `megatron.core.models.gpt.GPTModel`, less config and layer spec."""
    return {
        "vocab_size": padded_vocab_size(
            layout.vocab_size, tp_size=tp_size, divisible_by=vocab_divisible_by
        ),
        "max_sequence_length": layout.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": layout.rope_theta,
        "share_embeddings_and_output_weights": layout.is_tied,
        # Logits stay split over the vocabulary; vocab-parallel cross entropy consumes them.
        "parallel_output": True,
        **dict(layout.rope_kwargs),
    }
