"""Several optimizer steps per rollout batch: split_mini_batches (whole groups, balanced
cost) and a second mini-batch step whose ratio is not 1, checked against the PPO/DAPO
objective written out and differentiated by autograd on the same one-vector "model"."""

import contextlib
import itertools

import pytest
import torch

from yatt.core import Batch, PolicyLoss, merge_step_metrics, split_mini_batches
from yatt.core.policy._train_step import StepCounts, compute_logprobs, run_train_step

NUM_GPUS = 0
VOCAB = 6


def _groups_batch(lengths_per_group):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for group, lengths in enumerate(lengths_per_group):
        for length in lengths:
            mask = [0] + [1] * (length - 1)
            ids = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
            advantage = float(torch.randn((), generator=gen))
            rows.append(
                {
                    "input_ids": ids,
                    "loss_mask": mask,
                    "group_id": 10 + group,
                    "advantages": advantage,
                }
            )
    return Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])


def test_split_keeps_groups_whole_and_balances_cost():
    lengths = [[9, 3], [4, 4], [12, 2], [5, 6], [7, 7], [3, 3]]
    batch = _groups_batch(lengths)
    parts = split_mini_batches(batch, 3)
    assert len(parts) == 3
    seen = sorted(i for part in parts for i in part["input_ids"][:, 0].tolist())
    assert len(seen) == len(batch)
    groups = [set(part["group_id"].tolist()) for part in parts]
    assert sum(len(g) for g in groups) == len(lengths)  # no group in two mini-batches
    # Group costs 12, 8, 14, 11, 14, 6 (65 in all); the heaviest part of the best split, by
    # trying all 3^6 assignments of groups to parts:
    group_costs = [sum(g) for g in lengths]
    best = min(
        max(sum(c for c, p in zip(group_costs, assign, strict=True) if p == k) for k in range(3))
        for assign in itertools.product(range(3), repeat=len(group_costs))
    )
    sums = [int(part.lengths.sum()) for part in parts]
    assert max(sums) == best == 23 and sum(sums) == 65


def test_split_with_fewer_groups_than_mini_batches_gives_empty_ones_last():
    batch = _groups_batch([[3, 4]])
    parts = split_mini_batches(batch, 3)
    assert [len(part) for part in parts] == [2, 0, 0]
    assert split_mini_batches(batch, 1)[0] is batch
    empty = split_mini_batches(batch.select([]), 2)
    assert [len(part) for part in empty] == [0, 0]


def _group_partition(parts):
    """The split as a set of frozensets of group ids (mini-batch order ignored)."""
    return {frozenset(part["group_id"].tolist()) for part in parts if len(part)}


def test_seeded_split_reshuffles_per_seed_and_covers_every_group_once():
    # Eight groups, costs 5..12: many splits into two halves are near-balanced.
    lengths = [[2 + g, 3] for g in range(8)]
    batch = _groups_batch(lengths)
    group_costs = {10 + g: sum(ls) for g, ls in enumerate(lengths)}
    splits = {}
    for seed in (0, 1, 2):
        parts = split_mini_batches(batch, 2, seed=seed)
        # every sample once, every group whole in exactly one mini-batch
        rows = sorted(i for part in parts for i in part["input_ids"][:, 0].tolist())
        assert rows == sorted(batch["input_ids"][:, 0].tolist())
        groups_per_part = [part["group_id"].tolist() for part in parts]
        assert sorted(g for part in groups_per_part for g in set(part)) == sorted(group_costs)
        # balance: heaviest - lightest <= the smallest group cost in the heaviest part
        loads = [sum(part.lengths.tolist()) for part in parts]
        heavy = groups_per_part[loads.index(max(loads))]
        assert max(loads) - min(loads) <= min(group_costs[g] for g in heavy)
        # same seed, same split (any rank, any run)
        again = split_mini_batches(batch, 2, seed=seed)
        assert _group_partition(again) == _group_partition(parts)
        splits[seed] = _group_partition(parts)
    assert len({frozenset(split) for split in splits.values()}) > 1, splits
    assert splits[0] != splits[1]


def test_seeded_split_narrows_a_bad_deal_by_moves_and_swaps():
    # One heavy group (30) and six light ones (5): any deal that starts the heavy group late
    # leaves parts like 35/15; the search must end within the bound (gap <= 5 here: 30 alone
    # against 6 x 5 = 30 is the only balanced split).
    lengths = [[15, 15]] + [[2, 3]] * 6
    batch = _groups_batch(lengths)
    for seed in range(6):
        parts = split_mini_batches(batch, 2, seed=seed)
        loads = sorted(int(part.lengths.sum()) for part in parts)
        assert loads == [30, 30], (seed, loads)


def test_split_rejects_bad_input():
    batch = _groups_batch([[3, 4]])
    with pytest.raises(ValueError, match="num_mini_batches"):
        split_mini_batches(batch, 0)
    with pytest.raises(ValueError, match="group_key='prompt'"):
        split_mini_batches(batch, 2, group_key="prompt")
    with pytest.raises(ValueError, match="costs"):
        split_mini_batches(batch, 2, costs=[1.0])
    with pytest.raises(ValueError, match=r"seed=1\.5"):
        split_mini_batches(batch, 2, seed=1.5)


class OneVectorPolicy:
    """log p(token) = log_softmax(theta)[token] at every position (no context); SGD."""

    def __init__(self, theta):
        self.device = torch.device("cpu")
        self.dp_size = 1
        self.theta = torch.nn.Parameter(theta.clone())

    @property
    def dp_group(self):
        return None

    def plan_micro_batches(self, batch):
        return [list(range(len(batch)))] if len(batch) else [[]]

    def forward_micro_batch(self, mb, *, needs_entropy, is_training):
        logprobs_BT = _logprobs(self.theta, mb["input_ids"])
        return logprobs_BT, None

    def grad_sync(self, *, is_last):
        return contextlib.nullcontext()

    def zero_grad(self):
        self.theta.grad = None

    def reduce_and_clip_grads(self, max_norm):
        return float(self.theta.grad.norm()), False

    def step_optimizer(self, lr):
        with torch.no_grad():
            self.theta -= lr * self.theta.grad


def _logprobs(theta, ids_BT):
    logprobs_BT = torch.log_softmax(theta, -1)[ids_BT]
    return torch.cat([torch.zeros_like(logprobs_BT[:, :1]), logprobs_BT[:, 1:]], 1)


def _dapo_objective(theta, mb, old_BT, low=0.2, high=0.28):
    """-(1 / tokens) sum over loss tokens of min(r A, clip(r, 1 - low, 1 + high) A), r =
    pi_theta / pi_old: DAPO eqs. 8 and 10, written out."""
    logprobs_BT = _logprobs(theta, mb["input_ids"])
    total, num_tokens = 0.0, 0
    for i in range(len(mb)):
        advantage = float(mb["advantages"][i])
        for t in range(mb["input_ids"].shape[1]):
            if mb["loss_mask"][i, t]:
                r = torch.exp(logprobs_BT[i, t] - old_BT[i, t])
                total = total + torch.minimum(r * advantage, r.clamp(1 - low, 1 + high) * advantage)
                num_tokens += 1
    return -total / num_tokens


def test_second_mini_batch_steps_against_the_old_policy():
    batch = _groups_batch([[5, 4, 6], [3, 7, 2], [6, 6, 5], [4, 3, 8]])
    theta0 = torch.linspace(-1.0, 1.0, VOCAB)
    lr = 2.0  # large: the first step moves the policy far enough for the clip to act
    policy = OneVectorPolicy(theta0)
    batch.tokens["old_logprobs"] = compute_logprobs(policy, batch)  # once, before any update
    first, second = split_mini_batches(batch, 2)
    loss = PolicyLoss(objective="dapo", num_mini_batches=2, rollout_correction="none")
    loss.check_rollout(prompts_per_rank=4, max_new_tokens=8)
    kwargs = {"counts": StepCounts(), "lr_at": lambda step: lr, "max_grad_norm": None}
    steps = [run_train_step(policy, mb, loss, **kwargs) for mb in (first, second)]

    # The same two SGD steps by autograd on the objective written out, old = theta0's.
    theta = theta0.clone().requires_grad_(True)
    old_first = _logprobs(theta0, first["input_ids"])
    (grad1,) = torch.autograd.grad(_dapo_objective(theta, first, old_first), theta)
    theta1 = (theta0 - lr * grad1).requires_grad_(True)
    old_second = _logprobs(theta0, second["input_ids"])
    objective2 = _dapo_objective(theta1, second, old_second)
    (grad2,) = torch.autograd.grad(objective2, theta1)
    theta2 = theta1.detach() - lr * grad2

    assert steps[0]["clip_frac"] == 0.0  # the first step is on-policy: ratio 1
    assert steps[1]["loss"] == pytest.approx(objective2.item(), rel=1e-5)
    assert torch.allclose(policy.theta.detach(), theta2, atol=1e-6)
    assert steps[1]["clip_frac_high"] + steps[1]["clip_frac_low"] > 0  # the clip acted
    # On-policy mode would compare with the current policy and clip nothing: a different step.
    assert not torch.allclose(
        grad2,
        torch.autograd.grad(
            _dapo_objective(theta1, second, _logprobs(theta1, second["input_ids"]).detach()), theta1
        )[0],
    )

    merged = merge_step_metrics(steps)
    tokens = [step["num_loss_tokens"] for step in steps]
    assert merged["num_optimizer_steps"] == 2 and merged["is_skipped"] == 0.0
    assert merged["num_loss_tokens"] == sum(tokens)
    expected_clip = sum(s["clip_frac"] * n for s, n in zip(steps, tokens, strict=True)) / sum(
        tokens
    )
    assert merged["clip_frac"] == pytest.approx(expected_clip)


def test_merge_counts_a_batch_as_skipped_only_when_no_step_updated():
    ran = {"loss": 1.0, "pg_loss": 1.0, "is_weight_max": 2.0, "grad_norm": 3.0, "lr": 0.1,
           "num_micro_batches": 1.0, "num_loss_tokens": 4.0, "is_skipped": 0.0}  # fmt: skip
    empty = {"loss": 0.0, "grad_norm": 0.0, "lr": 0.2, "num_micro_batches": 0.0,
             "num_loss_tokens": 0.0, "is_skipped": 1.0}  # fmt: skip
    merged = merge_step_metrics([empty, ran])
    assert merged["is_skipped"] == 0.0 and merged["num_optimizer_steps"] == 1
    assert merged["pg_loss"] == 1.0 and merged["is_weight_max"] == 2.0
    assert merged["grad_norm"] == 3.0 and merged["lr"] == 0.1
    assert merge_step_metrics([empty, empty])["is_skipped"] == 1.0
    with pytest.raises(ValueError, match="at least one"):
        merge_step_metrics([])
