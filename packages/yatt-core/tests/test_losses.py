"""RL losses against closed forms on tiny tensors, and where their gradients flow."""

import dataclasses
import math

import pytest
import torch

from yatt.core import (
    Batch,
    PolicyLoss,
    aggregate,
    compute_clipped_policy_loss,
    compute_kl,
    count_units,
    sum_over_units,
)
from yatt.core.rl._losses import AGGREGATIONS

NUM_GPUS = 0


def _clip_case(ratio: float, adv: float, low: float, high: float) -> float:
    # PPO eq. 7 written out by hand: -min(r A, clip(r) A).
    clipped = min(max(ratio, 1 - low), 1 + high)
    return -min(ratio * adv, clipped * adv)


@pytest.mark.parametrize(
    ("ratio", "adv", "low", "high", "region"),
    [
        pytest.param(1.0, 1.0, 0.2, 0.2, None, id="on-policy"),
        pytest.param(1.5, 1.0, 0.2, 0.2, "high", id="pos-adv-above-clip"),
        pytest.param(1.5, 1.0, 0.2, 0.28, "high", id="pos-adv-clip-higher"),
        pytest.param(1.25, 1.0, 0.2, 0.28, None, id="clip-higher-lets-1.25-through"),
        pytest.param(0.5, 1.0, 0.2, 0.2, None, id="pos-adv-below-range-unclipped"),
        pytest.param(0.5, -1.0, 0.2, 0.2, "low", id="neg-adv-below-clip"),
        pytest.param(1.5, -2.0, 0.2, 0.2, None, id="neg-adv-above-range-unclipped"),
    ],
)
def test_clipped_loss_matches_closed_form(ratio, adv, low, high, region):
    old = torch.tensor([[-1.0]])
    new = (old + math.log(ratio)).requires_grad_(True)
    loss, regions = compute_clipped_policy_loss(
        new, old, torch.tensor([[adv]]), clip_low=low, clip_high=high
    )
    assert loss.item() == pytest.approx(_clip_case(ratio, adv, low, high), rel=1e-6)
    assert bool(regions.low_BT) is (region == "low")
    assert bool(regions.high_BT) is (region == "high")
    assert not bool(regions.dual_BT)
    loss.sum().backward()
    # A clipped token gets no gradient; an unclipped one gets d(-r A)/d logp = -r A.
    expected_grad = 0.0 if region else -ratio * adv
    assert new.grad.item() == pytest.approx(expected_grad, rel=1e-6, abs=1e-9)


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), math.log(10.0), requires_grad=True)
    loss, regions = compute_clipped_policy_loss(
        new, old, torch.tensor([[-1.0]]), clip_low=0.2, clip_high=0.2, dual_clip_c=3.0
    )
    assert loss.item() == pytest.approx(3.0)  # min(10, 3) * |A|
    assert bool(regions.dual_BT) and not bool(regions.low_BT | regions.high_BT)
    loss.sum().backward()
    assert new.grad.item() == 0.0


def test_gradient_does_not_flow_into_old_logprobs_or_advantages():
    # new within 0.01 of old: every ratio inside the clip range, so new's gradient is nonzero
    # whatever ran before (independent draws were all clipped under another test order).
    g = torch.Generator().manual_seed(0)
    old = torch.randn(2, 3, generator=g).requires_grad_()
    new = (old.detach() + 0.01 * torch.randn(2, 3, generator=g)).requires_grad_()
    adv = torch.randn(2, 3, generator=g).requires_grad_()
    loss, _ = compute_clipped_policy_loss(new, old, adv)
    loss.sum().backward()
    assert old.grad is None and adv.grad is None
    assert new.grad is not None and new.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("estimator", "closed_form"),
    [
        pytest.param("k1", lambda lr: -lr, id="k1"),
        pytest.param("k2", lambda lr: 0.5 * lr**2, id="k2"),
        pytest.param("k3", lambda lr: math.exp(lr) - 1 - lr, id="k3"),
    ],
)
def test_kl_estimators_match_schulman(estimator, closed_form):
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    kl = compute_kl(logp, ref, estimator=estimator)
    log_r = (ref - logp).detach()[0].tolist()
    assert kl[0].tolist() == pytest.approx([closed_form(x) for x in log_r], rel=1e-6, abs=1e-7)
    kl.sum().backward()
    assert logp.grad is not None


def test_k3_is_clamped_as_verl_low_var_kl():
    # log r = 15: exp(15) - 1 - 15 = 3.3e6 unclamped; verl clamps the estimate to 10.
    kl = compute_kl(torch.tensor([[-16.0, -1.0]]), torch.tensor([[-1.0, -1.0]]), estimator="k3")
    assert kl[0].tolist() == pytest.approx([10.0, 0.0])


def test_k3_gradient_is_the_forward_kl_gradient():
    # d k3 / d logit, averaged exactly over x ~ p, equals d KL(q || p) / d logit: the gradient
    # the docstring states (and not that of KL(p || q), the value it estimates).
    logits = torch.tensor([0.3, -0.2, 1.0, 0.1], requires_grad=True)
    q = torch.softmax(torch.tensor([0.0, 0.5, -0.5, 0.2]), 0)
    logp = torch.log_softmax(logits, 0)
    k3 = compute_kl(logp[None], q.log()[None], estimator="k3")[0]
    p_fixed = logp.exp().detach()
    (p_fixed * k3).sum().backward()
    grad_k3 = logits.grad.clone()
    logits.grad = None
    forward_kl = (q * (q.log() - torch.log_softmax(logits, 0))).sum()
    forward_kl.backward()
    assert grad_k3.tolist() == pytest.approx(logits.grad.tolist(), abs=1e-6)


def test_k3_is_unbiased_for_true_kl():
    # E_{x~p}[k3] = KL(p || q) for categorical p, q (close enough that the clamp at 10 is idle).
    torch.manual_seed(0)
    p = torch.softmax(0.5 * torch.randn(5), 0)
    q = torch.softmax(0.5 * torch.randn(5), 0)
    true_kl = float((p * (p.log() - q.log())).sum())
    x = torch.multinomial(p, 200_000, replacement=True)
    k3 = compute_kl(p.log()[x][None], q.log()[x][None], estimator="k3")
    assert float(k3.max()) < 10.0
    assert float(k3.mean()) == pytest.approx(true_kl, rel=0.05)
    assert float(k3.min()) >= 0.0


def test_unknown_kl_estimator_raises():
    with pytest.raises(ValueError, match="estimator"):
        compute_kl(torch.zeros(1, 1), torch.zeros(1, 1), estimator="k4")


VALUES = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # row 2: no loss token


@pytest.mark.parametrize(
    ("aggregation", "total", "units"),
    [
        pytest.param("token_mean", 1 + 2 + 3 + 4, 4, id="token-mean"),
        pytest.param("seq_mean_token_mean", 2.0 + 4.0, 2, id="seq-mean-token-mean"),
        # Dr. GRPO: token sums over (sequences with a response x the constant L = 10).
        pytest.param("seq_mean_token_sum_norm", 1 + 2 + 3 + 4, 2 * 10, id="seq-sum-norm"),
    ],
)
def test_aggregation_leaves_empty_rows_out(aggregation, total, units):
    kwargs = {"aggregation": aggregation, "max_response_tokens": 10}
    assert sum_over_units(VALUES, MASK, **kwargs).item() == pytest.approx(total)
    assert count_units(MASK, **kwargs).item() == units
    assert aggregate(VALUES, MASK, **kwargs).item() == pytest.approx(total / units)
    # An empty row adds neither value nor unit, whatever it holds.
    changed = VALUES.clone()
    changed[2] = 1e6
    assert sum_over_units(changed, MASK, **kwargs).item() == pytest.approx(total)
    everything_empty = torch.zeros_like(MASK)
    assert sum_over_units(VALUES, everything_empty, **kwargs).item() == 0.0
    assert count_units(everything_empty, **kwargs).item() == 0


def test_sum_norm_aggregation_needs_its_constant():
    with pytest.raises(ValueError, match="max_response_tokens"):
        count_units(MASK, aggregation="seq_mean_token_sum_norm")


def test_split_sums_equal_full_batch_mean():
    # What makes gradient accumulation exact: sum of per-part sums / global units.
    torch.manual_seed(1)
    values = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).long()
    mask[:, 0] = 1
    for agg in AGGREGATIONS:
        kwargs = {"aggregation": agg, "max_response_tokens": 7}
        parts = [slice(0, 1), slice(1, 4), slice(4, 6)]
        total = sum(sum_over_units(values[s], mask[s], **kwargs) for s in parts)
        units = sum(count_units(mask[s], **kwargs) for s in parts)
        assert (total / units).item() == pytest.approx(aggregate(values, mask, **kwargs).item())


def _loss_batch(advantages):
    rows = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "adv": 0.0},
        {"input_ids": [5, 8], "loss_mask": [0, 1], "adv": 0.0},
    ]
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.samples["advantages"] = torch.tensor(advantages)
    batch.tokens["old_logprobs"] = torch.full((2, 3), -1.0)
    batch.tokens["ref_logprobs"] = torch.full((2, 3), -1.2)
    return batch


def test_policy_loss_on_policy_equals_minus_mean_advantage():
    batch = _loss_batch([1.0, -3.0])
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)
    loss_fn = PolicyLoss(aggregation="token_mean")
    loss_sum, metrics = loss_fn(batch, logprobs)
    units = loss_fn.count_units(batch)
    # ratio 1: per-token loss -A; tokens: two of sample 0, one of sample 1.
    assert (loss_sum / units).item() == pytest.approx((-1 - 1 + 3) / 3)
    assert metrics["clip_frac"].item() == 0.0
    loss_sum.backward()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[1, 2] == 0  # prompt and padding: no grad


def test_policy_loss_kl_and_entropy_terms():
    batch = _loss_batch([0.0, 0.0])
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)
    entropy = torch.full((2, 3), 2.0, requires_grad=True)
    loss_fn = PolicyLoss(kl_coef=0.5, entropy_coef=0.1)
    loss_sum, metrics = loss_fn(batch, logprobs, entropy)
    k3 = math.exp(-0.2) - 1 + 0.2
    units = loss_fn.count_units(batch)  # grpo: two sequences
    assert units.item() == 2
    assert (loss_sum / units).item() == pytest.approx(0.5 * k3 - 0.1 * 2.0, rel=1e-5)
    assert metrics["kl"].item() == pytest.approx(3 * k3, rel=1e-5)
    loss_sum.backward()
    # seq_mean_token_mean: sample 0's two tokens share its 1/2.
    assert entropy.grad[0, 1].item() == pytest.approx(-0.1 / 2)


@pytest.mark.parametrize(
    ("objective", "clip_low", "clip_high", "aggregation", "should_std_normalize"),
    [
        pytest.param("grpo", 0.2, 0.2, "seq_mean_token_mean", True, id="grpo"),
        pytest.param("dr_grpo", 0.2, 0.2, "seq_mean_token_sum_norm", False, id="dr_grpo"),
        pytest.param("dapo", 0.2, 0.28, "token_mean", True, id="dapo"),
        pytest.param("gspo", 3e-4, 4e-4, "seq_mean_token_mean", True, id="gspo"),
        pytest.param("cispo", 1.0, 0.28, "token_mean", True, id="cispo"),
    ],
)
def test_each_objective_takes_its_papers_settings(
    objective, clip_low, clip_high, aggregation, should_std_normalize
):
    loss = PolicyLoss(objective=objective, max_response_tokens=8)
    assert (loss.resolved_clip_low, loss.resolved_clip_high) == (clip_low, clip_high)
    assert loss.resolved_aggregation == aggregation
    assert loss.resolved_should_std_normalize is should_std_normalize
    # A field set by the user wins; replace() re-resolves from the fields.
    assert PolicyLoss(objective=objective, clip_high=0.5).resolved_clip_high == 0.5
    switched = dataclasses.replace(PolicyLoss(objective="dapo"), objective=objective)
    assert switched.resolved_clip_high == clip_high


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"clip_high": -0.1}, "clip_high", id="negative-clip"),
        pytest.param({"dual_clip_c": 0.5}, "dual_clip_c", id="dual-clip-below-1"),
        pytest.param({"kl_estimator": "k9"}, "kl_estimator", id="bad-estimator"),
        pytest.param({"aggregation": "sum"}, "aggregation", id="bad-aggregation"),
        pytest.param({"kl_coef": float("nan")}, "kl_coef", id="nan-coef"),
        pytest.param({"objective": "ppo2"}, "objective", id="unknown-objective"),
        pytest.param(
            {"objective": "gspo", "aggregation": "token_mean"}, "aggregation", id="gspo-tokens"
        ),
        pytest.param(
            {"objective": "cispo", "dual_clip_c": 3.0}, "dual_clip_c", id="cispo-dual-clip"
        ),
        pytest.param({"rollout_correction_cap": 1.0}, "rollout_correction_cap", id="cap-1"),
        pytest.param({"rollout_correction_cap": 0.5}, "rollout_correction_cap", id="cap-0.5"),
        pytest.param({"rollout_correction": "token"}, "rollout_correction", id="bad-mode"),
        pytest.param({"num_mini_batches": 0}, "num_mini_batches", id="no-mini-batches"),
        pytest.param({"num_epochs": 1.5}, "num_epochs", id="fractional-epochs"),
        pytest.param(
            {"should_reshuffle_epochs": "yes"}, "should_reshuffle_epochs", id="reshuffle-str"
        ),
        pytest.param(
            {"is_on_policy": True, "num_mini_batches": 2}, "is_on_policy", id="on-policy-2-steps"
        ),
        pytest.param({"advantage_eps": -1e-4}, "advantage_eps", id="negative-eps"),
        pytest.param({"max_response_tokens": 0}, "max_response_tokens", id="zero-length"),
    ],
)
def test_policy_loss_rejects_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=f"PolicyLoss.{match}"):
        PolicyLoss(**kwargs)


def test_check_rollout_names_the_field_to_fix():
    PolicyLoss(num_mini_batches=4).check_rollout(prompts_per_rank=8, max_new_tokens=16)
    with pytest.raises(ValueError, match="num_mini_batches=3 does not divide"):
        PolicyLoss(num_mini_batches=3).check_rollout(prompts_per_rank=8, max_new_tokens=16)
    with pytest.raises(ValueError, match="max_response_tokens is None"):
        PolicyLoss(objective="dr_grpo").check_rollout(prompts_per_rank=8, max_new_tokens=16)
    with pytest.raises(ValueError, match="max_response_tokens=8 is below"):
        PolicyLoss(objective="dr_grpo", max_response_tokens=8).check_rollout(
            prompts_per_rank=8, max_new_tokens=16
        )


def test_policy_loss_reports_the_rollout_mismatch_on_loss_tokens():
    batch = _loss_batch([1.0, -3.0])
    logprobs = torch.full((2, 3), -1.0)
    _, metrics = PolicyLoss()(batch, logprobs)
    assert "rollout_mismatch" not in metrics  # no engine logprobs, no metric
    # Gaps: 0.5 and 0.25 on sample 0's loss tokens, 2.0 on sample 1's; the prompt position and
    # the padding (huge gaps) are not loss tokens.
    batch.tokens["rollout_logprobs"] = torch.tensor([[9.0, -1.5, -0.75], [9.0, 1.0, 9.0]])
    _, metrics = PolicyLoss()(batch, logprobs)
    assert metrics["rollout_mismatch"].item() == pytest.approx(2.75)


def test_policy_loss_names_missing_fields():
    batch = _loss_batch([1.0, 1.0])
    del batch.tokens["old_logprobs"]
    with pytest.raises(ValueError, match="old_logprobs"):
        PolicyLoss()(batch, torch.zeros(2, 3))
    batch = _loss_batch([1.0, 1.0])
    del batch.tokens["ref_logprobs"]
    with pytest.raises(ValueError, match="ref_logprobs"):
        PolicyLoss(kl_coef=0.1)(batch, torch.zeros(2, 3))
