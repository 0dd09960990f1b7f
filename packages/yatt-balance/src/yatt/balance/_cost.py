"""Per-sequence compute estimates used as balancing weights.

A transformer step costs a linear term per token (every matmul: QKV/output projections, MLP,
LM head) plus a quadratic term per sequence (causal attention scores and the weighted sum).
Their ratio depends on the model's shape: for a 7B model attention overtakes the matmuls near
50k tokens, for a 0.5B model near 15k. Hard-coding one model's ratio therefore misweights long
sequences for every other model; `flops_cost` derives both terms from the real shape.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from yatt.balance._checks import as_int, as_nonnegative_array


def cost(lengths: Any, *, linear: float = 1.0, quadratic: float = 0.0) -> np.ndarray:
    """`linear * L + quadratic * L**2` per sequence, as float64.

    With the defaults this is the token count; a small `quadratic` accounts for attention.
    """
    lens = as_nonnegative_array(lengths, "lengths")
    for name, coef in (("linear", linear), ("quadratic", quadratic)):
        if isinstance(coef, bool) or not np.isfinite(coef) or coef < 0:
            raise ValueError(f"{name} must be a finite number >= 0; got {coef!r}")
    return float(linear) * lens + float(quadratic) * lens * lens


def flops_cost(
    lengths: Any,
    *,
    hidden_size: int,
    num_layers: int,
    ffn_hidden_size: int | None = None,
    num_heads: int | None = None,
    vocab_size: int | None = None,
    num_kv_heads: int | None = None,
    is_gated_mlp: bool = False,
) -> np.ndarray:
    """Forward FLOPs of one causal-LM pass over each sequence, as float64.

    Backward costs about twice the forward for every term, so the ratio between sequences (all
    that balancing needs) is the same for training. Terms, per layer, for a sequence of L tokens
    (a multiply-add counts 2 FLOPs):
      projections  2 L (2 h^2 + 2 h kv)   q and o are h x h; k and v are h x kv
      mlp          2 L m h f              m = 3 for gated (SwiGLU), else 2; f defaults to 4 h
      attention    2 h L (L + 1)          causal: query i sees i + 1 keys, scores plus values
    plus the LM head, 2 L h V, when `vocab_size` is given. kv = h unless `num_kv_heads` (GQA)
    is given, which needs `num_heads` for the head size. `num_heads` alone does not change the
    count (attention FLOPs depend on h, not on how it is split) but is checked against h.
    """
    lens = as_nonnegative_array(lengths, "lengths")
    h = as_int(hidden_size, "hidden_size", minimum=1)
    layers = as_int(num_layers, "num_layers", minimum=1)
    f = 4 * h if ffn_hidden_size is None else as_int(ffn_hidden_size, "ffn_hidden_size", minimum=1)
    kv = h
    if num_heads is not None:
        heads = as_int(num_heads, "num_heads", minimum=1)
        if h % heads:
            raise ValueError(f"num_heads={heads} must divide hidden_size={h}")
        if num_kv_heads is not None:
            kv_heads = as_int(num_kv_heads, "num_kv_heads", minimum=1)
            if heads % kv_heads:
                raise ValueError(f"num_kv_heads={kv_heads} must divide num_heads={heads}")
            kv = kv_heads * (h // heads)
    elif num_kv_heads is not None:
        raise ValueError("num_kv_heads needs num_heads (for the head size); pass both")
    mlp_mats = 3 if is_gated_mlp else 2
    per_token = layers * (2.0 * (2 * h * h + 2 * h * kv) + 2.0 * mlp_mats * h * f)
    if vocab_size is not None:
        per_token += 2.0 * h * as_int(vocab_size, "vocab_size", minimum=1)
    attention = layers * 2.0 * h * lens * (lens + 1.0)
    return per_token * lens + attention
