"""How much memory a train step's activations take, and the micro-batch cap that fits a budget.

    bytes = estimate_activation_bytes(num_tokens, shape, is_checkpointed=...)
    cap = choose_max_tokens(budget_bytes, shape, is_checkpointed=...)

`shape` is the cost model's (yatt.core.cost._cost_model's flops_shape keys). TorchPolicy reports
these bytes to a placement plan and chooses its micro-batch cap from the free device memory
with them.
"""

from __future__ import annotations

# Logits the head-logprobs path holds at once per chunk (float32 elements): 2**27 is 512 MiB,
# about 880 positions of a 152k vocabulary. Here because the estimate below counts it and the
# cost family imports no other; yatt.core.policy._head_logprobs reads it as CHUNK_ELEMENTS.
HEAD_CHUNK_ELEMENTS = 2**27
CAP_MULTIPLE = 256  # a chosen micro-batch cap is a multiple of this

# What a Hugging Face decoder layer keeps for backward, per token, under autocast to 16-bit with
# float32 parameters (how TorchPolicy trains): the residual stream and the RMSNorms run in
# float32 (4 bytes an element), the matmuls' inputs and outputs in 16 bits (2 bytes).
#   attention: input norm (input + normalised, 8h), the q/k/v/o inputs cast to 16 bits (4 x 2h),
#              q and k before and after RoPE and v (2 x 2h + 3 x 2kv), attention output (2h)
#              -> 22h + 6kv
#   MLP:       post-attention norm (8h), gate/up inputs (2 x 2h), gate and up outputs, SiLU's
#              output and the product (4 x 2i) -> 12h + 8i (a plain MLP: 12h + 6i)
# so 34h + 6kv + 8i bytes a token and layer: Korthikanti et al. (2022)'s 34sbh for a GPT layer
# at 16 bits, with the float32 norms and the gated MLP's extra rows counted. With activation
# checkpointing a layer keeps only its float32 input (4h) and one layer at a time is rebuilt
# in backward. Outside the layers: the embedding output and the final norm (12h), and the head:
# through yatt's head logprobs, one chunk of float32 logits, its softmax and gradient at a time
# (3 x HEAD_CHUNK_ELEMENTS x 4 bytes); through plain logits, 16-bit logits, their float32 copy and
# its gradient per token (10 V bytes). An estimate for planning: the placement plan measures
# the real peak from the first step on.


def estimate_activation_bytes(
    num_tokens: int,
    shape: dict,
    *,
    is_checkpointed: bool,
    is_head_logprobs: bool = True,
) -> int:
    """Bytes a train step's forward keeps for backward for a micro-batch of `num_tokens`
    padded tokens, for a model of `shape` (the cost model's: yatt.core.cost._cost_model's
    flops_shape keys). See the memory model in the module docstring."""
    per_token, fixed = _activation_bytes_per_token(
        shape, is_checkpointed=is_checkpointed, is_head_logprobs=is_head_logprobs
    )
    return num_tokens * per_token + fixed


def choose_max_tokens(
    budget_bytes: int,
    shape: dict,
    *,
    is_checkpointed: bool,
    is_head_logprobs: bool = True,
    multiple: int = CAP_MULTIPLE,
) -> int:
    """The largest micro-batch token cap (a multiple of `multiple`) whose activations
    (`estimate_activation_bytes`) fit in `budget_bytes`; ValueError naming the settings to
    change when not even `multiple` tokens fit."""
    per_token, fixed = _activation_bytes_per_token(
        shape, is_checkpointed=is_checkpointed, is_head_logprobs=is_head_logprobs
    )
    tokens = (budget_bytes - fixed) // per_token // multiple * multiple
    if tokens < multiple:
        hint = "" if is_checkpointed else " set TorchPolicyConfig.gradient_checkpointing=True,"
        raise ValueError(
            f"TorchPolicyConfig.max_tokens_per_microbatch=None: {max(0, budget_bytes) / 2**30:.2f}"
            f" GiB are left for activations, less than {multiple} tokens need "
            f"({(multiple * per_token + fixed) / 2**30:.2f} GiB);{hint} free the device (other "
            "roles asleep: Plan(offload='always')), or train a smaller model"
        )
    return int(tokens)


def _activation_bytes_per_token(
    shape: dict, *, is_checkpointed: bool, is_head_logprobs: bool
) -> tuple[int, int]:
    """(bytes per token, fixed bytes) of the memory model above."""
    h = shape["hidden_size"]
    layers = shape["num_layers"]
    i = shape.get("ffn_hidden_size", 4 * h)
    heads = shape.get("num_heads")
    kv = h * shape.get("num_kv_heads", heads) // heads if heads else h
    mlp_rows = 8 * i if shape.get("is_gated_mlp") else 6 * i
    layer = 34 * h + 6 * kv + mlp_rows
    per_token = (4 * h * layers + layer) if is_checkpointed else layer * layers
    per_token += 12 * h
    fixed = 0
    if is_head_logprobs:
        fixed = 3 * HEAD_CHUNK_ELEMENTS * 4
    else:
        per_token += 10 * shape.get("vocab_size", 0)
    return per_token, fixed
