"""GRPO advantages, the zero-variance filter, dynamic sampling, and logits -> logprobs."""

import math

import pytest
import torch

from yatt.core import (
    Batch,
    compute_entropy,
    compute_grpo_advantages,
    compute_token_logprobs,
    mask_groups_with_reward_variance,
    sample_dynamically,
)

NUM_GPUS = 0


@pytest.mark.parametrize(
    ("rewards", "groups", "normalize", "expected"),
    [
        pytest.param(
            [1.0, 0.0, 0.0, 0.0],
            [0, 0, 0, 0],
            True,
            # mean 0.25, unbiased std sqrt(0.25)=0.5
            [1.5, -0.5, -0.5, -0.5],
            id="one-group-std",
        ),
        pytest.param(
            [1.0, 0.0, 0.0, 0.0], [0, 0, 0, 0], False, [0.75, -0.25, -0.25, -0.25], id="dr-grpo"
        ),
        pytest.param(
            [2.0, 2.0, 1.0, 3.0],
            [7, 7, 3, 3],
            True,
            [0.0, 0.0, -1 / math.sqrt(2), 1 / math.sqrt(2)],
            id="two-groups",
        ),
        pytest.param(
            [1.0, 5.0, 3.0],
            [4, 9, 4],
            True,
            [-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)],
            id="interleaved-and-singleton",
        ),
    ],
)
def test_grpo_advantages(rewards, groups, normalize, expected):
    adv = compute_grpo_advantages(
        torch.tensor(rewards), torch.tensor(groups), should_std_normalize=normalize
    )
    assert adv.dtype == torch.float32
    # eps (1e-4) in the denominator: within 2e-4 relative of the exact ratio.
    assert adv.tolist() == pytest.approx(expected, rel=2e-4, abs=1e-6)


def _noisy_group():
    # Four equal verdicts a GenRM scored with float noise of 1e-5.
    return torch.tensor([0.5, 0.5 + 1e-5, 0.5 - 1e-5, 0.5 + 2e-5], dtype=torch.float64)


def test_float_noise_within_a_group_gets_no_advantage():
    rewards = _noisy_group()
    groups = torch.zeros(4, dtype=torch.int64)
    assert compute_grpo_advantages(rewards, groups).abs().max().item() == 0.0
    # Without the tolerance and with verl's eps the noise becomes a full-size advantage:
    # (r - mean) / (std + 1e-6), by hand.
    mean = float(rewards.mean())
    std = math.sqrt(sum((float(r) - mean) ** 2 for r in rewards) / 3)
    old = compute_grpo_advantages(rewards, groups, eps=1e-6, zero_variance_tolerance=0.0)
    expected = [(float(r) - mean) / (std + 1e-6) for r in rewards]
    assert old.tolist() == pytest.approx(expected, rel=1e-4)
    assert old.abs().max().item() > 1.0
    # TRL's eps alone (std + 1e-4) shrinks it to about a tenth.
    trl = compute_grpo_advantages(rewards, groups, eps=1e-4, zero_variance_tolerance=0.0)
    assert trl.tolist() == pytest.approx([(float(r) - mean) / (std + 1e-4) for r in rewards])
    assert trl.abs().max().item() < 0.2


def test_tolerance_zeroes_only_the_groups_inside_it():
    rewards = torch.tensor([0.0, 1e-5, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    adv = compute_grpo_advantages(rewards, groups, zero_variance_tolerance=1e-4)
    # group 1: mean 0.5, std sqrt(0.5); +-0.5 / (sqrt(0.5) + 1e-4)
    expected = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert adv.tolist() == pytest.approx([0.0, 0.0, -expected, expected], rel=1e-6)
    dr = compute_grpo_advantages(rewards, groups, should_std_normalize=False)
    assert dr.tolist() == pytest.approx([0.0, 0.0, -0.5, 0.5])


def test_grpo_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        compute_grpo_advantages(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="non-finite"):
        compute_grpo_advantages(torch.tensor([1.0, float("nan")]), torch.zeros(2))
    with pytest.raises(ValueError, match="zero_variance_tolerance"):
        compute_grpo_advantages(torch.zeros(2), torch.zeros(2), zero_variance_tolerance=-1.0)


def test_variance_mask():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert mask_groups_with_reward_variance(rewards, groups).tolist() == [
        False, False, True, True, False, False, False,
    ]  # fmt: skip
    near = torch.tensor([1.0, 1.0 + 1e-9])
    assert not mask_groups_with_reward_variance(near, torch.zeros(2), tolerance=1e-6).any()


def _groups_batch(rewards_per_group):
    rows = []
    for g, rewards in enumerate(rewards_per_group):
        for r in rewards:
            rows.append(
                {"input_ids": [1, 2, 3], "group_id": g, "reward": float(r), "text": f"g{g}"}
            )
    return Batch.from_samples(rows)


def test_sample_dynamically_refills_until_full():
    rounds = [
        [[1, 1], [0, 1], [0, 0]],  # one informative group
        [[1, 0], [1, 1]],  # one more (its local id 0 repeats round 1's ids)
        [[0, 1], [1, 0]],  # two more: the batch is full after the first
    ]
    calls = []

    def generate(num_missing):
        calls.append(num_missing)
        return _groups_batch(rounds[len(calls) - 1])

    batch, stats = sample_dynamically(generate, num_groups=3, max_rounds=5)
    assert calls == [3, 2, 1]
    assert stats["num_rounds"] == 3 and stats["is_filled"] == 1.0
    assert stats["num_groups_generated"] == 7 and stats["num_groups_dropped"] == 3
    assert batch["group_id"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["text"] == ["g1", "g1", "g0", "g0", "g0", "g0"]
    assert mask_groups_with_reward_variance(batch["reward"], batch["group_id"]).all()


def test_sample_dynamically_stops_at_max_rounds():
    batch, stats = sample_dynamically(
        lambda n: _groups_batch([[1, 1], [0, 1]]), num_groups=4, max_rounds=2
    )
    assert stats["num_rounds"] == 2 and stats["is_filled"] == 0.0
    assert len(batch) == 4 and batch["group_id"].tolist() == [0, 0, 1, 1]
    empty, stats = sample_dynamically(lambda n: _groups_batch([[1, 1]]), num_groups=1, max_rounds=1)
    assert len(empty) == 0 and "reward" in empty.samples


# -- logits -> logprobs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature",
    [
        pytest.param(1.0, id="t1"),
        pytest.param(0.7, id="t0.7"),
        pytest.param(0.0, id="greedy-unscaled"),
    ],
)
def test_token_logprobs_match_manual(temperature):
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 11)
    ids = torch.randint(0, 11, (2, 4))
    out = compute_token_logprobs(logits, ids, temperature=temperature)
    scale = temperature if temperature > 0 else 1.0
    assert out.shape == (2, 4) and (out[:, 0] == 0).all()
    for b in range(2):
        for t in range(1, 4):
            expected = torch.log_softmax(logits[b, t - 1] / scale, -1)[ids[b, t]]
            assert out[b, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_entropy_closed_forms():
    uniform = torch.zeros(1, 3, 8)
    assert compute_entropy(uniform)[0, 1:].tolist() == pytest.approx([math.log(8)] * 2)
    peaked = torch.tensor([[[0.0, 100.0, 0.0], [0.0, 0.0, 0.0]]])
    assert compute_entropy(peaked)[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    # Lower temperature sharpens: entropy drops.
    logits = torch.randn(1, 5, 7)
    assert (compute_entropy(logits, temperature=0.5) <= compute_entropy(logits) + 1e-6).all()


def test_logprob_gradient_flows_into_logits():
    logits = torch.randn(1, 3, 5, requires_grad=True)
    out = compute_token_logprobs(logits, torch.tensor([[0, 1, 2]]))
    out.sum().backward()
    assert logits.grad[0, :2].abs().sum() > 0
    assert logits.grad[0, 2].abs().sum() == 0  # the last position predicts nothing here
