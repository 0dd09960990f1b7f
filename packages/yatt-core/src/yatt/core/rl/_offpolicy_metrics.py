"""Per-step metrics of an off-policy batch: tokens by age and the importance weights by age.

Shape legend (suffixes on tensor names):
    B  samples
    T  token positions, aligned with input_ids (see yatt.core.rl._losses)

A token's age is the trainer's current version minus the version of the weights that sampled
it ("policy_version", yatt.core.rl._rollout_samples). With a staleness bound s every loss token
has age 0..s, except in a group that finished after its turn came: admission control
(yatt.core.rl._staleness) bounds the version a prompt STARTS under, and a slow group is
trained late rather than dropped; its tokens older than s count under
"offpolicy/tokens_over_bound" (how much the slow tail costs in staleness).

The importance weight is the decoupled objective's pi_prox / pi_behaviour (AReaL, Fu et al.
2025, arXiv:2505.24298, eq. 5): "old_logprobs" (the trainer's logprobs before the update) over
"rollout_logprobs" (the engine's, the behaviour policy), computed by the same
compute_rollout_weights as the loss, so the metric shows the weight the loss applied. Older
tokens should carry weights further from 1; a mean drifting with age is the signal to lower s.

    offpolicy/tokens_age_{a}          loss tokens sampled a versions ago (a = 0..s)
    offpolicy/tokens_over_bound       loss tokens older than s (slow groups trained late)
    offpolicy/age_mean                mean age of the loss tokens
    offpolicy/is_weight_mean_age_{a}  mean weight of those tokens (0 without any)
    offpolicy/is_weight_max_age_{a}   max weight of those tokens
    offpolicy/is_capped_frac_age_{a}  share of those tokens whose weight the cap acted on
Every key is present for every a in 0..s on every rank (reduce_metrics needs one key set).
"""

from __future__ import annotations

from typing import Any

import torch

from yatt.core.rl._rollout_correction import RolloutCorrection, compute_rollout_weights
from yatt.core.rl._rollout_samples import POLICY_VERSION_KEY
from yatt.core.runtime._metrics import reduce_metrics

_PREFIX = "offpolicy/"


def compute_staleness_metrics(
    batch: Any,
    *,
    current_version: int,
    max_staleness: int,
    rollout_correction: RolloutCorrection = "token_truncate",
    rollout_correction_cap: float = 2.0,
    group: Any = None,
) -> dict[str, float]:
    """The metrics in the module docstring for this step's batch, summed over the ranks of
    `group` when torch.distributed is initialised (collective: every rank calls it).

    The weights need "old_logprobs" and "rollout_logprobs" in the batch; without either the
    weight keys read 1 (no correction can be applied). Pass the loss's rollout_correction
    and cap so the metric is the weight the loss used."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness!r}: must be an int >= 0")
    is_loss_BT = batch["loss_mask"] > 0
    versions_BT = batch[POLICY_VERSION_KEY]
    age_BT = torch.where(is_loss_BT, int(current_version) - versions_BT.to(torch.int64), 0)
    if bool((age_BT < 0).any()):
        raise ValueError(
            f"a token carries policy_version > current_version={current_version}: the trainer "
            "must pass its own version (the number of optimizer updates applied to the weights)"
        )
    has_weights = "old_logprobs" in batch and "rollout_logprobs" in batch
    if has_weights:
        weights_BT, is_capped_BT = compute_rollout_weights(
            batch["old_logprobs"],
            batch["rollout_logprobs"],
            batch["loss_mask"],
            mode=rollout_correction,
            cap=rollout_correction_cap,
        )
    else:
        weights_BT = is_loss_BT.to(torch.float32)
        is_capped_BT = torch.zeros_like(is_loss_BT)
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    for age in range(max_staleness + 1):
        at_age_BT = is_loss_BT & (age_BT == age)
        sums[f"tokens_age_{age}"] = float(at_age_BT.sum())
        sums[f"is_weight_sum_age_{age}"] = float(weights_BT[at_age_BT].double().sum())
        sums[f"is_capped_age_{age}"] = float((is_capped_BT & at_age_BT).sum())
        maxima[f"is_weight_max_age_{age}"] = (
            float(weights_BT[at_age_BT].max()) if bool(at_age_BT.any()) else 0.0
        )
    sums["tokens_over_bound"] = float((is_loss_BT & (age_BT > max_staleness)).sum())
    sums["age_sum"] = float(age_BT[is_loss_BT].double().sum())
    sums["num_tokens"] = float(is_loss_BT.sum())
    ops = {**dict.fromkeys(sums, "sum"), **dict.fromkeys(maxima, "max")}
    totals = reduce_metrics({**sums, **maxima}, group=group, ops=ops)
    out = {_PREFIX + "tokens_over_bound": totals["tokens_over_bound"]}
    out[_PREFIX + "age_mean"] = totals["age_sum"] / max(totals["num_tokens"], 1.0)
    for age in range(max_staleness + 1):
        num_tokens = totals[f"tokens_age_{age}"]
        out[f"{_PREFIX}tokens_age_{age}"] = num_tokens
        out[f"{_PREFIX}is_weight_mean_age_{age}"] = totals[f"is_weight_sum_age_{age}"] / max(
            num_tokens, 1.0
        )
        out[f"{_PREFIX}is_weight_max_age_{age}"] = totals[f"is_weight_max_age_{age}"]
        out[f"{_PREFIX}is_capped_frac_age_{age}"] = totals[f"is_capped_age_{age}"] / max(
            num_tokens, 1.0
        )
    return out
