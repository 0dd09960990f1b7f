"""LearningGuard stops a run whose steps update nothing, fed by what sample_dynamically and the
shared train step really return when every group is solved (or unsolvable) alike."""

import types

import pytest

from yatt.core import Batch, LearningGuard, NoLearningError, PolicyLoss, sample_dynamically
from yatt.core.policy._train_step import StepCounts, run_train_step

NUM_GPUS = 0


def _constant_reward_round(num_missing):
    """Every sample of every prompt gets reward 0: no group has variance."""
    rows = [
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "group_id": g, "reward": 0.0}
        for g in range(max(num_missing, 1))
        for _ in range(2)
    ]
    return Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])


def _idle_step():
    """(train metrics, sampling stats) of a step where dynamic sampling kept nothing."""
    batch, sampling_stats = sample_dynamically(_constant_reward_round, num_groups=2, max_rounds=2)
    assert len(batch) == 0
    # An empty batch never reaches the model.
    backend = types.SimpleNamespace(dp_group=None, dp_size=1)
    train_metrics = run_train_step(
        backend,
        batch,
        PolicyLoss(is_on_policy=True),
        counts=StepCounts(),
        lr_at=lambda step: 0.1,
        max_grad_norm=None,
    )
    return train_metrics, sampling_stats


def test_consecutive_idle_steps_raise_at_the_limit_and_name_the_cause():
    train_metrics, sampling_stats = _idle_step()
    guard = LearningGuard(max_idle_steps=3)
    for step in (0, 1):
        guard.update(step, train_metrics, sampling_stats)
        guard.check(step)
    assert guard.metrics() == {"train/idle_steps_in_a_row": 2.0, "train/idle_steps": 2.0}
    guard.update(2, train_metrics, sampling_stats)
    assert guard.metrics()["train/idle_steps_in_a_row"] == 3.0  # counted before the raise
    with pytest.raises(NoLearningError, match=r"step 2: 3 steps in a row.*reward variance"):
        guard.check(2)


def test_an_update_restarts_the_count():
    idle, sampling_stats = _idle_step()
    updated = {**idle, "is_skipped": 0.0}
    guard = LearningGuard(max_idle_steps=2)
    for step in range(10):  # idle, updated, idle, updated...: never two in a row
        guard.update(step, idle if step % 2 == 0 else updated, sampling_stats)
        guard.check(step)
    assert guard.num_idle_steps == 0 and guard.num_idle_steps_total == 5  # step 9 updated


def test_solved_steps_are_not_failures():
    train_metrics, sampling_stats = _idle_step()
    guard = LearningGuard(max_idle_steps=2)
    for step in range(10):  # every sample right: nothing to learn from, nothing wrong either
        guard.update(step, train_metrics, sampling_stats, is_solved=True)
        guard.check(step)
    assert guard.num_idle_steps == 0
    guard.update(10, train_metrics, sampling_stats)
    guard.update(11, train_metrics, sampling_stats)
    with pytest.raises(NoLearningError):
        guard.check(11)


def test_a_skipped_optimizer_step_is_named_as_such():
    guard = LearningGuard(max_idle_steps=1)
    metrics = {"is_skipped": 1.0, "loss": float("nan"), "grad_norm": 3.0, "num_loss_tokens": 8.0}
    guard.update(7, metrics, {"num_groups_kept": 2.0, "num_groups_generated": 2.0})
    with pytest.raises(NoLearningError, match=r"optimizer step was skipped.*loss=nan"):
        guard.check(7)


def test_zero_turns_it_off_and_bad_limits_are_refused():
    train_metrics, sampling_stats = _idle_step()
    guard = LearningGuard(max_idle_steps=0)
    for step in range(100):
        guard.update(step, train_metrics, sampling_stats)
        guard.check(step)
    assert guard.num_idle_steps == 100
    with pytest.raises(ValueError, match=">= 0"):
        LearningGuard(max_idle_steps=-1)
    with pytest.raises(TypeError, match="int"):
        LearningGuard(max_idle_steps="20")
    with pytest.raises(KeyError, match="is_skipped"):
        LearningGuard().update(0, {"loss": 1.0})
