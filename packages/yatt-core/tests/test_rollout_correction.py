"""Rollout correction: TIS/MIS weights on hand-made logprobs (TRL's and verl's definitions
restated: w_t = exp(old_t - rollout_t), w = prod_t w_t; truncate min(w, C), mask w > C -> 0),
how PolicyLoss applies them, and the mismatch metrics."""

import math

import pytest
import torch

from yatt.core import (
    Batch,
    PolicyLoss,
    compute_mismatch_kl,
    compute_rollout_weights,
    engine_old_logprobs,
)

NUM_GPUS = 0

# Row 0: token log-weights 0.1, 1.0, -0.5 (weights 1.105, 2.718, 0.607); row 1: 0.3 on one
# token; position 0 is the prompt (a huge gap that must not count), row 1's tail is padding.
OLD = torch.tensor([[0.0, -1.0, -1.0, -1.0], [0.0, -2.0, 0.0, 0.0]])
ROLLOUT = torch.tensor([[-9.0, -1.1, -2.0, -0.5], [-9.0, -2.3, -9.0, -9.0]])
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
E = math.exp


@pytest.mark.parametrize(
    ("mode", "row0", "row1", "capped"),
    [
        pytest.param("none", [1, 1, 1], [1], 0, id="none"),
        pytest.param("token_truncate", [E(0.1), 2.0, E(-0.5)], [E(0.3)], 1, id="token-truncate"),
        pytest.param("token_mask", [E(0.1), 0.0, E(-0.5)], [E(0.3)], 1, id="token-mask"),
        # Row 0's sequence weight exp(0.1 + 1.0 - 0.5) = 1.82 is under the cap.
        pytest.param("sequence_truncate", [E(0.6)] * 3, [E(0.3)], 0, id="sequence-truncate"),
        pytest.param("sequence_mask", [E(0.6)] * 3, [E(0.3)], 0, id="sequence-mask"),
    ],
)
def test_weights_match_the_definitions(mode, row0, row1, capped):
    weights, is_capped = compute_rollout_weights(OLD, ROLLOUT, MASK, mode=mode, cap=2.0)
    assert weights[0, 1:].tolist() == pytest.approx(row0, rel=1e-6)
    assert weights[1, 1].item() == pytest.approx(row1[0], rel=1e-6)
    assert weights[0, 0] == 0 and weights[1, 2:].abs().sum() == 0  # off the mask: 0
    assert int(is_capped.sum()) == capped


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        pytest.param("sequence_truncate", 1.5, id="truncate"),
        pytest.param("sequence_mask", 0.0, id="mask"),
    ],
)
def test_a_sequence_over_the_cap_is_truncated_or_masked_whole(mode, expected):
    weights, is_capped = compute_rollout_weights(OLD, ROLLOUT, MASK, mode=mode, cap=1.5)
    assert weights[0, 1:].tolist() == pytest.approx([expected] * 3)
    assert is_capped[0].tolist() == [False, True, True, True]
    assert weights[1, 1].item() == pytest.approx(E(0.3))  # row 1 under the cap


def test_cap_at_or_below_one_is_refused():
    with pytest.raises(ValueError, match="cap"):
        compute_rollout_weights(OLD, ROLLOUT, MASK, mode="token_truncate", cap=1.0)


def test_mismatch_kl_is_k3_of_engine_against_trainer():
    kl = compute_mismatch_kl(OLD, ROLLOUT)
    log_r = 1.0  # row 0, token 2: old - rollout
    assert kl[0, 2].item() == pytest.approx(E(log_r) - 1 - log_r, rel=1e-6)
    assert (kl >= 0).all()


def _batch(advantages=(1.0, -2.0)) -> Batch:
    rows = [
        {"input_ids": [5, 6, 7, 8], "loss_mask": MASK[0].tolist(), "advantages": advantages[0]},
        {"input_ids": [5, 6], "loss_mask": [0, 1], "advantages": advantages[1]},
    ]
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.tokens["old_logprobs"] = OLD
    batch.tokens["rollout_logprobs"] = ROLLOUT
    return batch


def test_policy_loss_weights_the_policy_gradient_term_only():
    # On-policy (ratio 1) token_mean: L = -(1/4) sum_t w_t A, gradient -w_t A / 4; the KL term
    # is not weighted.
    batch = _batch()
    batch.tokens["ref_logprobs"] = OLD
    logprobs = OLD.clone().requires_grad_(True)
    loss_fn = PolicyLoss(objective="dapo", rollout_correction="token_truncate", kl_coef=0.5)
    loss_sum, metrics = loss_fn(batch, logprobs)
    (loss_sum / loss_fn.count_units(batch)).backward()
    weights = [E(0.1), 2.0, E(-0.5), E(0.3)]
    advantages = [1.0, 1.0, 1.0, -2.0]
    expected = [-w * a / 4 for w, a in zip(weights, advantages, strict=True)]
    # The KL term's gradient is 0 at pi = pi_ref (k3's derivative (1 - r) at r = 1).
    got = [logprobs.grad[0, 1], logprobs.grad[0, 2], logprobs.grad[0, 3], logprobs.grad[1, 1]]
    assert [g.item() for g in got] == pytest.approx(expected, rel=1e-6)
    assert metrics["is_weight"].item() == pytest.approx(sum(weights), rel=1e-6)
    assert metrics["is_weight_max"].item() == pytest.approx(2.0)
    assert metrics["is_capped_frac"].item() == 1
    k3 = [E(x) - 1 - x for x in (0.1, 1.0, -0.5, 0.3)]
    assert metrics["mismatch_kl"].item() == pytest.approx(sum(k3), rel=1e-5)


def test_policy_loss_is_on_by_default_and_off_by_one_field():
    batch = _batch()
    logprobs = OLD.clone()
    on, metrics_on = PolicyLoss(objective="dapo")(batch, logprobs)
    off, metrics_off = PolicyLoss(objective="dapo", rollout_correction="none")(batch, logprobs)
    assert on.item() == pytest.approx(-(E(0.1) + 2.0 + E(-0.5)) + 2 * E(0.3), rel=1e-6)
    assert off.item() == pytest.approx(-3 + 2, rel=1e-6)
    assert "is_weight" in metrics_on and "is_weight" not in metrics_off


def test_engine_old_logprobs_make_the_ratio_pi_over_the_engines():
    # old_logprobs_from="engine" (verl's bypass mode): r_t = pi(y_t) / pi_rollout(y_t), clipped
    # as DAPO's 0.2 / 0.28, with no correction weight. Token log-ratios log pi - log pi_rollout
    # on row 0: 0.1 (inside), 1.0 (A > 0: clipped at 1.28), -0.5 (A > 0: inside); row 1: 0.3
    # with A < 0 (inside: the low clip is for ratios under 0.8).
    batch = _batch()
    batch.tokens["old_logprobs"] = engine_old_logprobs(batch)
    assert torch.equal(batch["old_logprobs"], ROLLOUT)
    logprobs = OLD.clone().requires_grad_(True)
    loss_fn = PolicyLoss(objective="dapo", old_logprobs_from="engine", rollout_correction="none")
    loss_sum, metrics = loss_fn(batch, logprobs)
    (loss_sum / loss_fn.count_units(batch)).backward()
    ratios = [E(0.1), E(1.0), E(-0.5), E(0.3)]
    advantages = [1.0, 1.0, 1.0, -2.0]
    is_clipped = [False, True, False, False]
    expected = [
        0.0 if clipped else -r * a / 4
        for r, a, clipped in zip(ratios, advantages, is_clipped, strict=True)
    ]
    got = [logprobs.grad[0, 1], logprobs.grad[0, 2], logprobs.grad[0, 3], logprobs.grad[1, 1]]
    assert [g.item() for g in got] == pytest.approx(expected, rel=1e-6)
    assert metrics["clip_frac_high"].item() == 1
    assert "is_weight" not in metrics


def test_engine_old_logprobs_need_the_engines_logprobs():
    batch = Batch.from_samples(
        [{"input_ids": [1, 2], "loss_mask": [0, 1], "advantages": 1.0}],
        token_keys=["input_ids", "loss_mask"],
    )
    with pytest.raises(ValueError, match=r"old_logprobs_from='engine'.*rollout_logprobs"):
        engine_old_logprobs(batch)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        pytest.param({"rollout_correction": "token_truncate"}, "rollout_correction", id="tis"),
        pytest.param({"rollout_correction": "none", "is_on_policy": True}, "is_on_policy", id="on"),
        pytest.param({"rollout_correction": "none", "old_logprobs_from": "both"}, "from", id="bad"),
    ],
)
def test_engine_old_logprobs_refuse_what_cannot_hold(fields, named):
    fields = {"old_logprobs_from": "engine", **fields}
    with pytest.raises(ValueError, match=rf"PolicyLoss\.\w*{named}="):
        PolicyLoss(**fields)
