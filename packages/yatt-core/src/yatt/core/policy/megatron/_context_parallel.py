"""Context parallelism: each sequence split over the cp ranks, attention over all of it.

Megatron-Core's load-balanced split (its `get_batch_on_this_cp_rank`): the sequence, padded to
a multiple of 2 x cp, is cut into 2 x cp chunks; rank r holds chunks r and 2cp - 1 - r, so with
causal attention every rank has the same work (an early chunk with few keys, a late one with
many). Megatron's rope already rotates a rank's chunks by their global positions.

Attention (SDPAttention at cp > 1) all-gathers the keys and values of the whole sequence
("all-gather" CP, as Llama 3's training and TransformerEngine's cp_comm_type="all_gather"):
each rank attends its two query chunks to every earlier key. Megatron-Core's own ring
attention (p2p) needs TransformerEngine; its local attention refuses cp > 1.

The loss sees the whole sequence: per-position results (logprob, entropy) are gathered over
CP, and every CP rank computes the same loss. The gather's backward hands each rank the
gradient of its own positions only (once, not summed over the identical copies of the loss),
so a rank's parameter gradient is its tokens' share of the global loss's, and the sum over CP
ranks is the whole gradient: Megatron's DDP averages over dp x cp, which the loss scale undoes
(the skeleton's dp_size is dp x cp).

Shape legend: B rows, T positions (padded to 2 x cp x C), L = 2C local positions, C chunk.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def cp_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2 x cp_size) that rank `cp_rank` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_for_cp(x_BT: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x_BT` along `dim` (its length divisible by 2 x cp_size)."""
    if cp_size == 1:
        return x_BT
    length = x_BT.shape[dim]
    if length % (2 * cp_size):
        raise ValueError(f"length {length} is not a multiple of 2 x cp_size = {2 * cp_size}")
    chunks = x_BT.chunk(2 * cp_size, dim=dim)
    first, second = cp_chunks(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unsplit_from_cp(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Every rank's `split_for_cp` output (rank order) -> the whole sequence in order."""
    cp_size = len(parts)
    chunks: list[Any] = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        first, second = cp_chunks(cp_size, rank)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def _all_gather(x: torch.Tensor, group: Any) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


class _GatherSequence(torch.autograd.Function):
    """The whole sequence from every CP rank's chunks; see `gather_sequence`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, is_summed: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.is_summed = dim, group, is_summed
        return unsplit_from_cp(_all_gather(x, group), dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        grad = grad.contiguous()
        if ctx.is_summed:
            # gloo has no reduce-scatter: all-reduce, then keep this rank's positions.
            dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return split_for_cp(grad, size, rank, dim=ctx.dim), None, None, None


def gather_sequence(x: torch.Tensor, group: Any, *, dim: int = 1) -> torch.Tensor:
    """Per-position results of the whole sequence on every CP rank (differentiable).

    Every CP rank then computes the same loss: the backward returns this rank's own positions'
    gradient, not the sum over the ranks' identical copies."""
    return _GatherSequence.apply(x, dim, group, False)


def gather_keys_values(x_SBHD: torch.Tensor, group: Any) -> torch.Tensor:
    """Keys or values [L, b, h, d] of the whole sequence [T, b, h, d], in order
    (differentiable: each rank's queries add their gradient to every rank's keys)."""
    return _GatherSequence.apply(x_SBHD, 0, group, True)


def cp_attention(
    q_LBHD: torch.Tensor,
    k_TBGD: torch.Tensor,
    v_TBGD: torch.Tensor,
    *,
    cp_size: int,
    cp_rank: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of this rank's two query chunks over the whole sequence's keys.

    q [L, b, np, d] (chunks r and 2cp-1-r), k/v [T, b, ng, d] in order -> [L, b, np * d]."""
    length, batch, heads, head_dim = q_LBHD.shape
    chunk = length // 2
    outs = []
    for part, index in zip(q_LBHD.split(chunk), cp_chunks(cp_size, cp_rank), strict=True):
        start = index * chunk  # the chunk's first global position
        keys = start + chunk  # it sees keys [0, start + chunk)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (part, k_TBGD[:keys], v_TBGD[:keys]))
        # Query i (global start + i) sees key j <= start + i.
        allowed_CK = (
            torch.arange(keys, device=q.device)[None]
            <= start + torch.arange(chunk, device=q.device)[:, None]
        )
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed_CK, scale=scale, enable_gqa=k.shape[1] != heads
        )
        outs.append(context.permute(2, 0, 1, 3).reshape(chunk, batch, heads * head_dim))
    return torch.cat(outs)
