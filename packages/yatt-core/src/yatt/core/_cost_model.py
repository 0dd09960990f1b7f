"""A policy's cost model: the relative compute of one sample, from the model's shape.

    shape = flops_shape(hidden_size=..., num_layers=..., ...)    checked once, at build
    costs = estimate_flops_costs(lengths, shape)                  yatt.balance.flops_cost

A policy backend builds its shape from what it knows of its model (TorchPolicy from the
Hugging Face config, MegatronPolicy from its layout) and exposes `estimate_costs(lengths)`.
Cross-rank balancing (`Batch.rebalance(costs=...)`) and the policy's micro-batch packing then
weigh a sample the same, and no caller reads a model config's attribute names.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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


def estimate_flops_costs(lengths: Sequence[int], shape: dict[str, Any] | None) -> list[float]:
    """Forward FLOPs per sample (the token count where `shape` is None), as floats."""
    if shape is None:
        return [float(length) for length in lengths]
    return flops_cost(list(lengths), **shape).tolist()


def warn_without_shape(owner: str) -> None:
    logger.warning(
        "%s: the model config names no hidden size or layer count; balancing and micro-batch "
        "packing weigh samples by token count (attention's quadratic cost is not counted)",
        owner,
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
