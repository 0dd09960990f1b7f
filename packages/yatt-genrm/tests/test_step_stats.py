"""StepStats (a rank's sums over a step's judged responses), VerdictWarnings and
check_verdicts (failed verdicts logged by cause, a step whose every verdict failed stops)."""

NUM_GPUS = 0

import logging

import pytest

from yatt import genrm, rollout


def _judged(index: int, reward: float, status: str = "ok", **verdict) -> genrm.JudgedSample:
    completion = rollout.Completion(
        request_index=0,
        sample_index=index,
        prompt_ids=[1],
        response_ids=[7] * (index + 1),
        logprobs=[0.0] * (index + 1),
        finish_reason="stop",
    )
    sample = genrm.Sample(prompt="3+4=", response=str(7 + index), reference="7")
    verdict = genrm.Verdict(sample_id=sample.id, reward=reward, status=status, **verdict)
    prompt = type("P", (), {"images": None})()
    return genrm.JudgedSample(completion, sample, verdict, prompt)


def test_step_stats_sum_rewards_accuracy_and_each_function_over_rounds():
    stats = genrm.StepStats()
    accuracy = genrm.AccuracySignal("exact_match", rules=[genrm.ExactMatch()])
    stats.add(
        [_judged(0, 1.0, components={"f": 1.0}), _judged(1, -1.0, components={"f": -1.0})], accuracy
    )
    failed = _judged(2, 0.0, "error", error="boom", components={"f": None})
    stats.add(
        [failed],
        accuracy,
        cut_token_ids=[7],
    )
    assert (stats.num_samples, stats.reward_sum, stats.num_verdicts) == (3, 0.0, 3)
    assert stats.num_correct == 1.0 and stats.num_accuracy_missing == 0  # only "7" is right
    assert stats.num_errors == 1 and stats.first_failure == f"sample {failed.sample.id}: boom"
    assert stats.num_response_tokens == 1 + 2 + 3 and stats.num_cut == 1
    assert stats.component_sums == {"f": [2.0, 0.0, 2.0]}  # count, sum, squares; None skipped
    assert len(stats.samples) == 3 and stats.samples[0]["reward"] == 1.0


def test_a_failure_is_logged_per_cause_and_a_step_of_only_failures_stops(caplog):
    warnings = genrm.VerdictWarnings(every_steps=10)
    some = {"genrm/verdicts": 4.0, "genrm/errors": 1.0, "genrm/unparsable": 0.0}
    with caplog.at_level(logging.WARNING):
        genrm.check_verdicts(0, some, "sample 3: boom", warnings)
        genrm.check_verdicts(1, some, "sample 5: boom", warnings)  # the same cause: quiet
        genrm.check_verdicts(2, some, "sample 5: other", warnings)  # a new one: logged
    assert caplog.text.count("verdicts failed") == 2
    every = {"genrm/verdicts": 4.0, "genrm/errors": 2.0, "genrm/unparsable": 2.0}
    with pytest.raises(RuntimeError, match=r"step 3: every one of 4 judge verdicts failed"):
        genrm.check_verdicts(3, every, "sample 1: boom", warnings)


def test_a_trajectory_is_counted_cut_only_at_a_sampled_vision_token():
    """A tool's picture puts image tokens in a trajectory's response off the loss (mask 0):
    they came with their image, so only a sampled one (mask 1) counts as a cut."""
    accuracy = genrm.AccuracySignal("exact_match", rules=[genrm.ExactMatch()])
    judged = []
    for mask in ([1, 0, 0, 1], [1, 1, 0, 1]):
        item = _judged(3, 0.0)
        trajectory = rollout.Trajectory(
            row_index=0,
            sample_index=0,
            env_name="",
            prompt_ids=[1],
            response_ids=[5, 7, 7, 5] if mask[1] == 0 else [5, 7, 6, 5],
            loss_mask=mask,
            logprobs=[0.0] * 4,
            messages=[],
            tool_calls=[],
            num_turns=2,
            end_cause="stop",
        )
        completion = genrm.TrajectoryCompletion(trajectory, 0)
        judged.append(genrm.JudgedSample(completion, item.sample, item.verdict, item.prompt))
    stats = genrm.StepStats()
    stats.add(judged, accuracy, cut_token_ids=[7])
    assert stats.num_cut == 1
