"""Policy-gradient losses for GRPO/DAPO: clipped surrogate, KL to a reference, entropy.

Shape legend (suffixes on tensor names):
    B  samples in a (micro-)batch
    T  token positions, right-padded; position t holds the logprob of input token t
    V  vocabulary
Token tensors are aligned with `input_ids`: `logprobs_BT[i, t] = log p(input_ids[i, t] | prefix)`,
and `loss_mask_BT` is 1 on response tokens only (never on prompt or padding).

Every loss here is written in "sum form": the sum over this micro-batch of per-unit losses, where
a unit is a token ("token_mean") or a sequence ("seq_mean_token_mean"). The trainer divides by
the number of units in the *global* batch (all micro-batches, all data-parallel ranks), which is
what makes gradient accumulation and data parallelism give exactly the full-batch gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean"]
KLEstimator = Literal["k1", "k2", "k3"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

# exp() of a log-ratio beyond this overflows float32 or dominates the batch; the clamp bounds
# the estimate, and such tokens carry no useful gradient anyway.
_MAX_LOG_RATIO = 20.0


def compute_clipped_policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss and where the clip is active.

    PPO (arXiv:1707.06347, eq. 7): L = -min(r A, clip(r, 1 - eps, 1 + eps) A), r = pi / pi_old.
    DAPO clip-higher (arXiv:2503.14476, eq. 10): separate eps_low / eps_high, e.g. 0.2 / 0.28.
    Dual clip (arXiv:1912.09729, eq. 5), when dual_clip_c is set: for A < 0 the loss is also
    capped at -c A, so a huge ratio on a bad token cannot blow up the step.
    Returns (loss_BT, is_clipped_BT); gradient flows only into logprobs_BT.
    """
    log_ratio_BT = (logprobs_BT - old_logprobs_BT.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio_BT = torch.exp(log_ratio_BT)
    advantages_BT = advantages_BT.detach()
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    is_clipped_BT = clipped_BT > unclipped_BT
    if dual_clip_c is not None:
        cap_BT = -advantages_BT * dual_clip_c
        is_capped_BT = (advantages_BT < 0) & (cap_BT < loss_BT)
        loss_BT = torch.where(is_capped_BT, cap_BT, loss_BT)
        is_clipped_BT = is_clipped_BT | is_capped_BT
    return loss_BT, is_clipped_BT


def compute_kl(
    logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, *, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    Schulman, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html), with
    log r = log pi_ref - log pi:  k1 = -log r,  k2 = (log r)^2 / 2,  k3 = (r - 1) - log r.
    k3 is unbiased and non-negative; GRPO uses it (arXiv:2402.03300, eq. 4).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not known; use one of {KL_ESTIMATORS}")
    log_r_BT = (ref_logprobs_BT.detach() - logprobs_BT).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if estimator == "k1":
        return -log_r_BT
    if estimator == "k2":
        return 0.5 * log_r_BT.square()
    return torch.expm1(log_r_BT) - log_r_BT


def sum_over_units(
    values_BT: torch.Tensor, loss_mask_BT: torch.Tensor, *, aggregation: Aggregation
) -> torch.Tensor:
    """Sum of per-unit values: per token ("token_mean", DAPO eq. 12) or per sequence, each the
    mean over its tokens ("seq_mean_token_mean", GRPO arXiv:2402.03300 eq. 3)."""
    mask_BT = loss_mask_BT.to(values_BT.dtype)
    if aggregation == "token_mean":
        return (values_BT * mask_BT).sum()
    if aggregation == "seq_mean_token_mean":
        per_seq_B = (values_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1.0)
        return per_seq_B.sum()
    raise ValueError(f"aggregation={aggregation!r} is not known; use one of {AGGREGATIONS}")


def count_units(loss_mask_BT: torch.Tensor, *, aggregation: Aggregation) -> torch.Tensor:
    """Number of units `sum_over_units` sums over: tokens, or sequences with a response token."""
    if aggregation == "token_mean":
        return loss_mask_BT.sum().to(torch.float64)
    if aggregation == "seq_mean_token_mean":
        return (loss_mask_BT.sum(-1) > 0).sum().to(torch.float64)
    raise ValueError(f"aggregation={aggregation!r} is not known; use one of {AGGREGATIONS}")


def aggregate(
    values_BT: torch.Tensor, loss_mask_BT: torch.Tensor, *, aggregation: Aggregation
) -> torch.Tensor:
    """Mean over units of this batch alone (for metrics and single-batch use)."""
    num_units = count_units(loss_mask_BT, aggregation=aggregation).clamp(min=1.0)
    return sum_over_units(values_BT, loss_mask_BT, aggregation=aggregation) / num_units.to(
        values_BT.dtype
    )


@dataclass(kw_only=True, frozen=True)
class PolicyLoss:
    """The GRPO/DAPO objective as one callable for `TorchPolicy.train_step`.

    loss = clipped surrogate + kl_coef * KL(pi || pi_ref) - entropy_coef * entropy, aggregated
    per token or per sequence. Reads from the micro-batch: "loss_mask" [B, T], "old_logprobs"
    [B, T], "advantages" ([B] per sample or [B, T] per token) and, when kl_coef > 0,
    "ref_logprobs" [B, T]. With "rollout_logprobs" [B, T] (the engine's, float) in the batch it
    also reports "rollout_mismatch": the summed |trainer - engine| logprob gap on loss tokens.

    is_on_policy: one optimizer step per rollout batch (GRPO's usual setting; TRL's at
    num_iterations=1). The old policy is then the current one, so "old_logprobs" are the training
    forward's own logprobs, detached (ratio 1, same gradient), and the separate old-logprob
    forward pass can be skipped. Wrong for several steps (PPO epochs, mini-batches) per rollout
    batch: the later steps would not be clipped against the policy that sampled.
    """

    clip_low: float = 0.2  # eps_low; PPO and GRPO use 0.2
    clip_high: float = 0.2  # eps_high; DAPO's clip-higher uses 0.28
    dual_clip_c: float | None = None  # cap for negative advantages (> 1), None = off
    kl_coef: float = 0.0  # beta in GRPO eq. 3; DAPO drops the KL term (0)
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0  # bonus on the policy's entropy; 0 = off
    should_compute_entropy: bool = False  # report entropy even when entropy_coef is 0
    aggregation: Aggregation = "token_mean"
    is_on_policy: bool = False

    def __post_init__(self) -> None:
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if not (value >= 0.0 and value < float("inf")):
                raise ValueError(f"PolicyLoss.{name}={value!r}: must be a finite number >= 0")
        if self.clip_low >= 1.0:
            raise ValueError(f"PolicyLoss.clip_low={self.clip_low!r}: must be < 1 (e.g. 0.2)")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(
                f"PolicyLoss.dual_clip_c={self.dual_clip_c!r}: must be > 1 (e.g. 3.0) or None"
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"PolicyLoss.kl_estimator={self.kl_estimator!r}: use one of {KL_ESTIMATORS}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"PolicyLoss.aggregation={self.aggregation!r}: use one of {AGGREGATIONS}"
            )

    @property
    def needs_entropy(self) -> bool:
        """Whether the policy must compute the entropy (costs a pass over the vocabulary)."""
        return self.entropy_coef > 0 or self.should_compute_entropy

    def count_units(self, batch: Any) -> torch.Tensor:
        """Units of `batch` that the loss averages over; the policy sums this over all ranks."""
        return count_units(batch["loss_mask"], aggregation=self.aggregation)

    def __call__(
        self, batch: Any, logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss summed over units, metric sums over loss tokens) for one micro-batch."""
        for key in ("loss_mask", "advantages", *(() if self.is_on_policy else ("old_logprobs",))):
            if key not in batch:
                raise ValueError(
                    f"PolicyLoss: the batch has no {key!r}; set it before train_step (e.g. "
                    "batch.tokens['old_logprobs'] = policy.logprobs(batch), or "
                    "PolicyLoss(is_on_policy=True) for one optimizer step per rollout batch)"
                )
        mask_BT = batch["loss_mask"].to(logprobs_BT.dtype)
        old_BT = logprobs_BT.detach() if self.is_on_policy else batch["old_logprobs"]
        advantages = batch["advantages"].to(logprobs_BT.dtype)
        advantages_BT = (
            advantages[:, None].expand_as(logprobs_BT) if advantages.dim() == 1 else advantages
        )
        pg_loss_BT, is_clipped_BT = compute_clipped_policy_loss(
            logprobs_BT,
            old_BT.to(logprobs_BT.dtype),
            advantages_BT,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip_c=self.dual_clip_c,
        )
        loss_BT = pg_loss_BT
        metrics = {
            "pg_loss": (pg_loss_BT.detach() * mask_BT).sum(),
            "clip_frac": (is_clipped_BT.to(mask_BT.dtype) * mask_BT).sum(),
        }
        if "rollout_logprobs" in batch:
            gap_BT = (logprobs_BT.detach() - batch["rollout_logprobs"].to(logprobs_BT.dtype)).abs()
            metrics["rollout_mismatch"] = (gap_BT * mask_BT).sum()
        if self.kl_coef > 0:
            if "ref_logprobs" not in batch:
                raise ValueError(
                    f"PolicyLoss(kl_coef={self.kl_coef}) needs 'ref_logprobs' in the batch; "
                    "compute them with the reference policy or set kl_coef=0"
                )
            kl_BT = compute_kl(
                logprobs_BT,
                batch["ref_logprobs"].to(logprobs_BT.dtype),
                estimator=self.kl_estimator,
            )
            loss_BT = loss_BT + self.kl_coef * kl_BT
            metrics["kl"] = (kl_BT.detach() * mask_BT).sum()
        if self.needs_entropy:
            if entropy_BT is None:
                raise ValueError("PolicyLoss needs entropy_BT; the policy did not compute it")
            if self.entropy_coef > 0:
                loss_BT = loss_BT - self.entropy_coef * entropy_BT
            metrics["entropy"] = (entropy_BT.detach() * mask_BT).sum()
        loss = sum_over_units(loss_BT, mask_BT, aggregation=self.aggregation)
        return loss, metrics
