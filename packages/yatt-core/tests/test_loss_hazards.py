"""Inputs that must not reach the gradient: an extreme ratio (an engine logprob of -inf used as
pi_old) is cut by GSPO-token as by GSPO, the PPO objectives and verl's clamp; a NaN or -inf at
a position off the loss mask leaves the loss and gradient exactly as without it (verl masks by
selection); advantage_eps is bounded away from 0. And the documented gspo / gspo_token
difference under a token-level rollout correction, from its closed form."""

NUM_GPUS = 0

import pytest
import torch

from yatt.core import OBJECTIVES, Batch, PolicyLoss, compute_grpo_advantages, sum_over_units

MASK = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]])


def _batch(old_BT, advantages, **tokens) -> Batch:
    rows = [
        {"input_ids": list(range(5)), "loss_mask": MASK[i].tolist(), "advantages": a}
        for i, a in enumerate(advantages)
    ]
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.tokens["old_logprobs"] = old_BT
    for key, value in tokens.items():
        batch.tokens[key] = value
    return batch


def _loss_and_grad(loss_fn, batch, logprobs_BT):
    logprobs_BT = logprobs_BT.clone().requires_grad_(True)
    loss_sum, metrics = loss_fn(batch, logprobs_BT)
    (loss_sum / loss_fn.count_units(batch)).backward()
    return loss_sum.detach(), logprobs_BT.grad, metrics


LOGPROBS = torch.tensor([[-9.0, -0.5, -1.0, -0.7, -9.0], [-9.0, -0.4, -0.9, -9.0, -9.0]])


@pytest.mark.parametrize("objective", ["gspo", "gspo_token", "grpo", "dapo"])
def test_an_extreme_ratio_cuts_the_gradient(objective):
    """An engine logprob of -inf on a loss token of row 0 (pi_old = the engine's): the ratio
    is beyond any clamp. verl (a clamp of the log ratio, torch.clamp's zero gradient outside
    its range) and GSPO give row 0 no gradient; GSPO-token used to give it e^20 = 4.85e8."""
    old_BT = LOGPROBS.clone()
    old_BT[0, 2] = -torch.inf
    old_BT[1] = LOGPROBS[1] - 0.01  # row 1 in range: its gradient stays
    batch = _batch(old_BT, [-1.0, -1.0])  # A < 0: the unclipped term wins on the high side
    loss_fn = PolicyLoss(objective=objective, rollout_correction="none", clip_high=10.0)
    loss, grad, _ = _loss_and_grad(loss_fn, batch, LOGPROBS)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    if objective.startswith("gspo"):
        assert grad[0].abs().max() == 0  # the whole sequence: its ratio is the sequence's
    else:
        assert grad[0, 2] == 0  # the token whose ratio is extreme
    assert grad[1].abs().sum() > 0


def _with_poison(values_BT, value):
    poisoned = values_BT.clone()
    poisoned[MASK == 0] = value
    return poisoned


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("poison", [float("nan"), -float("inf")])
def test_nan_or_inf_off_the_loss_mask_changes_nothing(objective, poison):
    """Every token input NaN (or -inf) off the mask: loss, gradient and metrics equal those of
    the same batch with zeros there (the masked positions take no part in any equation)."""
    gen = torch.Generator().manual_seed(0)
    logprobs_BT = -torch.rand(2, 5, generator=gen) - 0.1
    old_BT = logprobs_BT - 0.1 * torch.rand(2, 5, generator=gen)
    rollout_BT = old_BT - 0.2 * torch.rand(2, 5, generator=gen)
    ref_BT = logprobs_BT + 0.1
    entropy_BT = torch.rand(2, 5, generator=gen)
    clean = _batch(old_BT, [1.0, -0.5], rollout_logprobs=rollout_BT, ref_logprobs=ref_BT)
    dirty = _batch(
        _with_poison(old_BT, poison),
        [1.0, -0.5],
        rollout_logprobs=_with_poison(rollout_BT, poison),
        ref_logprobs=_with_poison(ref_BT, poison),
    )
    kwargs = {"objective": objective, "kl_coef": 0.1, "entropy_coef": 0.01}
    if objective == "dr_grpo":
        kwargs["max_response_tokens"] = 5
    loss_fn = PolicyLoss(**kwargs)

    def run(batch, logprobs, entropy):
        logprobs = logprobs.clone().requires_grad_(True)
        loss_sum, metrics = loss_fn(batch, logprobs, entropy)
        loss_sum.backward()
        return loss_sum.detach(), logprobs.grad, metrics

    want_loss, want_grad, want_metrics = run(clean, logprobs_BT, entropy_BT)
    got_loss, got_grad, got_metrics = run(
        dirty, _with_poison(logprobs_BT, poison), _with_poison(entropy_BT, poison)
    )
    assert torch.isfinite(want_loss)
    assert torch.equal(got_loss, want_loss)
    assert torch.equal(got_grad[MASK > 0], want_grad[MASK > 0])
    assert torch.equal(got_grad[MASK == 0], torch.zeros(int((MASK == 0).sum())))
    for key, value in want_metrics.items():
        assert torch.equal(got_metrics[key], value), key


def test_sum_over_units_selects_loss_tokens():
    values_BT = _with_poison(torch.ones(2, 5), float("nan"))
    got = sum_over_units(values_BT, MASK, aggregation="token_mean")
    assert got.item() == 5.0  # the five loss tokens


@pytest.mark.parametrize("eps", [0.0, -1e-4, 0.5, float("nan")])
def test_advantage_eps_outside_its_range_is_refused_by_name(eps):
    with pytest.raises(ValueError, match="advantage_eps"):
        PolicyLoss(advantage_eps=eps)
    with pytest.raises(ValueError, match="eps="):
        compute_grpo_advantages(torch.ones(2), torch.zeros(2), eps=eps, zero_variance_tolerance=0)


def test_a_constant_group_with_the_smallest_tolerance_gets_zero_advantages():
    # What eps=0 turned into 0 / 0 = NaN: a group of equal rewards and no tolerance.
    got = compute_grpo_advantages(
        torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), zero_variance_tolerance=0
    )
    assert got[:2].tolist() == [0.0, 0.0] and torch.isfinite(got).all()


def test_gspo_and_gspo_token_differ_under_token_level_correction_as_documented():
    """Unclipped, seq_mean_token_mean, one advantage A per sequence, token weights w_t:
    gspo's gradient on token t is -A s mean(w) / n, gspo_token's -A s w_t / n
    (n loss tokens, s the sequence ratio). Row 0 has weights 2 (capped), e^0.3, 1."""
    logprobs_BT = LOGPROBS[:1].clone()
    old_BT = logprobs_BT.clone()  # s = 1
    rollout_BT = old_BT.clone()
    rollout_BT[0, 1] -= 1.0  # w = e^1, truncated at 2
    rollout_BT[0, 2] -= 0.3  # w = e^0.3
    rows = [{"input_ids": list(range(5)), "loss_mask": MASK[0].tolist(), "advantages": -1.0}]
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.tokens["old_logprobs"] = old_BT
    batch.tokens["rollout_logprobs"] = rollout_BT
    w = torch.tensor([2.0, torch.e**0.3, 1.0])
    n, advantage = 3, -1.0
    grads = {}
    for objective in ("gspo", "gspo_token"):
        loss_fn = PolicyLoss(objective=objective, clip_low=10.0, clip_high=10.0)
        _, grad, _ = _loss_and_grad(loss_fn, batch, logprobs_BT)
        grads[objective] = grad[0, 1:4]
    assert torch.allclose(grads["gspo"], (-advantage * w.mean() / n).expand(3), rtol=1e-5)
    assert torch.allclose(grads["gspo_token"], -advantage * w / n, rtol=1e-5)
