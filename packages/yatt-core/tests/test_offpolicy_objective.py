"""PolicyLoss off-policy against an independent statement of AReaL's decoupled PPO objective,
and the per-step staleness metrics (tokens by age, IS weights by age).

Decoupled PPO (Fu et al., "AReaL", arXiv:2505.24298, eq. 5), three policies: the behaviour
policy that sampled the tokens (the engine, possibly several versions old: "rollout_logprobs"),
the proximal policy (the trainer's weights before this update: "old_logprobs"), and pi_theta
being trained. Per token, written out by hand below:

    r = pi_theta / pi_prox,   w = pi_prox / pi_behav
    loss_t = -w * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    (with dual clip c for A < 0: max(loss, -c A) before the weight; AReaL's c_clip)
AReaL drops a token whose w exceeds behav_imp_weight_cap (our "token_mask"); yatt's default
truncates it to the cap instead ("token_truncate", TIS). Both are checked; gradients too.
"""

NUM_GPUS = 0

import math

import pytest
import torch

from yatt.core import Batch, PolicyLoss, compute_staleness_metrics, rollout_batch, rollout_samples

# (log r, log w, A) per loss token: ratios inside and outside both clip sides, weights below 1,
# between 1 and the cap (2) and above it, advantages of both signs.
ROW0 = [
    (math.log(0.7), math.log(0.5), 1.0),
    (math.log(1.4), math.log(1.8), 1.0),
    (math.log(1.1), math.log(3.0), -0.5),
    (math.log(0.7), 0.0, -0.5),
]
ROW1 = [(math.log(1.25), math.log(2.5), 2.0), (math.log(4.0), math.log(1.2), -1.5)]
MAX_RESPONSE_TOKENS = 6
CAP = 2.0


def _expected_token(log_r, log_w, adv, *, low, high, dual, mode):
    r, w = math.exp(log_r), math.exp(log_w)
    if mode == "token_truncate":
        w = min(w, CAP)
    elif w > CAP:  # AReaL's behav_imp_weight_cap: the token is dropped
        w = 0.0
    clipped = min(max(r, 1 - low), 1 + high)
    loss = -min(r * adv, clipped * adv)
    grad = -r * adv if r * adv <= clipped * adv else 0.0  # d/d log pi_theta
    if dual is not None and adv < 0 and loss > -dual * adv:
        loss, grad = -dual * adv, 0.0
    return w * loss, w * grad


def _batch(prox_logprobs=-1.0):
    rows = []
    for row in (ROW0, ROW1):
        n = len(row)
        rows.append(
            {
                "input_ids": [1, *range(2, 2 + n)],
                "loss_mask": [0] + [1] * n,
                "old_logprobs": [0.0] + [prox_logprobs] * n,
                "rollout_logprobs": [0.0] + [prox_logprobs - lw for _, lw, _ in row],
                "advantages": [0.0] + [a for _, _, a in row],
            }
        )
    batch = Batch.from_samples(
        rows, token_keys=("loss_mask", "old_logprobs", "rollout_logprobs", "advantages")
    )
    log_r = torch.zeros_like(batch["old_logprobs"], dtype=torch.float64)
    for b, row in enumerate((ROW0, ROW1)):
        for t, (lr, _, _) in enumerate(row):
            log_r[b, t + 1] = lr
    logprobs = (batch["old_logprobs"].double() + log_r).requires_grad_(True)
    return batch, logprobs


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
@pytest.mark.parametrize(
    ("objective", "dual"),
    [
        pytest.param("grpo", None, id="grpo"),
        pytest.param("grpo", 3.0, id="grpo-dual-clip"),
        pytest.param("dr_grpo", None, id="dr_grpo"),
        pytest.param("dapo", None, id="dapo"),
    ],
)
def test_policy_loss_is_decoupled_ppo(objective, dual, mode):
    loss_fn = PolicyLoss(
        objective=objective,
        dual_clip_c=dual,
        rollout_correction=mode,
        rollout_correction_cap=CAP,
        max_response_tokens=MAX_RESPONSE_TOKENS,
        num_mini_batches=2,
    )
    low, high = loss_fn.resolved_clip_low, loss_fn.resolved_clip_high
    batch, logprobs = _batch()
    loss_sum, _ = loss_fn(batch, logprobs)
    loss = loss_sum / loss_fn.count_units(batch).to(loss_sum.dtype)
    loss.backward()
    per_row = [
        [_expected_token(*tok, low=low, high=high, dual=dual, mode=mode) for tok in row]
        for row in (ROW0, ROW1)
    ]
    # The aggregation, by hand: DAPO a token mean, GRPO a mean of per-sequence means, Dr. GRPO
    # a sum over a constant (sequences x max_response_tokens).
    aggregation = loss_fn.resolved_aggregation
    num_tokens = sum(len(r) for r in per_row)
    scale = {
        "token_mean": [1 / num_tokens] * 2,
        "seq_mean_token_mean": [1 / (2 * len(r)) for r in per_row],
        "seq_mean_token_sum_norm": [1 / (2 * MAX_RESPONSE_TOKENS)] * 2,
    }[aggregation]
    expected = sum(s * sum(value for value, _ in r) for s, r in zip(scale, per_row, strict=True))
    assert loss.item() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    for b, row in enumerate(per_row):
        got = logprobs.grad[b, 1 : 1 + len(row)].tolist()
        want = [scale[b] * g for _, g in row]
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7), f"row {b}"
        assert logprobs.grad[b, 0].item() == 0.0  # the prompt takes no gradient


def test_the_weight_uses_the_proximal_policy_not_the_current_one():
    # A planted swap (w = pi_theta / pi_behav) changes the loss whenever r != 1.
    loss_fn = PolicyLoss(objective="dapo", num_mini_batches=2)
    batch, logprobs = _batch()
    _, metrics = loss_fn(batch, logprobs)
    weights = [min(math.exp(lw), CAP) for row in (ROW0, ROW1) for _, lw, _ in row]
    assert metrics["is_weight"].item() == pytest.approx(sum(weights), rel=1e-6)


# -- staleness metrics -------------------------------------------------------------------------


class _Completion:
    def __init__(self, n, behav):
        self.prompt_ids, self.response_ids = [1, 2], list(range(3, 3 + n))
        self.logprobs = [behav] * n


def test_staleness_metrics_count_tokens_and_weights_by_age():
    current, bound = 5, 2
    # Token versions 5 (age 0), 4 (age 1), 3 (age 2); one sample spans two versions.
    completions = [_Completion(3, -1.0), _Completion(2, -2.0), _Completion(4, -1.5)]
    versions = [5, [3, 4], [3, 3, 4, 5]]
    batch = rollout_batch(
        rollout_samples(completions, [1.0, 0.0, 1.0], [0, 0, 0], policy_versions=versions)
    )
    # pi_prox = -1.2 everywhere: w = exp(-1.2 - behav) -> 0.819 (behav -1), 2.226 -> cap 2
    # (behav -2; capped), 1.350 (behav -1.5).
    batch.tokens["old_logprobs"] = torch.where(batch["loss_mask"] > 0, -1.2, 0.0)
    metrics = compute_staleness_metrics(batch, current_version=current, max_staleness=bound)
    w_a, w_b, w_c = math.exp(0.2 - 0.0) ** -1, CAP, math.exp(0.3)
    # Ages: sample 0 -> 0,0,0 (w_a); sample 1 -> 2,1 (w_b); sample 2 -> 2,2,1,0 (w_c).
    assert metrics["offpolicy/tokens_age_0"] == 4
    assert metrics["offpolicy/tokens_age_1"] == 2
    assert metrics["offpolicy/tokens_age_2"] == 3
    assert metrics["offpolicy/tokens_over_bound"] == 0
    assert metrics["offpolicy/age_mean"] == pytest.approx((0 * 4 + 1 * 2 + 2 * 3) / 9)
    assert metrics["offpolicy/is_weight_mean_age_0"] == pytest.approx((3 * w_a + w_c) / 4, 1e-6)
    assert metrics["offpolicy/is_weight_mean_age_1"] == pytest.approx((w_b + w_c) / 2, 1e-6)
    assert metrics["offpolicy/is_weight_mean_age_2"] == pytest.approx((w_b + 2 * w_c) / 3, 1e-6)
    assert metrics["offpolicy/is_weight_max_age_1"] == pytest.approx(CAP)
    assert metrics["offpolicy/is_capped_frac_age_1"] == pytest.approx(0.5)
    assert metrics["offpolicy/is_capped_frac_age_0"] == 0.0


def test_tokens_older_than_the_bound_are_counted_and_a_future_version_is_refused():
    batch = rollout_batch(
        rollout_samples([_Completion(2, -1.0)], [1.0], [0], policy_versions=[[1, 2]])
    )
    metrics = compute_staleness_metrics(batch, current_version=4, max_staleness=2)
    assert metrics["offpolicy/tokens_over_bound"] == 1  # age 3
    assert metrics["offpolicy/tokens_age_2"] == 1
    assert metrics["offpolicy/is_weight_mean_age_2"] == 1.0  # no old_logprobs: weight 1
    with pytest.raises(ValueError, match="current_version=1"):
        compute_staleness_metrics(batch, current_version=1, max_staleness=2)
