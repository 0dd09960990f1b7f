"""Token logprobs (and entropy) computed inside the LM head, a chunk of positions at a time.

The plain path materialises the logits of every position, [B, T, V] in bf16, then a float32
copy for the log-softmax, and keeps that copy for the backward: 16k tokens of a 152k vocabulary
hold about 15 GB before the gradient of the same size. Here the head's forward is swapped, for
one model call, for one that turns hidden states into the two numbers the loss needs, chunk by
chunk under activation checkpointing: only the hidden states are kept, and the backward
recomputes one chunk's logits at a time (one extra head matmul, cheap next to the model).

Swapping the head module's `forward` (not the module) keeps parameter names, and the DDP and
FSDP2 hooks around the model and the head, exactly as they are.

Shape legend: B sequences, T positions, H hidden size, V vocabulary, N flattened positions.
Outputs are aligned like `compute_token_logprobs`: position t holds log p(input_ids[t] | < t),
position 0 holds 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from yatt.core.cost._activation_memory import HEAD_CHUNK_ELEMENTS

# Architectures whose causal-LM forward returns the head's output unchanged as `.logits` (no
# soft-capping or scaling after the head). Others keep the plain path: swapping their head
# would silently skip that post-processing.
HEAD_LOGPROB_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen2_vl", "qwen2_5_vl"}
)
# Logits held at once per chunk (float32 elements): 2**27 is 512 MiB, about 880 positions of a
# 152k vocabulary. The activation estimate (yatt.core.cost._activation_memory) counts it.
CHUNK_ELEMENTS = HEAD_CHUNK_ELEMENTS
# The compiled chunk function (`compiled_chunk_logprobs`): one per process, made at first use.
_compiled_chunk_logprobs: Callable[..., torch.Tensor] | None = None


def supports_head_logprobs(model: torch.nn.Module) -> bool:
    """True when `logprobs_in_head` gives the same numbers as the logits of `model`."""
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (
        getattr(config, "model_type", None) in HEAD_LOGPROB_MODEL_TYPES
        and isinstance(head, torch.nn.Linear)
        and not getattr(config, "final_logit_softcapping", None)
    )


def _chunk_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    bias_V: torch.Tensor | None,
    temperature: float,
    needs_entropy: bool,
) -> torch.Tensor:
    logits_NV = torch.nn.functional.linear(hidden_NH, weight_VH, bias_V).float()
    # Temperature 0 means greedy sampling; the engines then report unscaled logprobs.
    if temperature > 0 and temperature != 1.0:
        logits_NV = logits_NV / temperature
    lse_N = torch.logsumexp(logits_NV, dim=-1)
    logprob_N = logits_NV.gather(-1, targets_N[:, None]).squeeze(-1) - lse_N
    if not needs_entropy:
        return logprob_N[:, None]
    # H = -sum p log p = lse - sum p x, with p = exp(x - lse).
    probs_NV = torch.exp(logits_NV - lse_N[:, None])
    entropy_N = lse_N - (probs_NV * logits_NV).sum(-1)
    return torch.stack([logprob_N, entropy_N], dim=-1)


def compiled_chunk_logprobs() -> Callable[..., torch.Tensor]:
    """`_chunk_logprobs` through torch.compile (TorchPolicyConfig.compile_head_logprobs).

    Eager, each op of a chunk (the float copy, logsumexp's max/sub/exp/sum, the gather, the
    entropy's exp/mul/sum) is one pass over [N, V] float32 logits, in the forward, again in the
    checkpoint's recompute and in the backward; inductor fuses them into a few reductions. The
    last chunk of a micro-batch is shorter: dynamic=None compiles the first shape as it is and
    the next with a dynamic N, so it does not recompile per length. Compile errors are raised
    naming the field (it was asked for: no silent fallback to eager).
    """
    global _compiled_chunk_logprobs
    if _compiled_chunk_logprobs is None:
        try:
            compiled = torch.compile(_chunk_logprobs, dynamic=None)
        except (AttributeError, RuntimeError) as err:  # no torch.compile on this platform
            raise RuntimeError(_compile_failed(err)) from err
        _compiled_chunk_logprobs = _raising_compile_errors(compiled)
    return _compiled_chunk_logprobs


def _compile_failed(err: BaseException) -> str:
    return (
        f"TorchPolicyConfig.compile_head_logprobs=True: torch.compile of the head's logprob "
        f"chunks failed ({type(err).__name__}: {err}); install what it names (a C++ compiler "
        "on CPU, Triton on GPU) or set compile_head_logprobs=False for the eager path"
    )


def _raising_compile_errors(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    # Only compiler errors are rewritten: an out-of-memory or a shape error stays as it is.
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    def call(*args: Any) -> torch.Tensor:
        try:
            # While another thread compiles (an engine's first calls beside the trainer, as in
            # off-policy steps), torch's process-wide FX-tracing flag is up and dynamo would
            # raise here ("FX to symbolically trace a dynamo-optimized function"); with the
            # error off this call runs eagerly (the same numbers). Patched per call: dynamo's
            # settings are per thread in recent torch.
            with torch._dynamo.config.patch(error_on_nested_fx_trace=False):
                return compiled(*args)
        except (TorchDynamoException, InductorError) as err:
            raise RuntimeError(_compile_failed(err)) from err

    return call


def in_chunks(
    chunk_fn: Callable[..., torch.Tensor],
    hidden_BTH: torch.Tensor,
    input_ids_BT: torch.Tensor,
    weight_VH: torch.Tensor,
    *extra: Any,
    width: int,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """[B, T, width] float32 aligned with `input_ids_BT` (position 0 = 0), from
    `chunk_fn(hidden_NH, weight_VH, targets_N, *extra)` -> [N, width] on chunks of positions.

    Each chunk runs under activation checkpointing when a backward can come, so only the hidden
    states are kept and its logits are recomputed in the backward.
    """
    batch, length, hidden_size = hidden_BTH.shape
    if (batch, length) != tuple(input_ids_BT.shape):
        raise ValueError(
            f"hidden states {tuple(hidden_BTH.shape)} and input_ids {tuple(input_ids_BT.shape)} "
            "must agree on [B, T]"
        )
    if length == 0:
        return hidden_BTH.new_zeros(batch, 0, width, dtype=torch.float32)
    step = chunk_tokens or max(1, CHUNK_ELEMENTS // weight_VH.shape[0])
    hidden_NH = hidden_BTH[:, :-1].reshape(-1, hidden_size)
    targets_N = input_ids_BT[:, 1:].reshape(-1)
    # Recompute in backward only when a backward can come; inference keeps nothing anyway.
    is_recomputed = torch.is_grad_enabled() and (hidden_NH.requires_grad or weight_VH.requires_grad)
    parts = []
    # At least one (maybe empty) chunk: a one-token dummy micro-batch must still reach the head's
    # weight, so DDP and FSDP2 see its (zero) gradient and run their collectives.
    for start in range(0, max(hidden_NH.shape[0], 1), step):
        args = (hidden_NH[start : start + step], weight_VH, targets_N[start : start + step])
        if is_recomputed:
            # Nothing random inside: no RNG state to stash and restore per chunk.
            part = checkpoint(
                chunk_fn, *args, *extra, use_reentrant=False, preserve_rng_state=False
            )
        else:
            part = chunk_fn(*args, *extra)
        parts.append(part)
    out_NW = torch.cat(parts)
    return torch.nn.functional.pad(out_NW.view(batch, length - 1, width), (0, 0, 1, 0))


def head_logprobs(
    head: torch.nn.Linear,
    hidden_BTH: torch.Tensor,
    input_ids_BT: torch.Tensor,
    *,
    temperature: float,
    needs_entropy: bool,
    chunk_tokens: int | None = None,
    should_compile: bool = False,
) -> torch.Tensor:
    """[B, T, 1 or 2] float32: logprob of each input token (and entropy), position 0 = 0.

    `should_compile`: each chunk through `compiled_chunk_logprobs()`, the same numbers.
    """
    return in_chunks(
        compiled_chunk_logprobs() if should_compile else _chunk_logprobs,
        hidden_BTH,
        input_ids_BT,
        head.weight,
        head.bias,
        temperature,
        needs_entropy,
        width=2 if needs_entropy else 1,
        chunk_tokens=chunk_tokens,
    )


@contextlib.contextmanager
def logprobs_in_head(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    *,
    temperature: float,
    needs_entropy: bool,
    chunk_tokens: int | None = None,
    should_compile: bool = False,
) -> Iterator[None]:
    """While open, `model(input_ids=input_ids_BT, ...).logits` is `head_logprobs`' output.

    Only for models where `supports_head_logprobs(model)` holds.
    """
    if not supports_head_logprobs(model):
        raise ValueError(
            f"logprobs_in_head: {type(model).__name__} (model_type="
            f"{getattr(getattr(model, 'config', None), 'model_type', None)!r}) is not one of "
            f"{sorted(HEAD_LOGPROB_MODEL_TYPES)} with a plain linear head; compute logprobs "
            "from its logits (yatt.core.compute_token_logprobs)"
        )
    head = model.get_output_embeddings()

    def forward(hidden_BTH: torch.Tensor) -> torch.Tensor:
        return head_logprobs(
            head,
            hidden_BTH,
            input_ids_BT,
            temperature=temperature,
            needs_entropy=needs_entropy,
            chunk_tokens=chunk_tokens,
            should_compile=should_compile,
        )

    head.forward = forward  # an instance attribute: hooks and parameter names stay as they are
    try:
        yield
    finally:
        del head.forward
