"""A policy's cost model: the relative compute of one sample, from the model's shape.

    shape = flops_shape(hidden_size=..., num_layers=..., ...)    checked once, at build
    costs = estimate_flops_costs(lengths, shape)                  yatt.balance.flops_cost
    memory = estimate_megatron_memory(shape, tokens=32768, tp_size=8, pp_size=2, cp_size=2)

A policy backend builds its shape from what it knows of its model (TorchPolicy from the
Hugging Face config, MegatronPolicy from its layout) and exposes `estimate_costs(lengths)`.
Cross-rank balancing (`Batch.rebalance(costs=...)`), mini-batch splits and Megatron's sequence
packing then weigh a sample the same, and no caller reads a model config's attribute names.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from yatt.balance import flops_cost

logger = logging.getLogger("yatt.core")

# Hugging Face configs name the same quantity differently across families; most alias the
# first name through their `attribute_map`, but not all (GPT-2's n_inner, T5's d_ff, MPT's
# d_model). The first name present with a value wins.
_HF_NAMES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "ffn_hidden_size": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"),
    "vocab_size": ("vocab_size",),
}
# Parameter names of a gated MLP's extra projection (SwiGLU/GeGLU: Llama, Mistral, Qwen, Gemma
# use gate_proj; Phi-3 fuses it as gate_up_proj).
GATED_MLP_NAMES: tuple[str, ...] = ("gate_proj", "gate_up_proj")


def flops_shape(
    *,
    hidden_size: Any,
    num_layers: Any,
    ffn_hidden_size: Any = None,
    num_heads: Any = None,
    num_kv_heads: Any = None,
    vocab_size: Any = None,
    is_gated_mlp: bool = False,
) -> dict[str, Any] | None:
    """yatt.balance.flops_cost's keywords for this shape, or None without a hidden size and a
    layer count. Head counts that do not divide evenly (a head_dim apart from hidden_size /
    heads) are left out: flops_cost then counts k and v as h x h, a small overestimate."""
    if not _is_count(hidden_size) or not _is_count(num_layers):
        return None
    shape: dict[str, Any] = {
        "hidden_size": int(hidden_size),
        "num_layers": int(num_layers),
        "is_gated_mlp": bool(is_gated_mlp),
    }
    if _is_count(ffn_hidden_size):
        shape["ffn_hidden_size"] = int(ffn_hidden_size)
    if _is_count(vocab_size):
        shape["vocab_size"] = int(vocab_size)
    if _is_count(num_heads) and hidden_size % num_heads == 0:
        shape["num_heads"] = int(num_heads)
        kv_heads = num_kv_heads if _is_count(num_kv_heads) else num_heads
        if num_heads % kv_heads == 0:
            shape["num_kv_heads"] = int(kv_heads)
    return shape


def flops_shape_from_hf_config(config: Any, *, is_gated_mlp: bool) -> dict[str, Any] | None:
    """`flops_shape` from a Hugging Face config (its text model's, for a multimodal one)."""
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        config = get_text_config(decoder=True)
    values = {
        key: next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)
        for key, names in _HF_NAMES.items()
    }
    return flops_shape(**values, is_gated_mlp=is_gated_mlp)


def has_gated_mlp(module: Any) -> bool:
    """Whether a module's parameter names show a gated MLP (see GATED_MLP_NAMES)."""
    return any(
        part in GATED_MLP_NAMES for name, _ in module.named_parameters() for part in name.split(".")
    )


def estimate_flops_costs(
    lengths: Sequence[int], shape: dict[str, Any] | None, *, cp_size: int = 1
) -> list[float]:
    """Forward FLOPs per sample on one rank (the token count where `shape` is None), as floats.

    cp_size: context parallelism splits each sample (padded to a multiple of 2 x cp_size) into
    2 x cp_size chunks, rank r taking chunks r and 2cp - 1 - r. Every rank then runs 1/cp of the
    linear layers' tokens and, causal attention being load-balanced by that pairing, exactly
    1/cp of the attention's query-key pairs: the padded sample's cost over cp_size.
    """
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be >= 1")
    if cp_size > 1:
        multiple = 2 * cp_size
        lengths = [-(-length // multiple) * multiple for length in lengths]
    if shape is None:
        return [float(length) / cp_size for length in lengths]
    return (flops_cost(list(lengths), **shape) / cp_size).tolist()


@dataclass(kw_only=True, frozen=True)
class MemoryEstimate:
    """Bytes on the busiest GPU of a Megatron policy (see estimate_megatron_memory)."""

    weights: float  # bf16 parameters
    grads: float  # float32 gradient buffer (grad_reduce_in_fp32)
    optimizer: float  # float32 main params + Adam's two moments, sharded over dp x cp
    activations: float  # kept for the backward: micro-batches in flight x layers held
    # (with full recompute: the checkpointed inputs, plus one rebuilt unit of layers)
    gathered_kv: float  # context parallelism's all-gathered keys and values (kept too)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.gathered_kv

    def gib(self) -> dict[str, float]:
        """Every term and the total in GiB, rounded to 0.1."""
        fields = ("weights", "grads", "optimizer", "activations", "gathered_kv", "total")
        return {name: round(getattr(self, name) / 2**30, 1) for name in fields}


def estimate_megatron_memory(
    shape: dict[str, Any],
    *,
    tokens: int,
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    dp_size: int = 1,
    is_tied: bool = False,
    use_distributed_optimizer: bool = True,
    num_microbatches: int | None = None,
    recompute_num_layers: int | None = None,
) -> MemoryEstimate:
    """Training memory per GPU of a dense GPT (flops_shape keywords) under TP x PP x CP x DP.

    tokens: the (packed or padded) tokens of one micro-batch, e.g. one 32k-token sequence.
    The busiest GPU is the first pipeline stage: its layers plus the embedding, and under
    1F1B it keeps activations of up to pp micro-batches in flight (num_microbatches, if fewer).

    Per parameter: 2 bytes bf16 weight, 4 bytes float32 gradient, 12 bytes float32 main copy
    and Adam moments (over dp x cp with the distributed optimizer). Activations per token and
    layer, bf16, with SDPA/flash attention (no [s, s] scores) and no recomputation: outside
    the TP regions the layer input, two norm inputs and outputs and the residual (6 h values),
    inside them (divided by tp) q, k, v, rope'd q and k, the attention context (3 h + 3 kv) and
    the MLP's up, gate, activation and product (4 f, SwiGLU; 2 f + f otherwise). A CP rank
    holds tokens / cp of them, plus the gathered keys and values of the whole sequence
    (2 kv per token and layer, / tp). Logits never appear whole (logprobs are computed in
    chunks in the output layer). Buffers of the allocator, NCCL and CUDA context come on top:
    leave 10-20 % free.

    recompute_num_layers: full activation recompute in uniform units of this many layers
    (MegatronPolicyConfig recompute_granularity="full", recompute_method="uniform"); None:
    none. Each micro-batch in flight then keeps only its units' inputs (h values per token,
    bf16), and the backward rebuilds one unit at a time: that unit's layers' activations and
    gathered keys and values, for one micro-batch.
    """
    for name, value in (
        ("tokens", tokens),
        ("tp_size", tp_size),
        ("pp_size", pp_size),
        ("cp_size", cp_size),
        ("dp_size", dp_size),
    ):
        if not _is_count(value):
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    h, layers = shape["hidden_size"], shape["num_layers"]
    f = shape.get("ffn_hidden_size", 4 * h)
    kv = h
    if "num_heads" in shape:
        kv = shape.get("num_kv_heads", shape["num_heads"]) * (h // shape["num_heads"])
    mlp_mats = 3 if shape.get("is_gated_mlp") else 2
    per_layer = 2 * h * h + 2 * h * kv + mlp_mats * h * f + 2 * h  # q, o; k, v; mlp; 2 norms
    embedding = shape.get("vocab_size", 0) * h
    stage_params = (layers / pp_size * per_layer + embedding) / tp_size
    if pp_size == 1 and not is_tied:
        stage_params += embedding / tp_size  # the LM head shares the only stage
    optimizer_shards = dp_size * cp_size if use_distributed_optimizer else 1
    in_flight = min(pp_size, num_microbatches or pp_size)
    rank_tokens = tokens / cp_size
    mlp_values = 4 * f if shape.get("is_gated_mlp") else 3 * f
    per_token_layer = 2 * (6 * h + (3 * h + 3 * kv + mlp_values) / tp_size)
    layers_held = layers / pp_size * in_flight
    activations = per_token_layer * rank_tokens * layers_held
    if recompute_num_layers is not None:
        if not _is_count(recompute_num_layers) or recompute_num_layers > layers / pp_size:
            raise ValueError(
                f"recompute_num_layers={recompute_num_layers!r} must be an int from 1 to the "
                f"{layers / pp_size:g} layers of a pipeline stage"
            )
        unit_inputs = 2 * h * rank_tokens * layers_held / recompute_num_layers
        layers_held = recompute_num_layers  # rebuilt in the backward, one micro-batch
        activations = unit_inputs + per_token_layer * rank_tokens * layers_held
    gathered_kv = 0.0
    if cp_size > 1:
        gathered_kv = 2 * (2 * kv / tp_size) * tokens * layers_held
    return MemoryEstimate(
        weights=2.0 * stage_params,
        grads=4.0 * stage_params,
        optimizer=12.0 * stage_params / optimizer_shards,
        activations=activations,
        gathered_kv=gathered_kv,
    )


def warn_without_shape(owner: str) -> None:
    logger.warning(
        "%s: the model config names no hidden size or layer count; balancing and micro-batch "
        "packing weigh samples by token count (attention's quadratic cost is not counted)",
        owner,
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
