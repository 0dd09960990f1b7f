"""Per-token policy-gradient surrogates: PPO's clip (GRPO, Dr. GRPO, DAPO), GSPO, GSPO-token,
CISPO.

Shape legend (suffixes on tensor names):
    B  samples
    T  token positions, aligned with input_ids (see yatt.core.rl._losses)

Each returns (loss_BT, regions): the loss to minimise at every position (the caller masks and
aggregates it) and `ClipRegions`, where the clip acted. r = pi / pi_old is the ratio of the
policy being trained to the one whose logprobs the batch carries as "old_logprobs"; with one
optimizer step per rollout batch r = 1 everywhere and no clip can act. Gradients flow only into
`logprobs_BT`: old logprobs and advantages are constants.

Masks select, never multiply: a NaN or -inf logprob off the loss mask (an engine's -inf on a
padded position) times 0 is NaN, and would poison the whole loss. At an extreme ratio (a log
ratio beyond MAX_LOG_RATIO, e.g. an engine logprob of -inf used as pi_old) the gradient is cut,
as clamp() cuts PPO's and GSPO's and verl's clamp of GSPO's log ratio does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# exp() of a log-ratio beyond this overflows float32 or dominates the batch; the clamp bounds
# the estimate, and such tokens carry no useful gradient anyway.
MAX_LOG_RATIO = 20.0


class ClipRegions(NamedTuple):
    """Bool [B, T] masks of where a clip acted; disjoint, so their sum is the total.

    low:  the ratio fell below 1 - clip_low (PPO: on a negative advantage; CISPO: any token)
    high: the ratio rose above 1 + clip_high (PPO: on a positive advantage; CISPO: any token)
    dual: dual clip capped a negative advantage's loss (ratio above dual_clip_c)
    """

    low_BT: torch.Tensor
    high_BT: torch.Tensor
    dual_BT: torch.Tensor


def _ratio(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor) -> torch.Tensor:
    log_ratio_BT = logprobs_BT - old_logprobs_BT.detach()
    return torch.exp(log_ratio_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def compute_clipped_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, ClipRegions]:
    """Per-token clipped surrogate loss and where the clip acted.

    PPO (arXiv:1707.06347, eq. 7): L = -min(r A, clip(r, 1 - eps, 1 + eps) A), r = pi / pi_old.
    DAPO clip-higher (arXiv:2503.14476, eq. 10): separate eps_low / eps_high, e.g. 0.2 / 0.28.
    Dual clip (arXiv:1912.09729, eq. 5), when dual_clip_c is set: for A < 0 the loss is also
    capped at -c A, so a huge ratio on a bad token cannot blow up the step.
    """
    return _clip_surrogate(
        _ratio(logprobs_BT, old_logprobs_BT),
        advantages_BT,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip_c=dual_clip_c,
    )


def _clip_surrogate(
    ratio_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, ClipRegions]:
    """PPO's clipped surrogate on a given ratio (see compute_clipped_policy_loss)."""
    advantages_BT = advantages_BT.detach()
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    # The clipped term wins (and the gradient vanishes) only outside the range on the side
    # where moving further would help: above it for A > 0, below it for A < 0.
    is_clipped_BT = clipped_BT > unclipped_BT
    low_BT = is_clipped_BT & (advantages_BT < 0)
    high_BT = is_clipped_BT & (advantages_BT > 0)
    dual_BT = torch.zeros_like(is_clipped_BT)
    if dual_clip_c is not None:
        cap_BT = -advantages_BT * dual_clip_c
        dual_BT = (advantages_BT < 0) & (cap_BT < loss_BT)
        loss_BT = torch.where(dual_BT, cap_BT, loss_BT)
    return loss_BT, ClipRegions(low_BT, high_BT, dual_BT)


def compute_gspo_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, ClipRegions]:
    """GSPO (arXiv:2507.18071, eqs. 5-7): one clipped ratio per sequence.

    s_i = (pi(y_i) / pi_old(y_i)) ^ (1 / |y_i|) = exp(mean over y_i's tokens of log r_t)
    L_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
    The paper clips at 3e-4 / 4e-4 (sec. 5.1): s_i is a geometric mean, so it moves far less
    than a token's ratio. L_i is written on every token of sequence i, so the per-sequence mean
    ("seq_mean_token_mean") of loss_BT is L_i; A_i is the mean of the row's advantages on its
    loss tokens (GRPO's per-sample advantage is the same on every token). Rows without a loss
    token get loss 0.
    """
    is_loss_BT = loss_mask_BT > 0
    num_tokens_B = is_loss_BT.sum(-1).clamp(min=1).to(logprobs_BT.dtype)
    log_ratio_BT = torch.where(is_loss_BT, logprobs_BT - old_logprobs_BT.detach(), 0.0)
    log_seq_ratio_B = (log_ratio_BT.sum(-1) / num_tokens_B).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    seq_ratio_B = torch.exp(log_seq_ratio_B)
    advantages_B = torch.where(is_loss_BT, advantages_BT.detach(), 0.0).sum(-1) / num_tokens_B
    unclipped_B = -advantages_B * seq_ratio_B
    clipped_B = -advantages_B * seq_ratio_B.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_B = torch.maximum(unclipped_B, clipped_B)
    is_clipped_B = clipped_B > unclipped_B
    shape = logprobs_BT.shape
    low_BT = (is_clipped_B & (advantages_B < 0))[:, None].expand(shape)
    high_BT = (is_clipped_B & (advantages_B > 0))[:, None].expand(shape)
    return loss_B[:, None].expand(shape), ClipRegions(low_BT, high_BT, torch.zeros_like(low_BT))


def compute_gspo_token_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, ClipRegions]:
    """GSPO-token (arXiv:2507.18071, sec. 4.3, eqs. 16-18): GSPO with an advantage per token.

    s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})]                            (eq. 17)
    L_{i,t} = -min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) A_{i,t})
    J = 1/G sum_i 1/|y_i| sum_t (-L_{i,t})                                       (eq. 16)
    s_i is GSPO's sequence ratio (compute_gspo_policy_loss), sg a stop-gradient. s_{i,t}
    equals s_i in value, so the clip acts where GSPO's would (per token now, by the sign of
    A_{i,t}); its gradient is s_i d log pi(y_{i,t}), each token's own advantage weighing its
    own term (eq. 18). With A_{i,t} = A_i on every token that is GSPO's gradient (eq. 11).
    The loss is per token; aggregate it per sequence ("seq_mean_token_mean") for eq. 16.

    Where log s_i lies beyond +-MAX_LOG_RATIO (an engine logprob of -inf as pi_old) the
    sequence's gradient is 0, as GSPO's (its clamp) and verl's (a clamp of the same sum): the
    stop-gradient alone would leave s_i = e^20 = 4.85e8 multiplying every token's gradient.
    gspo and gspo_token differ under a token-level rollout correction (PolicyLoss's default
    token_truncate), even with one advantage per sample: the weight w_t multiplies each
    token's loss, and (unclipped, seq_mean_token_mean) the gradients of sequence i are
        gspo:       -A_i s_i mean_t(w_t) * mean_t(d log pi_t)   every token weighed alike
        gspo_token: -A_i s_i mean_t(w_t d log pi_t)             each token by its own w_t
    They agree when a sequence's weights are equal: no correction, or a sequence-level one.
    """
    is_loss_BT = loss_mask_BT > 0
    num_tokens_B = is_loss_BT.sum(-1).clamp(min=1).to(logprobs_BT.dtype)
    log_ratio_BT = torch.where(is_loss_BT, logprobs_BT.detach() - old_logprobs_BT.detach(), 0.0)
    raw_log_seq_ratio_B = log_ratio_BT.sum(-1) / num_tokens_B
    is_in_range_B = raw_log_seq_ratio_B.abs() <= MAX_LOG_RATIO
    log_seq_ratio_B = raw_log_seq_ratio_B.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    # sg[s_i] * pi / sg[pi] in log space: log s_i + (log pi - sg[log pi]); the bracket is 0
    # in value and carries d log pi (cut where s_i was clamped).
    carrier_BT = torch.where(
        is_in_range_B[:, None] & is_loss_BT, logprobs_BT - logprobs_BT.detach(), 0.0
    )
    log_token_ratio_BT = log_seq_ratio_B[:, None] + carrier_BT
    return _clip_surrogate(
        torch.exp(log_token_ratio_BT), advantages_BT, clip_low=clip_low, clip_high=clip_high
    )


def compute_cispo_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, ClipRegions]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eqs. 4-5): clip the importance weight, not the update.

    L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t)
    The weight is a constant (stop-gradient), so every token keeps its gradient -w A d log pi,
    where PPO's clip would zero it; the paper sets no lower bound (eps_low large: clip_low >= 1
    makes the lower bound <= 0) and tunes eps_high only. The loss value is a log-likelihood
    term, not comparable with PPO's surrogate value; its gradient is what matters.
    """
    ratio_BT = _ratio(logprobs_BT, old_logprobs_BT).detach()
    weight_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = -weight_BT * advantages_BT.detach() * logprobs_BT
    low_BT = ratio_BT < 1.0 - clip_low
    high_BT = ratio_BT > 1.0 + clip_high
    return loss_BT, ClipRegions(low_BT, high_BT, torch.zeros_like(low_BT))
