"""The RL objective: `PolicyLoss` (GRPO, Dr. GRPO, DAPO, GSPO, GSPO-token, CISPO), KL to a reference,
entropy, rollout correction, and how the loss is aggregated.

Shape legend (suffixes on tensor names):
    B  samples in a (micro-)batch
    T  token positions, right-padded; position t holds the logprob of input token t
    V  vocabulary
Token tensors are aligned with `input_ids`: `logprobs_BT[i, t] = log p(input_ids[i, t] | prefix)`,
and `loss_mask_BT` is 1 on response tokens only (never on prompt or padding).

Every loss here is written in "sum form": the sum over this micro-batch of per-unit losses, where
a unit is a token ("token_mean"), a sequence ("seq_mean_token_mean"), or a sequence's share of
a constant token budget ("seq_mean_token_sum_norm"). The trainer divides by the number of units
in the *global* batch (all micro-batches, all data-parallel ranks), which is what makes gradient
accumulation and data parallelism give exactly the full-batch gradient.

Per micro-batch, PolicyLoss computes:

    old      = batch["old_logprobs"]  (or the forward's own, detached, when is_on_policy)
    pg_BT    = surrogate(objective)(logprobs, old, advantages)     yatt.core.rl._surrogates
    pg_BT   *= rollout weight(old vs batch["rollout_logprobs"])    yatt.core.rl._rollout_correction
    loss_BT  = pg_BT + kl_coef * KL(pi || pi_ref) - entropy_coef * entropy
    return sum_over_units(loss_BT), metric sums over loss tokens

Positions off the loss mask are selected away (torch.where) before any arithmetic, never
multiplied by 0: a NaN or -inf logprob there (an engine's -inf, a padded position) leaves the
loss and its gradient as they are without it, as verl's masking does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

from yatt.core.rl._advantages import (
    DEFAULT_ADVANTAGE_EPS,
    DEFAULT_ZERO_VARIANCE_TOLERANCE,
    MAX_ADVANTAGE_EPS,
    compute_grpo_advantages,
)
from yatt.core.rl._rollout_correction import (
    ROLLOUT_CORRECTIONS,
    RolloutCorrection,
    compute_mismatch_kl,
    compute_rollout_weights,
)
from yatt.core.rl._surrogates import (
    MAX_LOG_RATIO,
    compute_cispo_policy_loss,
    compute_clipped_policy_loss,
    compute_gspo_policy_loss,
    compute_gspo_token_policy_loss,
)
from yatt.core.runtime._repeated_log import RepeatedWarning

logger = logging.getLogger("yatt.core")
_NO_ROLLOUT_LOGPROBS = RepeatedWarning(logger, metric="train/is_weight (absent)")

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
OldLogprobsFrom = Literal["trainer", "engine"]
OLD_LOGPROBS_FROM: tuple[str, ...] = ("trainer", "engine")
Objective = Literal["grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "cispo"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
OBJECTIVES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "cispo")


@dataclass(frozen=True)
class _ObjectiveDefaults:
    clip_low: float
    clip_high: float
    aggregation: str
    should_std_normalize: bool


# What each paper uses where PolicyLoss's field is None (see PolicyLoss's docstring).
OBJECTIVE_DEFAULTS: dict[str, _ObjectiveDefaults] = {
    "grpo": _ObjectiveDefaults(0.2, 0.2, "seq_mean_token_mean", True),
    "dr_grpo": _ObjectiveDefaults(0.2, 0.2, "seq_mean_token_sum_norm", False),
    "dapo": _ObjectiveDefaults(0.2, 0.28, "token_mean", True),
    "gspo": _ObjectiveDefaults(3e-4, 4e-4, "seq_mean_token_mean", True),
    "gspo_token": _ObjectiveDefaults(3e-4, 4e-4, "seq_mean_token_mean", True),
    "cispo": _ObjectiveDefaults(1.0, 0.28, "token_mean", True),
}
# k3's value is clamped to this, as verl's kl_penalty "low_var_kl" does: at log-ratio 15 the
# estimate is 3.3e6, one token then outweighs the whole batch.
_MAX_K3 = 10.0


def compute_kl(
    logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, *, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token KL penalty between the policy pi and the reference pi_ref, on tokens sampled
    from pi (on-policy; the rollout's samples approximate them).

    Schulman, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html), with
    log r = log pi_ref - log pi:  k1 = -log r,  k2 = (log r)^2 / 2,  k3 = (r - 1) - log r.
    Values: k1 and k3 are unbiased estimates of the reverse KL(pi || pi_ref), k3 with lower
    variance and never negative; k2 is biased (exact to second order). GRPO uses k3
    (arXiv:2402.03300, eq. 4). k3 is clamped to [-10, 10] as verl's "low_var_kl" does.
    Gradients, as a loss term with the samples held fixed: k2's is an unbiased gradient of
    KL(pi || pi_ref); k3's is, in expectation, the gradient of the *forward* KL(pi_ref || pi)
    (d k3 = (1 - r) d log pi, E_pi[(1 - r) d log pi] = -E_pi_ref[d log pi]); k1's is zero in
    expectation (E_pi[d log pi] = 0), so k1 penalises nothing on average.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not known; use one of {KL_ESTIMATORS}")
    log_r_BT = (ref_logprobs_BT.detach() - logprobs_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if estimator == "k1":
        return -log_r_BT
    if estimator == "k2":
        return 0.5 * log_r_BT.square()
    return (torch.expm1(log_r_BT) - log_r_BT).clamp(-_MAX_K3, _MAX_K3)


def _check_aggregation(aggregation: str, max_response_tokens: int | None) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is not known; use one of {AGGREGATIONS}")
    if aggregation == "seq_mean_token_sum_norm" and max_response_tokens is None:
        raise ValueError(
            "aggregation='seq_mean_token_sum_norm' divides by a constant length: pass "
            "max_response_tokens (the rollout's max_new_tokens)"
        )


def sum_over_units(
    values_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    aggregation: Aggregation,
    max_response_tokens: int | None = None,
) -> torch.Tensor:
    """Sum of per-unit values, to be divided by `count_units` of the global batch.

    token_mean:              sum over loss tokens (DAPO arXiv:2503.14476, eq. 12)
    seq_mean_token_mean:     sum over sequences of each one's token mean (GRPO
                             arXiv:2402.03300, eq. 3)
    seq_mean_token_sum_norm: sum over loss tokens; the units are sequences x
                             max_response_tokens, a constant (Dr. GRPO arXiv:2503.20783, sec.
                             3.1: no 1/|o_i|; TRL's loss_type="dr_grpo", verl's
                             "seq-mean-token-sum-norm")
    A row without a loss token adds 0 (and no unit). For seq_mean_token_sum_norm that is
    TRL's convention (its dr_grpo divides by the rows that hold completion tokens x
    max_completion_length), not verl's (seq-mean-token-sum-norm divides by every row of the
    batch, an empty one included); the two differ only when a row has no loss token (a
    response cut to nothing, a dummy row).
    """
    _check_aggregation(aggregation, max_response_tokens)
    is_loss_BT = loss_mask_BT > 0
    masked_BT = torch.where(is_loss_BT, values_BT, 0.0)
    if aggregation == "seq_mean_token_mean":
        num_tokens_B = is_loss_BT.sum(-1).clamp(min=1).to(values_BT.dtype)
        return (masked_BT.sum(-1) / num_tokens_B).sum()
    return masked_BT.sum()


def count_units(
    loss_mask_BT: torch.Tensor,
    *,
    aggregation: Aggregation,
    max_response_tokens: int | None = None,
) -> torch.Tensor:
    """Number of units `sum_over_units` sums over (float64): tokens, sequences with a loss
    token, or those sequences times max_response_tokens."""
    _check_aggregation(aggregation, max_response_tokens)
    if aggregation == "token_mean":
        return loss_mask_BT.sum().to(torch.float64)
    num_sequences = (loss_mask_BT.sum(-1) > 0).sum().to(torch.float64)
    if aggregation == "seq_mean_token_mean":
        return num_sequences
    assert max_response_tokens is not None  # _check_aggregation
    return num_sequences * float(max_response_tokens)


def aggregate(
    values_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    aggregation: Aggregation,
    max_response_tokens: int | None = None,
) -> torch.Tensor:
    """Mean over units of this batch alone (for metrics and single-batch use)."""
    kwargs = {"aggregation": aggregation, "max_response_tokens": max_response_tokens}
    num_units = count_units(loss_mask_BT, **kwargs).clamp(min=1.0)
    return sum_over_units(values_BT, loss_mask_BT, **kwargs) / num_units.to(values_BT.dtype)


@dataclass(kw_only=True, frozen=True)
class PolicyLoss:
    """The RL objective as one callable for `policy.train_step`, and the update settings around it.

    objective picks the policy-gradient term; a field left None takes that paper's value:

        objective  paper, equation                          clip low/high  aggregation          std
        grpo       arXiv:2402.03300 eq. 3 (PPO clip)        0.2 / 0.2      seq_mean_token_mean  on
        dr_grpo    arXiv:2503.20783 sec. 3.1                0.2 / 0.2      seq_mean_token_sum_norm off
        dapo       arXiv:2503.14476 eqs. 8, 10, 12          0.2 / 0.28     token_mean           on
        gspo       arXiv:2507.18071 eqs. 5-7 (seq. ratio)   3e-4 / 4e-4    seq_mean_token_mean  on
        gspo_token arXiv:2507.18071 eqs. 16-17 (per token)  3e-4 / 4e-4    seq_mean_token_mean  on
        cispo      arXiv:2506.13585 eqs. 4-5 (clipped IS)   1.0 / 0.28     token_mean           on

    (std: advantages divided by the group's reward std; cispo's clip_low 1.0 is the paper's "no
    lower bound"; its eps_high is unpublished, 0.28 follows DAPO's clip-higher. gspo_token
    gives each token GSPO's sequence ratio in value and its own logprob's gradient, so a
    per-token advantage [B, T] weighs each token; with GRPO's one advantage per sample its
    gradient is GSPO's only without a token-level rollout correction: under the default
    token_truncate each token's gradient is weighed by its own rollout weight in gspo_token, by
    the sequence's mean weight in gspo; see compute_gspo_token_policy_loss. dr_grpo's
    normaliser counts only rows with a loss token (TRL's convention; verl counts every row):
    see sum_over_units.)

    loss = policy-gradient term x rollout weight + kl_coef * KL(pi || pi_ref)
           - entropy_coef * entropy, aggregated per unit (see sum_over_units).
    Reads from the micro-batch: "loss_mask" [B, T], "advantages" ([B] per sample or [B, T] per
    token), "old_logprobs" [B, T] unless is_on_policy, "ref_logprobs" [B, T] when kl_coef > 0,
    and "rollout_logprobs" [B, T] (the engine's) for the rollout correction.

    Several optimizer steps per rollout batch (num_mini_batches x num_epochs > 1) are what let
    the clip act (the ratio is 1 at the first step). The trainer then computes "old_logprobs"
    once, before the first update, splits its batch with `split_mini_batches` and calls
    train_step per mini-batch; each step's loss is normalised over that mini-batch's units
    across all ranks.

    old_logprobs_from: where pi_old's logprobs come from. "trainer" (default): the trainer's
    own forward, once per rollout batch, and rollout_correction weighs the engine's sampler
    against it (verl's "decoupled" mode: three policies, engine / old / current). "engine":
    the engine's sampled-token logprobs ("rollout_logprobs") are pi_old (verl's rollout
    correction "bypass_mode", slime's --use-rollout-logprobs): no old-logprob forward, and
    the ratio pi / pi_rollout is clipped directly, so the clip also bounds the engine-trainer
    mismatch. pi_old is then the engine's policy, so there is nothing left for a rollout
    correction: old_logprobs_from="engine" requires rollout_correction="none" and
    is_on_policy=False (both refused otherwise, naming the field).

    is_on_policy: one optimizer step per rollout batch (GRPO's usual setting; TRL's at
    num_iterations=1). The old policy is then the current one, so "old_logprobs" are the
    training forward's own logprobs, detached (ratio 1, same gradient), and the separate
    old-logprob forward pass can be skipped. Refused with several steps per batch.

    rollout_correction (on by default): the engine's sampler differs from the trainer's
    forward (kernels, bf16), so each token's policy-gradient term is weighted by pi_old /
    pi_rollout, truncated at rollout_correction_cap ("*_truncate", TIS) or masked above it
    ("*_mask", MIS), per token or per sequence. Token-level truncation at 2 (TRL's first
    default, verl's rollout_is="token" threshold 2.0) never drops data and only reweights
    tokens the engine under-sampled by more than 2x; sequence-level weights multiply over
    hundreds of tokens and mask most long responses at small mismatches. "none" turns it off.
    """

    # grpo, dr_grpo, dapo, gspo, gspo_token or cispo (table in the docstring)
    objective: Objective = "grpo"
    clip_low: float | None = None  # eps_low (None: the objective's); 1 or more: no lower clip
    clip_high: float | None = None  # eps_high (None: the objective's); DAPO's clip-higher 0.28
    dual_clip_c: float | None = None  # cap for negative advantages (> 1), None = off
    kl_coef: float = 0.0  # beta in GRPO eq. 3; DAPO drops the KL term (0)
    kl_estimator: KLEstimator = "k3"  # k1, k2 or k3 (see compute_kl for their gradients)
    entropy_coef: float = 0.0  # bonus on the policy's entropy; 0 = off
    should_compute_entropy: bool = False  # report entropy even when entropy_coef is 0
    # token_mean, seq_mean_token_mean or seq_mean_token_sum_norm (None: the objective's)
    aggregation: Aggregation | None = None
    # The constant length seq_mean_token_sum_norm divides by: the rollout's max_new_tokens
    max_response_tokens: int | None = None
    is_on_policy: bool = False  # old logprobs = the forward's, detached (one step per batch)
    # pi_old: "trainer" (a forward) or "engine" (its logprobs; rollout_correction='none')
    old_logprobs_from: OldLogprobsFrom = "trainer"
    num_mini_batches: int = 1  # optimizer steps per pass over a batch (TRL steps_per_generation)
    num_epochs: int = 1  # passes over each rollout batch (PPO epochs, TRL num_iterations)
    # num_epochs > 1: True gives each epoch a new seeded split of the groups. Off by default:
    # two-epoch CPU runs of dapo.yaml stalled (20 steps without reward variance) with it in
    # 3 of 3 seeds and in 0 of 3 without; unexplained, so it stays opt-in until tested at scale.
    should_reshuffle_epochs: bool = False
    # none, token_truncate, token_mask, sequence_truncate, sequence_mask
    rollout_correction: RolloutCorrection = "token_truncate"
    rollout_correction_cap: float = 2.0  # C of the rollout weight (> 1)
    should_std_normalize: bool | None = None  # A divided by the group's std (None: objective's)
    advantage_eps: float = DEFAULT_ADVANTAGE_EPS  # A = (r - mean) / (std + eps)
    zero_variance_tolerance: float = DEFAULT_ZERO_VARIANCE_TOLERANCE  # closer rewards: A = 0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"PolicyLoss.objective={self.objective!r}: use one of {OBJECTIVES}")
        for name in ("kl_coef", "entropy_coef", "advantage_eps", "zero_variance_tolerance"):
            _check_finite_nonnegative(name, getattr(self, name))
        if not 0.0 < self.advantage_eps <= MAX_ADVANTAGE_EPS:
            raise ValueError(
                f"PolicyLoss.advantage_eps={self.advantage_eps!r}: must be in (0, "
                f"{MAX_ADVANTAGE_EPS}] (A = (r - mean) / (std + eps); 0 divides a constant "
                "group's 0 by 0); use 1e-4 (TRL's) or 1e-6 (verl's)"
            )
        defaults = OBJECTIVE_DEFAULTS[self.objective]
        resolved = {
            "clip_low": defaults.clip_low if self.clip_low is None else self.clip_low,
            "clip_high": defaults.clip_high if self.clip_high is None else self.clip_high,
            "aggregation": defaults.aggregation if self.aggregation is None else self.aggregation,
            "should_std_normalize": (
                defaults.should_std_normalize
                if self.should_std_normalize is None
                else self.should_std_normalize
            ),
        }
        for name in ("clip_low", "clip_high"):
            _check_finite_nonnegative(name, resolved[name])
        if self.dual_clip_c is not None:
            if self.objective in ("gspo", "gspo_token", "cispo"):
                raise ValueError(
                    f"PolicyLoss.dual_clip_c={self.dual_clip_c!r}: dual clip is PPO's "
                    f"(grpo, dr_grpo, dapo); objective={self.objective!r} has none: set it to None"
                )
            if not self.dual_clip_c > 1.0:
                raise ValueError(
                    f"PolicyLoss.dual_clip_c={self.dual_clip_c!r}: must be > 1 (e.g. 3.0) or None"
                )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"PolicyLoss.kl_estimator={self.kl_estimator!r}: use one of {KL_ESTIMATORS}"
            )
        if resolved["aggregation"] not in AGGREGATIONS:
            raise ValueError(
                f"PolicyLoss.aggregation={self.aggregation!r}: use one of {AGGREGATIONS}"
            )
        is_gspo = self.objective in ("gspo", "gspo_token")
        if is_gspo and resolved["aggregation"] != "seq_mean_token_mean":
            raise ValueError(
                f"PolicyLoss.aggregation={self.aggregation!r}: objective={self.objective!r} "
                "averages each sequence's tokens, then the sequences (arXiv:2507.18071 eqs. 5 "
                "and 16); use 'seq_mean_token_mean' or leave it None"
            )
        if self.max_response_tokens is not None and not (
            isinstance(self.max_response_tokens, int) and self.max_response_tokens >= 1
        ):
            raise ValueError(
                f"PolicyLoss.max_response_tokens={self.max_response_tokens!r}: must be an int >= 1 "
                "(the rollout's max_new_tokens) or None"
            )
        for name in ("num_mini_batches", "num_epochs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PolicyLoss.{name}={value!r}: must be an int >= 1")
        if not isinstance(self.should_reshuffle_epochs, bool):
            raise ValueError(
                f"PolicyLoss.should_reshuffle_epochs={self.should_reshuffle_epochs!r}: must be "
                "a bool"
            )
        if self.is_on_policy and self.num_updates_per_batch > 1:
            raise ValueError(
                f"PolicyLoss.is_on_policy=True with num_mini_batches={self.num_mini_batches} and "
                f"num_epochs={self.num_epochs}: only the first of the "
                f"{self.num_updates_per_batch} steps is on-policy; set is_on_policy=False (the "
                "trainer computes old_logprobs once per rollout batch)"
            )
        if self.old_logprobs_from not in OLD_LOGPROBS_FROM:
            raise ValueError(
                f"PolicyLoss.old_logprobs_from={self.old_logprobs_from!r}: use one of "
                f"{OLD_LOGPROBS_FROM}"
            )
        if self.old_logprobs_from == "engine" and self.is_on_policy:
            raise ValueError(
                "PolicyLoss.is_on_policy=True with old_logprobs_from='engine': on-policy takes "
                "pi_old from the loss's own forward, 'engine' from the rollout; set "
                "is_on_policy=False (or old_logprobs_from='trainer')"
            )
        if self.old_logprobs_from == "engine" and self.rollout_correction != "none":
            raise ValueError(
                f"PolicyLoss.rollout_correction={self.rollout_correction!r} with "
                "old_logprobs_from='engine': pi_old is then the engine's own policy, so the "
                "correction pi_old / pi_rollout is 1 everywhere; set rollout_correction='none' "
                "(or old_logprobs_from='trainer' to correct against the trainer's forward)"
            )
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(
                f"PolicyLoss.rollout_correction={self.rollout_correction!r}: use one of "
                f"{ROLLOUT_CORRECTIONS}"
            )
        cap = self.rollout_correction_cap
        if not (cap > 1.0 and cap < float("inf")):
            raise ValueError(
                f"PolicyLoss.rollout_correction_cap={cap!r}: must be a finite number > 1 (e.g. "
                "2.0); turn the correction off with rollout_correction='none'"
            )
        # Not fields: dataclasses.replace (and config overrides) re-resolve from the fields.
        object.__setattr__(self, "_resolved", resolved)

    # -- resolved settings ---------------------------------------------------------------------

    @property
    def resolved_clip_low(self) -> float:
        """clip_low, or the objective's when None."""
        return self._resolved["clip_low"]

    @property
    def resolved_clip_high(self) -> float:
        """clip_high, or the objective's when None."""
        return self._resolved["clip_high"]

    @property
    def resolved_aggregation(self) -> str:
        """aggregation, or the objective's when None."""
        return self._resolved["aggregation"]

    @property
    def resolved_should_std_normalize(self) -> bool:
        """should_std_normalize, or the objective's when None."""
        return self._resolved["should_std_normalize"]

    @property
    def num_updates_per_batch(self) -> int:
        """Optimizer steps per rollout batch: num_mini_batches x num_epochs."""
        return self.num_mini_batches * self.num_epochs

    @property
    def needs_entropy(self) -> bool:
        """Whether the policy must compute the entropy (costs a pass over the vocabulary)."""
        return self.entropy_coef > 0 or self.should_compute_entropy

    # -- checks against the run ----------------------------------------------------------------

    def check_rollout(self, *, prompts_per_rank: int, max_new_tokens: int) -> None:
        """Raise ValueError when this loss does not fit the rollout: mini-batches that do not
        divide a rank's groups (prompts_per_rank), or Dr. GRPO's length normaliser unset.
        Call it once, when the trainer's config is built."""
        if prompts_per_rank % self.num_mini_batches:
            raise ValueError(
                f"PolicyLoss.num_mini_batches={self.num_mini_batches} does not divide "
                f"prompts_per_rank={prompts_per_rank}: each mini-batch keeps whole GRPO groups; "
                "use a divisor of prompts_per_rank"
            )
        if self.resolved_aggregation == "seq_mean_token_sum_norm":
            if self.max_response_tokens is None:
                raise ValueError(
                    "PolicyLoss.max_response_tokens is None: aggregation "
                    "'seq_mean_token_sum_norm' (Dr. GRPO) divides by a constant length; set it "
                    f"to the rollout's max_new_tokens ({max_new_tokens})"
                )
            if self.max_response_tokens < max_new_tokens:
                raise ValueError(
                    f"PolicyLoss.max_response_tokens={self.max_response_tokens} is below "
                    f"max_new_tokens={max_new_tokens}: Dr. GRPO divides by the generation "
                    f"budget; set it to {max_new_tokens}"
                )

    # -- advantages ----------------------------------------------------------------------------

    def compute_advantages(
        self, rewards_B: torch.Tensor, group_ids_B: torch.Tensor
    ) -> torch.Tensor:
        """GRPO group advantages [B] with this objective's std normalisation, eps and
        zero-variance tolerance (compute_grpo_advantages)."""
        return compute_grpo_advantages(
            rewards_B,
            group_ids_B,
            should_std_normalize=self.resolved_should_std_normalize,
            eps=self.advantage_eps,
            zero_variance_tolerance=self.zero_variance_tolerance,
        )

    # -- the loss ------------------------------------------------------------------------------

    def count_units(self, batch: Any) -> torch.Tensor:
        """Units of `batch` that the loss averages over; the policy sums this over all ranks."""
        return count_units(
            batch["loss_mask"],
            aggregation=self.resolved_aggregation,
            max_response_tokens=self.max_response_tokens,
        )

    def __call__(
        self, batch: Any, logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss summed over units, metric sums over loss tokens) for one micro-batch.

        Metrics ending in "_max" are maxima over loss tokens, not sums."""
        for key in ("loss_mask", "advantages", *(() if self.is_on_policy else ("old_logprobs",))):
            if key not in batch:
                raise ValueError(
                    f"PolicyLoss: the batch has no {key!r}; set it before train_step (e.g. "
                    "batch.tokens['old_logprobs'] = policy.logprobs(batch), or "
                    "yatt.core.engine_old_logprobs(batch) with old_logprobs_from='engine', or "
                    "PolicyLoss(is_on_policy=True) for one optimizer step per rollout batch)"
                )
        mask_BT = batch["loss_mask"].to(logprobs_BT.dtype)
        is_loss_BT = batch["loss_mask"] > 0
        # Off the loss mask every input is 0 before any arithmetic (see the module docstring).
        logprobs_BT = torch.where(is_loss_BT, logprobs_BT, 0.0)
        old_BT = logprobs_BT.detach() if self.is_on_policy else batch["old_logprobs"]
        old_BT = _on_loss_tokens(old_BT.to(logprobs_BT.dtype), is_loss_BT)
        advantages = batch["advantages"].to(logprobs_BT.dtype)
        advantages_BT = (
            advantages[:, None].expand_as(logprobs_BT) if advantages.dim() == 1 else advantages
        )
        advantages_BT = _on_loss_tokens(advantages_BT, is_loss_BT)
        pg_loss_BT, regions = self._policy_gradient_loss(
            logprobs_BT, old_BT, advantages_BT, mask_BT
        )
        metrics = {
            "clip_frac_low": _masked_sum(regions.low_BT, mask_BT),
            "clip_frac_high": _masked_sum(regions.high_BT, mask_BT),
            "clip_frac_dual": _masked_sum(regions.dual_BT, mask_BT),
        }
        metrics["clip_frac"] = sum(metrics.values())
        if "rollout_logprobs" in batch:
            rollout_BT = _on_loss_tokens(
                batch["rollout_logprobs"].to(logprobs_BT.dtype), is_loss_BT
            )
            gap_BT = (logprobs_BT.detach() - rollout_BT).abs()
            metrics["rollout_mismatch"] = _masked_sum(gap_BT, mask_BT)
            if self.rollout_correction != "none":
                weights_BT, is_capped_BT = compute_rollout_weights(
                    old_BT,
                    rollout_BT,
                    mask_BT,
                    mode=self.rollout_correction,
                    cap=self.rollout_correction_cap,
                )
                weights_BT = weights_BT.to(pg_loss_BT.dtype)
                pg_loss_BT = pg_loss_BT * weights_BT
                metrics["mismatch_kl"] = _masked_sum(
                    compute_mismatch_kl(old_BT, rollout_BT), mask_BT
                )
                metrics["is_weight"] = _masked_sum(weights_BT, mask_BT)
                # Weights are >= 0, so a row of zeros (padding, a dummy) never raises the max.
                metrics["is_weight_max"] = _masked_max(weights_BT, mask_BT)
                metrics["is_capped_frac"] = _masked_sum(is_capped_BT, mask_BT)
        elif self.rollout_correction != "none":
            _NO_ROLLOUT_LOGPROBS.warn(
                "PolicyLoss(rollout_correction=%r): the batch has no 'rollout_logprobs' (the "
                "engine's), so no rollout correction applied; build the batch with "
                "yatt.core.rollout_batch or set rollout_correction='none'",
                self.rollout_correction,
            )
        metrics["pg_loss"] = _masked_sum(pg_loss_BT, mask_BT)
        loss_BT = pg_loss_BT
        if self.kl_coef > 0:
            if "ref_logprobs" not in batch:
                raise ValueError(
                    f"PolicyLoss(kl_coef={self.kl_coef}) needs 'ref_logprobs' in the batch; "
                    "compute them with the reference policy or set kl_coef=0"
                )
            kl_BT = compute_kl(
                logprobs_BT,
                _on_loss_tokens(batch["ref_logprobs"].to(logprobs_BT.dtype), is_loss_BT),
                estimator=self.kl_estimator,
            )
            loss_BT = loss_BT + self.kl_coef * kl_BT
            metrics["kl"] = _masked_sum(kl_BT, mask_BT)
        if self.needs_entropy:
            if entropy_BT is None:
                raise ValueError("PolicyLoss needs entropy_BT; the policy did not compute it")
            entropy_BT = torch.where(is_loss_BT, entropy_BT, 0.0)
            if self.entropy_coef > 0:
                loss_BT = loss_BT - self.entropy_coef * entropy_BT
            metrics["entropy"] = _masked_sum(entropy_BT, mask_BT)
        loss = sum_over_units(
            loss_BT,
            mask_BT,
            aggregation=self.resolved_aggregation,
            max_response_tokens=self.max_response_tokens,
        )
        return loss, metrics

    def _policy_gradient_loss(self, logprobs_BT, old_BT, advantages_BT, mask_BT):
        clip = {"clip_low": self.resolved_clip_low, "clip_high": self.resolved_clip_high}
        if self.objective == "gspo":
            return compute_gspo_policy_loss(logprobs_BT, old_BT, advantages_BT, mask_BT, **clip)
        if self.objective == "gspo_token":
            return compute_gspo_token_policy_loss(
                logprobs_BT, old_BT, advantages_BT, mask_BT, **clip
            )
        if self.objective == "cispo":
            return compute_cispo_policy_loss(logprobs_BT, old_BT, advantages_BT, **clip)
        return compute_clipped_policy_loss(
            logprobs_BT, old_BT, advantages_BT, dual_clip_c=self.dual_clip_c, **clip
        )


def _on_loss_tokens(values_BT: torch.Tensor, is_loss_BT: torch.Tensor) -> torch.Tensor:
    """values on loss tokens, 0 elsewhere (selected: a NaN off the mask is gone)."""
    return torch.where(is_loss_BT, values_BT, 0.0)


def _masked_sum(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Sum of detached values over loss tokens (a metric's numerator)."""
    values_BT = values_BT.detach().to(mask_BT.dtype)
    return (torch.where(mask_BT > 0, values_BT, 0.0) * mask_BT).sum()


def _masked_max(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Max of detached non-negative values over loss tokens (0 without any)."""
    masked_BT = torch.where(mask_BT > 0, values_BT.detach().to(mask_BT.dtype), 0.0) * mask_BT
    return masked_BT.amax() if masked_BT.numel() else masked_BT.sum()


def _check_finite_nonnegative(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"PolicyLoss.{name}={value!r}: must be a finite number >= 0")
    if not (value >= 0.0 and value < float("inf")):
        raise ValueError(f"PolicyLoss.{name}={value!r}: must be a finite number >= 0")
