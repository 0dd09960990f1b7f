"""Rollout correction: importance weights of the trainer's old policy against the engine's.

Shape legend (suffixes on tensor names):
    B  samples
    T  token positions, aligned with input_ids (see yatt.core.rl._losses)

The rollout engine (vLLM, SGLang, the built-in one in bf16) samples from pi_rollout, which
differs from the trainer's pi_old by kernels and precision even at equal weights. The policy
gradient is an expectation under pi_old, so each token's loss is reweighted by

    w_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_logprob_t - rollout_logprob_t)     (token)
    w   = prod_t w_t = exp(sum_t (old_logprob_t - rollout_logprob_t))                (sequence)

(Yao et al., "Your efficient RL framework secretly brings you off-policy RL training", 2025;
Liu, Li et al., "When speed kills stability", 2025). An unbounded weight has unbounded
variance, so the weight is either truncated, min(w, C) (TIS), or the token or sequence is
masked out of the policy-gradient term when w > C (MIS). Mode names follow TRL's
`vllm_importance_sampling_mode`; the log-ratio is clamped to +-20 before exp, as verl's
rollout_corr_helper does (only a tiny or huge weight is affected, both then truncated or
masked alike). The weight is a constant of the loss (no gradient flows through it).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

RolloutCorrection = Literal[
    "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
]
ROLLOUT_CORRECTIONS: tuple[str, ...] = (
    "none",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
)

# exp(20) ~ 4.9e8: beyond it a weight is certainly over any cap; within it float32 is exact.
_MAX_LOG_WEIGHT = 20.0


def compute_rollout_weights(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    mode: RolloutCorrection,
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights_BT, is_capped_BT): the importance weight of each token (0 off the loss mask)
    and where the cap acted (truncated or masked). A sequence mode gives every token of a
    sequence its sequence's weight; mode "none" gives weight 1 everywhere.

    token_truncate: min(w_t, C)               sequence_truncate: min(w, C)
    token_mask:     w_t if w_t <= C, else 0   sequence_mask:     w if w <= C, else 0
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"mode={mode!r} is not known; use one of {ROLLOUT_CORRECTIONS}")
    if not cap > 1.0:
        raise ValueError(f"cap={cap!r}: must be > 1 (a cap <= 1 would shrink on-policy tokens)")
    mask_BT = loss_mask_BT.to(torch.float32)
    if mode == "none":
        return mask_BT.clone(), torch.zeros_like(mask_BT, dtype=torch.bool)
    log_w_BT = (old_logprobs_BT.detach() - rollout_logprobs_BT.detach()).to(torch.float32)
    # Selected, not multiplied: an engine's -inf off the mask would make inf * 0 = NaN.
    log_w_BT = torch.where(mask_BT > 0, log_w_BT, 0.0)
    if mode.startswith("sequence"):
        log_w_BT = log_w_BT.sum(-1, keepdim=True).expand_as(mask_BT)
    weights_BT = torch.exp(log_w_BT.clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT))
    is_capped_BT = (weights_BT > cap) & (mask_BT > 0)
    if mode.endswith("truncate"):
        weights_BT = weights_BT.clamp(max=cap)
    else:
        weights_BT = torch.where(is_capped_BT, 0.0, weights_BT)
    return torch.where(mask_BT > 0, weights_BT, 0.0) * mask_BT, is_capped_BT


def compute_mismatch_kl(
    old_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor
) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_rollout || pi_old) from the engine's samples.

    With r = pi_old / pi_rollout on a token the engine sampled, E_rollout[r - 1 - log r] =
    KL(pi_rollout || pi_old) (Schulman's k3; verl logs the same as rollout_corr/kl_k3). The
    log-ratio is clamped to +-20 as in compute_rollout_weights.
    """
    log_r_BT = (old_logprobs_BT.detach() - rollout_logprobs_BT.detach()).to(torch.float32)
    log_r_BT = log_r_BT.clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT)
    return torch.expm1(log_r_BT) - log_r_BT


def engine_old_logprobs(batch: Any) -> torch.Tensor:
    """The batch's engine logprobs ("rollout_logprobs" [B, T], 0 off the response) as pi_old's,
    for PolicyLoss(old_logprobs_from="engine"): no forward pass. ValueError when the batch
    has none (an engine or batch builder that gave no logprobs)."""
    if "rollout_logprobs" not in batch:
        raise ValueError(
            "loss.old_logprobs_from='engine' needs the engine's logprobs, and the batch has no "
            "'rollout_logprobs': build it with yatt.core.rollout_samples/rollout_batch from "
            "completions that carry them, or set old_logprobs_from='trainer'"
        )
    return batch["rollout_logprobs"].detach().to(torch.float32)
