"""RL losses against closed forms on tiny tensors, and where their gradients flow."""

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

NUM_GPUS = 0


def _clip_case(ratio: float, adv: float, low: float, high: float) -> float:
    # PPO eq. 7 written out by hand: -min(r A, clip(r) A).
    clipped = min(max(ratio, 1 - low), 1 + high)
    return -min(ratio * adv, clipped * adv)


@pytest.mark.parametrize(
    ("ratio", "adv", "low", "high", "is_clipped"),
    [
        pytest.param(1.0, 1.0, 0.2, 0.2, False, id="on-policy"),
        pytest.param(1.5, 1.0, 0.2, 0.2, True, id="pos-adv-above-clip"),
        pytest.param(1.5, 1.0, 0.2, 0.28, True, id="pos-adv-clip-higher"),
        pytest.param(1.25, 1.0, 0.2, 0.28, False, id="clip-higher-lets-1.25-through"),
        pytest.param(0.5, 1.0, 0.2, 0.2, False, id="pos-adv-below-range-unclipped"),
        pytest.param(0.5, -1.0, 0.2, 0.2, True, id="neg-adv-below-clip"),
        pytest.param(1.5, -2.0, 0.2, 0.2, False, id="neg-adv-above-range-unclipped"),
    ],
)
def test_clipped_loss_matches_closed_form(ratio, adv, low, high, is_clipped):
    old = torch.tensor([[-1.0]])
    new = (old + math.log(ratio)).requires_grad_(True)
    loss, clipped = compute_clipped_policy_loss(
        new, old, torch.tensor([[adv]]), clip_low=low, clip_high=high
    )
    assert loss.item() == pytest.approx(_clip_case(ratio, adv, low, high), rel=1e-6)
    assert bool(clipped) is is_clipped
    loss.sum().backward()
    # A clipped token gets no gradient; an unclipped one gets d(-r A)/d logp = -r A.
    expected_grad = 0.0 if is_clipped else -ratio * adv
    assert new.grad.item() == pytest.approx(expected_grad, rel=1e-6, abs=1e-9)


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), math.log(10.0), requires_grad=True)
    loss, clipped = compute_clipped_policy_loss(
        new, old, torch.tensor([[-1.0]]), clip_low=0.2, clip_high=0.2, dual_clip_c=3.0
    )
    assert loss.item() == pytest.approx(3.0)  # min(10, 3) * |A|
    assert bool(clipped)
    loss.sum().backward()
    assert new.grad.item() == 0.0


def test_gradient_does_not_flow_into_old_logprobs_or_advantages():
    new = torch.randn(2, 3, requires_grad=True)
    old = torch.randn(2, 3, requires_grad=True)
    adv = torch.randn(2, 3, requires_grad=True)
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


def test_k3_is_unbiased_for_true_kl():
    # E_{x~p}[k3] = KL(p || q) for categorical p, q.
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(5), 0)
    q = torch.softmax(torch.randn(5), 0)
    true_kl = float((p * (p.log() - q.log())).sum())
    x = torch.multinomial(p, 200_000, replacement=True)
    k3 = compute_kl(p.log()[x][None], q.log()[x][None], estimator="k3")
    assert float(k3.mean()) == pytest.approx(true_kl, rel=0.05)
    assert float(k3.min()) >= 0.0


def test_unknown_kl_estimator_raises():
    with pytest.raises(ValueError, match="estimator"):
        compute_kl(torch.zeros(1, 1), torch.zeros(1, 1), estimator="k4")


VALUES = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    ("aggregation", "total", "units"),
    [
        pytest.param("token_mean", 1 + 2 + 3 + 4, 4, id="token-mean"),
        pytest.param("seq_mean_token_mean", 2.0 + 4.0, 2, id="seq-mean-token-mean"),
    ],
)
def test_aggregation(aggregation, total, units):
    assert sum_over_units(VALUES, MASK, aggregation=aggregation).item() == pytest.approx(total)
    assert count_units(MASK, aggregation=aggregation).item() == units
    assert aggregate(VALUES, MASK, aggregation=aggregation).item() == pytest.approx(total / units)


def test_split_sums_equal_full_batch_mean():
    # What makes gradient accumulation exact: sum of per-part sums / global units.
    torch.manual_seed(1)
    values = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).long()
    mask[:, 0] = 1
    for agg in ("token_mean", "seq_mean_token_mean"):
        parts = [slice(0, 1), slice(1, 4), slice(4, 6)]
        total = sum(sum_over_units(values[s], mask[s], aggregation=agg) for s in parts)
        units = sum(count_units(mask[s], aggregation=agg) for s in parts)
        assert (total / units).item() == pytest.approx(
            aggregate(values, mask, aggregation=agg).item()
        )


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
    assert (loss_sum / 3).item() == pytest.approx(0.5 * k3 - 0.1 * 2.0, rel=1e-5)
    assert metrics["kl"].item() == pytest.approx(3 * k3, rel=1e-5)
    loss_sum.backward()
    assert entropy.grad[0, 1].item() == pytest.approx(-0.1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"clip_low": 1.0}, "clip_low", id="clip-low-1"),
        pytest.param({"clip_high": -0.1}, "clip_high", id="negative-clip"),
        pytest.param({"dual_clip_c": 0.5}, "dual_clip_c", id="dual-clip-below-1"),
        pytest.param({"kl_estimator": "k9"}, "kl_estimator", id="bad-estimator"),
        pytest.param({"aggregation": "sum"}, "aggregation", id="bad-aggregation"),
        pytest.param({"kl_coef": float("nan")}, "kl_coef", id="nan-coef"),
    ],
)
def test_policy_loss_rejects_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLoss(**kwargs)


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
