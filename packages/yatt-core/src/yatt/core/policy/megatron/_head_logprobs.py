"""Vocabulary-parallel logprobs (and entropy) computed inside Megatron's output layer, in chunks.

The same idea as `yatt.core.policy._head_logprobs` for the Hugging Face path: the output layer's
`forward` is swapped, for one model call, for one that turns the hidden states into the
numbers the loss needs, a chunk of positions at a time under activation checkpointing. No
[b, T, V/tp] float32 logits (and their softmax copy in Megatron's cross entropy) are kept for
the backward; each chunk's are recomputed there.

What ColumnParallelLinear does around its matmul is kept: the hidden states' gradient is
all-reduced over TP. Each chunk runs the vocab-parallel reductions of `_vocab_parallel`
(collectives inside the recompute run in the same order on every TP rank). Sequence
parallelism keeps the full-logits path for now (see `supports_output_layer_logprobs`).

Shape legend: S positions, B sequences, H hidden size, Vl this rank's vocabulary columns,
N flattened positions, W 1 or 2 (logprob, entropy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from yatt.core.policy._head_logprobs import in_chunks
from yatt.core.policy.megatron._vocab_parallel import (
    compute_vocab_parallel_entropy,
    compute_vocab_parallel_logprobs,
    vocab_parallel_rows,
)


def supports_output_layer_logprobs(gpt: Any) -> bool:
    """True when nothing after the output layer changes the logits (no MTP, no muP scaling).

    Not with sequence parallelism yet: its gather could not be tested here (megatron-core's
    torch norms refuse it without TransformerEngine), so those runs keep the full logits.
    """
    config = gpt.config
    return (
        getattr(gpt, "post_process", True)
        and hasattr(gpt, "output_layer")
        and not getattr(config, "sequence_parallel", False)
        and not getattr(config, "mtp_num_layers", None)
        and not getattr(config, "use_mup", False)
    )


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    Megatron's TP all-reduce of a gradient reduces `grad.contiguous()` and returns `grad`: a
    non-contiguous gradient (ours comes back through a transpose) would stay unreduced.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _chunk(
    hidden_NH: torch.Tensor, weight_VlH: torch.Tensor, targets_N: torch.Tensor, settings: dict
) -> torch.Tensor:
    return vocab_parallel_rows(torch.matmul(hidden_NH, weight_VlH.t()), targets_N, **settings)


@contextlib.contextmanager
def logprobs_in_output_layer(
    gpt: Any,
    input_ids_BT: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    needs_entropy: bool,
    tp_group: Any,
    chunk_tokens: int | None = None,
    is_labels: bool = False,
) -> Iterator[None]:
    """While open, the model's output ([B, T, W] after GPTModel's transpose) holds each input
    token's logprob (and entropy), aligned like `compute_vocab_parallel_logprobs`.

    is_labels: `input_ids_BT` are the targets of each position itself (the next token, shifted
    already: context parallelism's chunks are not contiguous), and position t holds the
    logprob of input_ids_BT[t] from the hidden state at t."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    layer = gpt.output_layer
    settings = dict(
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        temperature=temperature,
        needs_entropy=needs_entropy,
        tp_group=tp_group,
    )

    def forward(hidden_SBH: torch.Tensor, weight: torch.Tensor | None = None, **_: Any):
        weight_VlH = layer.weight if weight is None else weight
        assert not layer.sequence_parallel, "see supports_output_layer_logprobs"
        hidden_SBH = copy_to_tensor_model_parallel_region(hidden_SBH, group=tp_group)
        hidden_SBH = _ContiguousGrad.apply(hidden_SBH)
        targets_BT = input_ids_BT
        if is_labels:
            # in_chunks pairs hidden t - 1 with target t: one unused hidden row at the end and
            # one unused target in front pair hidden t with label t.
            hidden_SBH = torch.nn.functional.pad(hidden_SBH, (0, 0, 0, 0, 0, 1))
            targets_BT = torch.nn.functional.pad(input_ids_BT, (1, 0))
        out_BTW = in_chunks(
            _chunk,
            hidden_SBH.transpose(0, 1),
            targets_BT,
            weight_VlH,
            settings,
            width=2 if needs_entropy else 1,
            chunk_tokens=chunk_tokens,
        )
        if is_labels:
            out_BTW = out_BTW[:, 1:]
        return out_BTW.transpose(0, 1), None  # GPTModel transposes [S, B] back to [B, S]

    layer.forward = forward  # an instance attribute: parameter names and hooks stay
    try:
        yield
    finally:
        del layer.forward


def forward_logprobs(
    model: torch.nn.Module,
    gpt: Any,
    input_ids_BT: torch.Tensor,
    *,
    pad_to: int,
    needs_entropy: bool,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    tp_group: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] logprobs (and entropy) of right-padded `input_ids_BT` through Megatron `model`.

    gpt: the GPTModel inside `model` to compute them in its output layer; None: from the full
    vocab-parallel logits. pad_to: T is padded to a multiple of it (sequence parallelism splits
    T over TP ranks; right-padding keeps the valid positions exact).
    """
    out_BTW = forward_stage(
        model,
        gpt,
        input_ids_BT,
        is_last_stage=True,
        pad_to=pad_to,
        needs_entropy=needs_entropy,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        temperature=temperature,
        tp_group=tp_group,
    )
    return out_BTW[..., 0], out_BTW[..., 1] if needs_entropy else None


def forward_stage(
    model: torch.nn.Module,
    gpt: Any,
    input_ids_BT: torch.Tensor,
    *,
    is_last_stage: bool,
    pad_to: int,
    needs_entropy: bool,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    tp_group: Any,
    lengths_B: torch.Tensor | None = None,
    cp_group: Any = None,
) -> torch.Tensor:
    """One pipeline stage's forward of a right-padded micro-batch.

    The last stage returns [B, T, W] (logprob, entropy if needs_entropy); an earlier stage its
    hidden states for the next one (Megatron's schedule feeds it the previous stage's through
    set_input_tensor, and reads the mask and positions here on every stage).
    lengths_B: each row's valid tokens, to run the rows packed end to end (no padding; see
    `forward_packed`); None: padded [B, T].
    cp_group: the context-parallel group when cp > 1 (see `forward_context_parallel`).
    """
    settings = dict(vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature)
    if lengths_B is not None:
        return forward_packed(
            model,
            gpt,
            input_ids_BT,
            lengths_B,
            is_last_stage=is_last_stage,
            needs_entropy=needs_entropy,
            tp_group=tp_group,
            **settings,
        )
    if cp_group is not None:
        return forward_context_parallel(
            model,
            gpt,
            input_ids_BT,
            cp_group,
            is_last_stage=is_last_stage,
            needs_entropy=needs_entropy,
            tp_group=tp_group,
            **settings,
        )
    width = input_ids_BT.shape[1]
    ids_BT = torch.nn.functional.pad(input_ids_BT, (0, -width % pad_to))
    length = ids_BT.shape[1]
    position_ids_BT = torch.arange(length, device=ids_BT.device).expand_as(ids_BT)
    # Megatron's mask: True = masked out. Right-padded rows need only causality (padding
    # follows all valid tokens); SDPAttention ignores it and runs is_causal kernels.
    causal_11TT = torch.ones(length, length, dtype=torch.bool, device=ids_BT.device).triu(1)
    if not is_last_stage:
        return model(ids_BT, position_ids_BT, causal_11TT[None, None])
    if gpt is not None:
        in_layer = logprobs_in_output_layer(
            gpt, ids_BT, needs_entropy=needs_entropy, tp_group=tp_group, **settings
        )
        with in_layer:
            return model(ids_BT, position_ids_BT, causal_11TT[None, None])[:, :width]
    logits_BTVl = model(ids_BT, position_ids_BT, causal_11TT[None, None])[:, :width]
    logprobs_BT = compute_vocab_parallel_logprobs(logits_BTVl, input_ids_BT, **settings)
    if not needs_entropy:
        return logprobs_BT[..., None]
    entropy_BT = compute_vocab_parallel_entropy(logits_BTVl, tp_group=tp_group, **settings)
    return torch.stack([logprobs_BT, entropy_BT], dim=-1)


def pack_rows(
    input_ids_BT: torch.Tensor, lengths_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows end to end: ([1, N] ids, [1, N] positions restarting at each row,
    [B + 1] int32 cumulative lengths, [N] index of each token in the flattened [B * T])."""
    _batch, width = input_ids_BT.shape
    valid_BT = torch.arange(width, device=input_ids_BT.device) < lengths_B[:, None]
    flat_index_N = valid_BT.reshape(-1).nonzero().squeeze(1)
    ids_1N = input_ids_BT.reshape(-1)[flat_index_N][None]
    positions_1N = (flat_index_N % width)[None]
    cu_seqlens = torch.nn.functional.pad(lengths_B.cumsum(0), (1, 0)).to(torch.int32)
    return ids_1N, positions_1N, cu_seqlens, flat_index_N


def forward_packed(
    model: torch.nn.Module,
    gpt: Any,
    input_ids_BT: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    is_last_stage: bool,
    needs_entropy: bool,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    tp_group: Any,
) -> torch.Tensor:
    """forward_stage on the rows packed end to end (THD, PackedSeqParams): attention stays
    within each row (SDPAttention), rope restarts at each row, and the [1, N, W] result is
    scattered back to [B, T, W] (zeros on padding). A row's first position would hold the
    previous row's prediction of it: it is 0, as in the padded layout."""
    from megatron.core.packed_seq_params import PackedSeqParams

    batch, width = input_ids_BT.shape
    ids_1N, positions_1N, cu_seqlens, flat_index_N = pack_rows(input_ids_BT, lengths_B)
    longest = int(lengths_B.max())  # host sync: rope's table length
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    if not is_last_stage:
        return model(ids_1N, positions_1N, None, packed_seq_params=params)
    settings = dict(vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature)
    if gpt is not None:
        in_layer = logprobs_in_output_layer(
            gpt, ids_1N, needs_entropy=needs_entropy, tp_group=tp_group, **settings
        )
        with in_layer:
            out_1NW = model(ids_1N, positions_1N, None, packed_seq_params=params)
    else:
        logits_1NVl = model(ids_1N, positions_1N, None, packed_seq_params=params)
        logprobs_1N = compute_vocab_parallel_logprobs(logits_1NVl, ids_1N, **settings)
        parts = [logprobs_1N]
        if needs_entropy:
            parts.append(compute_vocab_parallel_entropy(logits_1NVl, tp_group=tp_group, **settings))
        out_1NW = torch.stack(parts, dim=-1)
    is_row_start_N = (flat_index_N % width) == 0
    values_NW = out_1NW[0] * (~is_row_start_N)[:, None].to(out_1NW.dtype)
    out_W = out_1NW.new_zeros(batch * width, out_1NW.shape[-1])
    return out_W.index_copy(0, flat_index_N, values_NW).view(batch, width, -1)


def forward_context_parallel(
    model: torch.nn.Module,
    gpt: Any,
    input_ids_BT: torch.Tensor,
    cp_group: Any,
    *,
    is_last_stage: bool,
    needs_entropy: bool,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    tp_group: Any,
) -> torch.Tensor:
    """forward_stage at cp > 1: this rank runs its two load-balanced chunks of every row (see
    _context_parallel); the last stage gathers the per-position results of the whole rows, so
    every CP rank returns the same [B, T, W] and computes the same (global) loss."""
    import torch.distributed as dist

    from yatt.core.policy.megatron._context_parallel import gather_sequence, split_for_cp

    if gpt is None:
        raise ValueError("context parallelism computes logprobs in the output layer only")
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    width = input_ids_BT.shape[1]
    ids_BT = torch.nn.functional.pad(input_ids_BT, (0, -width % (2 * cp_size)))
    position_ids_BT = torch.arange(ids_BT.shape[1], device=ids_BT.device).expand_as(ids_BT)
    # Position t's target is the next token: shifted here, before the chunks are cut apart.
    labels_BT = torch.nn.functional.pad(ids_BT[:, 1:], (0, 1))
    local = [split_for_cp(t, cp_size, cp_rank) for t in (ids_BT, position_ids_BT, labels_BT)]
    local_ids_BL, local_positions_BL, local_labels_BL = local
    if not is_last_stage:
        return model(local_ids_BL, local_positions_BL, None)
    in_layer = logprobs_in_output_layer(
        gpt,
        local_labels_BL,
        needs_entropy=needs_entropy,
        tp_group=tp_group,
        is_labels=True,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        temperature=temperature,
    )
    with in_layer:
        local_BLW = model(local_ids_BL, local_positions_BL, None)
    # Position t held log p(ids[t + 1] | <= t): one to the right, 0 at t = 0.
    next_BTW = gather_sequence(local_BLW, cp_group)
    return torch.nn.functional.pad(next_BTW[:, :-1], (0, 0, 1, 0))[:, :width]
