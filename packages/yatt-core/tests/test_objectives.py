"""The loss family (Dr. GRPO, GSPO, GSPO-token, CISPO, DAPO's clip) against re-implementations written
token by token from each paper's equation, values and gradients, and the clip fractions on a
batch where the clip must act on known tokens."""

import math

import pytest
import torch

from yatt.core import Batch, PolicyLoss

NUM_GPUS = 0

# Three responses of different lengths; row 1 is the shortest, row 2 has a prompt of two.
MASK = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 1, 1, 1]])
ADVANTAGES = [1.0, -0.5, 2.0]


def _batch(old_BT: torch.Tensor, advantages=ADVANTAGES) -> Batch:
    rows = [
        {"input_ids": list(range(5)), "loss_mask": MASK[i].tolist(), "advantages": a}
        for i, a in enumerate(advantages)
    ]
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.tokens["old_logprobs"] = old_BT
    return batch


def _tokens(i: int) -> list[int]:
    return [t for t in range(MASK.shape[1]) if MASK[i, t]]


def _mean_loss_and_grad(loss_fn: PolicyLoss, batch: Batch, logprobs_BT: torch.Tensor):
    logprobs_BT = logprobs_BT.clone().requires_grad_(True)
    loss_sum, metrics = loss_fn(batch, logprobs_BT)
    loss = loss_sum / loss_fn.count_units(batch)
    loss.backward()
    return loss.item(), logprobs_BT.grad, metrics


def _reference_grad(reference, logprobs_BT: torch.Tensor):
    logprobs_BT = logprobs_BT.clone().requires_grad_(True)
    loss = reference(logprobs_BT)
    loss.backward()
    return loss.item(), logprobs_BT.grad


def _logprobs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logprobs_BT = -torch.rand(3, 5, generator=gen) * 2 - 0.1
    # Ratios from 0.6 to 1.5: on both sides of PPO's clip range.
    old_BT = logprobs_BT - torch.log(torch.rand(3, 5, generator=gen) * 0.9 + 0.6)
    return logprobs_BT, old_BT


def test_dr_grpo_is_token_sums_over_a_constant_length():
    # Dr. GRPO (arXiv:2503.20783): L = -(1 / (G L_max)) sum_i sum_t min(r A, clip(r) A).
    logprobs_BT, old_BT = _logprobs()
    length = 8

    def reference(lp_BT):
        total = 0.0
        for i, adv in enumerate(ADVANTAGES):
            for t in _tokens(i):
                r = torch.exp(lp_BT[i, t] - old_BT[i, t])
                total = total + torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
        return -total / (len(ADVANTAGES) * length)

    loss_fn = PolicyLoss(objective="dr_grpo", max_response_tokens=length, rollout_correction="none")
    value, grad, _ = _mean_loss_and_grad(loss_fn, _batch(old_BT), logprobs_BT)
    expected_value, expected_grad = _reference_grad(reference, logprobs_BT)
    assert value == pytest.approx(expected_value, rel=1e-5)
    assert torch.allclose(grad, expected_grad, atol=1e-7)
    assert (expected_grad == 0).sum() > (MASK == 0).sum()  # some tokens clipped: no gradient


def test_grpo_averages_each_sequence_then_the_group():
    # GRPO (arXiv:2402.03300 eq. 3): -(1/G) sum_i (1/|o_i|) sum_t min(r A, clip(r) A).
    logprobs_BT, old_BT = _logprobs(1)

    def reference(lp_BT):
        total = 0.0
        for i, adv in enumerate(ADVANTAGES):
            tokens = _tokens(i)
            seq = 0.0
            for t in tokens:
                r = torch.exp(lp_BT[i, t] - old_BT[i, t])
                seq = seq + torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
            total = total + seq / len(tokens)
        return -total / len(ADVANTAGES)

    loss_fn = PolicyLoss(objective="grpo", rollout_correction="none")
    value, grad, _ = _mean_loss_and_grad(loss_fn, _batch(old_BT), logprobs_BT)
    expected_value, expected_grad = _reference_grad(reference, logprobs_BT)
    assert value == pytest.approx(expected_value, rel=1e-5)
    assert torch.allclose(grad, expected_grad, atol=1e-7)


def test_gspo_clips_the_sequence_ratio():
    # GSPO (arXiv:2507.18071 eqs. 5-7): s_i = exp(mean_t log r_t),
    # L = -(1/G) sum_i min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i).
    logprobs_BT = -torch.rand(3, 5, generator=torch.Generator().manual_seed(2)) - 0.2
    # Per-row log-ratio offsets: row 0 (A > 0) above 1 + 4e-4: clipped; row 1 (A < 0) at
    # 1 - 1e-4: inside; row 2 (A > 0) at 1 + 2e-4 on average, with spread between tokens.
    offsets_BT = torch.tensor(
        [[0, 1e-3, 1e-3, 1e-3, 0], [0, -1e-4, 0, 0, 0], [0, 0, -3e-4, 2e-4, 7e-4]]
    )
    old_BT = logprobs_BT - offsets_BT

    def reference(lp_BT):
        total = 0.0
        for i, adv in enumerate(ADVANTAGES):
            tokens = _tokens(i)
            mean_log = sum(lp_BT[i, t] - old_BT[i, t] for t in tokens) / len(tokens)
            s = torch.exp(mean_log)
            total = total + torch.minimum(s * adv, s.clamp(1 - 3e-4, 1 + 4e-4) * adv)
        return -total / len(ADVANTAGES)

    loss_fn = PolicyLoss(objective="gspo", rollout_correction="none")
    value, grad, metrics = _mean_loss_and_grad(loss_fn, _batch(old_BT), logprobs_BT)
    expected_value, expected_grad = _reference_grad(reference, logprobs_BT)
    assert value == pytest.approx(expected_value, rel=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-8)
    assert grad[0].abs().sum() == 0  # the clipped sequence
    # Unclipped: each token of row 2 gets s A / (G |y|), the same for all its tokens.
    s2 = math.exp((2e-4 - 3e-4 + 7e-4) / 3)
    assert grad[2, 2:].tolist() == pytest.approx([-s2 * 2.0 / (3 * 3)] * 3, rel=1e-4)
    assert metrics["clip_frac_high"].item() == 3  # row 0's three loss tokens
    assert metrics["clip_frac_low"].item() == 0


# GSPO-token's per-token advantages (arXiv:2507.18071 eq. 16 allows A_{i,t} to vary with t).
TOKEN_ADVANTAGES_BT = torch.tensor(
    [[0.0, 1.0, -2.0, 0.5, 0.0], [0.0, -0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 2.0, -1.0, 3.0]]
)


def _gspo_offsets_batch(advantages_BT: torch.Tensor):
    """Logprobs, and a batch whose old logprobs put row 0's sequence ratio above 1 + 4e-4,
    row 1's at 1 - 1e-4 and row 2's at 1 + 2e-4 (spread between its tokens)."""
    logprobs_BT = -torch.rand(3, 5, generator=torch.Generator().manual_seed(4)) - 0.2
    offsets_BT = torch.tensor(
        [[0, 1e-3, 1e-3, 1e-3, 0], [0, -1e-4, 0, 0, 0], [0, 0, -3e-4, 2e-4, 7e-4]]
    )
    rows = [
        {
            "input_ids": list(range(5)),
            "loss_mask": MASK[i].tolist(),
            "advantages": advantages_BT[i].tolist(),
        }
        for i in range(3)
    ]
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask", "advantages"])
    batch.tokens["old_logprobs"] = logprobs_BT - offsets_BT
    return logprobs_BT, batch


def test_gspo_token_matches_the_papers_equation_with_per_token_advantages():
    # GSPO-token (arXiv:2507.18071 eqs. 16-17):
    #   s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})],  s_i = exp(mean_t log r_{i,t})
    #   L = -(1/G) sum_i (1/|y_i|) sum_t min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1-3e-4, 1+4e-4) A_{i,t})
    logprobs_BT, batch = _gspo_offsets_batch(TOKEN_ADVANTAGES_BT)
    old_BT = batch["old_logprobs"]

    def reference(lp_BT):
        total = 0.0
        for i in range(3):
            tokens = _tokens(i)
            mean_log = sum(lp_BT[i, t].detach() - old_BT[i, t] for t in tokens) / len(tokens)
            s_i = torch.exp(mean_log)  # sg[s_i]: built from detached logprobs
            seq = 0.0
            for t in tokens:
                pi = torch.exp(lp_BT[i, t])
                s_it = s_i * pi / pi.detach()
                adv = TOKEN_ADVANTAGES_BT[i, t]
                seq = seq + torch.minimum(s_it * adv, s_it.clamp(1 - 3e-4, 1 + 4e-4) * adv)
            total = total + seq / len(tokens)
        return -total / 3

    loss_fn = PolicyLoss(objective="gspo_token", rollout_correction="none")
    value, grad, metrics = _mean_loss_and_grad(loss_fn, batch, logprobs_BT)
    expected_value, expected_grad = _reference_grad(reference, logprobs_BT)
    assert value == pytest.approx(expected_value, rel=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-8)
    # Row 0 (s_0 > 1 + 4e-4): its A > 0 tokens (t = 1, 3) are clipped, its A < 0 token is not,
    # and gets -s_0 A / (G |y_0|) = s_0 * 2 / 9.
    s_0 = math.exp(1e-3)
    assert grad[0, 1] == 0 and grad[0, 3] == 0
    assert grad[0, 2].item() == pytest.approx(s_0 * 2.0 / 9, rel=1e-5)
    assert metrics["clip_frac_high"].item() == 2
    assert metrics["clip_frac_low"].item() == 0


def test_gspo_token_with_one_advantage_per_sequence_has_gspos_gradient():
    # Equal A_{i,t} = A_i on a sequence's tokens: eq. 18's gradient is GSPO's (eq. 11).
    per_sample_BT = torch.tensor(ADVANTAGES)[:, None].expand(3, 5).clone()
    logprobs_BT, batch = _gspo_offsets_batch(per_sample_BT)
    gspo = PolicyLoss(objective="gspo", rollout_correction="none")
    token = PolicyLoss(objective="gspo_token", rollout_correction="none")
    gspo_value, gspo_grad, gspo_metrics = _mean_loss_and_grad(gspo, batch, logprobs_BT)
    token_value, token_grad, token_metrics = _mean_loss_and_grad(token, batch, logprobs_BT)
    assert token_value == pytest.approx(gspo_value, rel=1e-6)
    assert torch.allclose(token_grad, gspo_grad, atol=1e-8)
    assert gspo_grad[0].abs().sum() == 0 and gspo_grad[2].abs().sum() > 0  # clipped, not
    for key in ("clip_frac_low", "clip_frac_high"):
        assert token_metrics[key].item() == gspo_metrics[key].item()


def test_gspo_token_refuses_token_level_aggregation():
    with pytest.raises(ValueError, match=r"PolicyLoss\.aggregation='token_mean'"):
        PolicyLoss(objective="gspo_token", aggregation="token_mean")
    with pytest.raises(ValueError, match=r"PolicyLoss\.dual_clip_c"):
        PolicyLoss(objective="gspo_token", dual_clip_c=3.0)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # CISPO (arXiv:2506.13585 eqs. 4-5): L = -(1/sum|o_i|) sum_i sum_t sg(clip(r, 0, 1.28)) A log pi.
    logprobs_BT, old_BT = _logprobs(3)

    def reference(lp_BT):
        total = 0.0
        num_tokens = 0
        for i, adv in enumerate(ADVANTAGES):
            for t in _tokens(i):
                weight = min(math.exp(float(lp_BT[i, t].detach() - old_BT[i, t])), 1.28)
                total = total + weight * adv * lp_BT[i, t]
                num_tokens += 1
        return -total / num_tokens

    loss_fn = PolicyLoss(objective="cispo", rollout_correction="none")
    value, grad, metrics = _mean_loss_and_grad(loss_fn, _batch(old_BT), logprobs_BT)
    expected_value, expected_grad = _reference_grad(reference, logprobs_BT)
    assert value == pytest.approx(expected_value, rel=1e-5)
    assert torch.allclose(grad, expected_grad, atol=1e-7)
    ratio_BT = torch.exp(logprobs_BT - old_BT)
    is_high_BT = (ratio_BT > 1.28) & (MASK > 0)
    assert is_high_BT.any()
    assert (grad[is_high_BT] != 0).all()  # clipped weight, gradient kept
    assert metrics["clip_frac_high"].item() == is_high_BT.sum().item()


def test_clip_fractions_on_tokens_where_the_clip_must_act():
    # DAPO's clip 0.2 / 0.28 and dual clip c = 3, one loss token per row:
    #   A = +1, r = 1.5  -> high       A = -1, r = 0.5  -> low
    #   A = -1, r = 5.0  -> dual       A = +1, r = 1.1  -> none    A = -1, r = 1.25 -> none
    ratios = [1.5, 0.5, 5.0, 1.1, 1.25]
    advantages = [1.0, -1.0, -1.0, 1.0, -1.0]
    rows = [{"input_ids": [1, 2], "loss_mask": [0, 1], "advantages": a} for a in advantages]
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    logprobs_BT = torch.full((5, 2), -1.0)
    batch.tokens["old_logprobs"] = logprobs_BT - torch.log(torch.tensor(ratios))[:, None]
    loss_fn = PolicyLoss(objective="dapo", dual_clip_c=3.0, rollout_correction="none")
    _, grad, metrics = _mean_loss_and_grad(loss_fn, batch, logprobs_BT)
    assert metrics["clip_frac_high"].item() == 1
    assert metrics["clip_frac_low"].item() == 1
    assert metrics["clip_frac_dual"].item() == 1
    assert metrics["clip_frac"].item() == 3
    # Clipped tokens get no gradient; the two inside get -r A / 5.
    assert grad[:, 1].tolist() == pytest.approx([0, 0, 0, -1.1 / 5, 1.25 / 5], abs=1e-7)
