"""Token logprobs and entropy from vocabulary-parallel logits (each TP rank holds V / tp columns).

Shape legend: B sequences, T positions (right-padded), Vl this rank's vocabulary columns.
Aligned like `yatt.core.compute_token_logprobs`: position t holds log p(input_ids[t] | < t),
computed from the logits at t - 1; position 0 holds 0. Temperature follows the rollout engines:
logits / temperature, and unscaled logits at temperature 0 (greedy).

Columns past the real vocabulary (Megatron pads it to a multiple of 128 * tp) are set to a
large negative number first: their logit would otherwise be w . h for a zero row, i.e. 0, and
add exp(0) to every softmax denominator, which the HF model does not have.
"""

from __future__ import annotations

import torch

# exp(x - max) underflows to exactly 0 for this, and 0 * x stays finite (unlike -inf).
_MASKED_LOGIT = -1e30


def _prepare(
    logits_BTVl: torch.Tensor, *, vocab_start: int, vocab_size: int, temperature: float
) -> torch.Tensor:
    """A fresh contiguous float32 copy of the predicting positions, scaled and masked."""
    return _prepare_rows(
        logits_BTVl[:, :-1], vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature
    )


def _prepare_rows(
    pred_Vl: torch.Tensor, *, vocab_start: int, vocab_size: int, temperature: float
) -> torch.Tensor:
    """A fresh contiguous float32 copy of predicting logits [..., Vl], scaled and masked.

    Fresh, because Megatron's cross entropy subtracts the max from its input in place: handed
    a view, it would overwrite the model's logits. One copy whatever the input dtype.
    """
    out_Vl = torch.empty(pred_Vl.shape, dtype=torch.float32, device=pred_Vl.device)
    out_Vl = out_Vl.copy_(pred_Vl)
    if temperature > 0 and temperature != 1.0:
        out_Vl = out_Vl / temperature
    num_real = vocab_size - vocab_start
    if num_real < out_Vl.shape[-1]:
        out_Vl[..., max(num_real, 0) :] = _MASKED_LOGIT
    return out_Vl


def vocab_parallel_rows(
    pred_NVl: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    needs_entropy: bool,
    tp_group: object = None,
) -> torch.Tensor:
    """[N, 1 or 2] float32 (logprob of each target, entropy) from predicting logits [N, Vl].

    The unshifted core of the two functions below, for logits computed a chunk at a time.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    kwargs = {"vocab_start": vocab_start, "vocab_size": vocab_size, "temperature": temperature}
    logprob_N = -vocab_parallel_cross_entropy(_prepare_rows(pred_NVl, **kwargs), targets_N)
    if not needs_entropy:
        return logprob_N[:, None]
    entropy_N = _entropy(_prepare_rows(pred_NVl, **kwargs), tp_group)
    return torch.stack([logprob_N, entropy_N], dim=-1)


def compute_vocab_parallel_logprobs(
    logits_BTVl: torch.Tensor,
    input_ids_BT: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """[B, T] float32 logprobs through Megatron's vocab-parallel cross entropy (differentiable).

    vocab_start: the first global vocabulary id of this rank's columns; vocab_size: the real
    (unpadded) vocabulary. Collective over Megatron's tensor-parallel group.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    pred_BTVl = _prepare(
        logits_BTVl, vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature
    )
    # Megatron's cross entropy works on [..., V/tp] with global target ids: two all-reduces
    # (max, sum-exp) of [B, T - 1] scalars, never a gathered [B, T, V] tensor.
    nll_BT = vocab_parallel_cross_entropy(pred_BTVl, input_ids_BT[:, 1:].contiguous())
    return torch.nn.functional.pad(-nll_BT, (1, 0), value=0.0)


def compute_vocab_parallel_entropy(
    logits_BTVl: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    tp_group: object = None,
) -> torch.Tensor:
    """[B, T] entropy of the next-token distribution (differentiable), aligned as above.

    With y = x - max (global max, no gradient), S = sum_v exp(y_v), A = sum_v exp(y_v) y_v:
    H = log S - A / S. S and A are all-reduced with identity backward; H depends on a rank's
    columns only through its own terms of S and A, so each rank's gradient is exact. (Writing
    H = lse - sum_v p_v y_v with p from a reduced lse would not be: p's own dependence on lse
    would only be counted for the local columns.)
    """
    x_BTVl = _prepare(
        logits_BTVl, vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature
    )
    return torch.nn.functional.pad(_entropy(x_BTVl, tp_group), (1, 0), value=0.0)


def _entropy(x_Vl: torch.Tensor, tp_group: object) -> torch.Tensor:
    """Entropy over the last (vocabulary-parallel) dim of prepared logits; see above."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    max_ = x_Vl.detach().amax(-1)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(max_, op=dist.ReduceOp.MAX, group=tp_group)
    y_Vl = x_Vl - max_[..., None]
    exp_Vl = y_Vl.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp_Vl.sum(-1))
    sum_exp_y = reduce_from_tensor_model_parallel_region((exp_Vl * y_Vl).sum(-1))
    return sum_exp.log() - sum_exp_y / sum_exp
