"""Multi-turn trajectories judged as one round: each yatt.rollout.Trajectory as the Completion
a trainer turns into a training sample, and its reward.

    judged = score_trajectories(trajectories, prompts, scorer, answer_key="answer",
                                env_reward_weight=1.0)      # list[JudgedSample]
    core.rollout_samples([j.completion for j in judged], ...)  # loss on sampled tokens only

The reward of a trajectory: the scorer (a judge over trajectory_sample's transcript, reward
functions over the whole trajectory, rules) plus env_reward_weight x the environment's
get_reward() (0 when it has none or it failed); the environment's reward is also a verdict
component ("env_reward").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from yatt.genrm._judged_round import JudgedSample
from yatt.genrm._trajectory import trajectory_sample
from yatt.genrm._types import Verdict
from yatt.rollout import Trajectory


@dataclass(frozen=True)
class TrajectoryCompletion:
    """A multi-turn trajectory as a rollout Completion: its turns and the tool results between
    them in response_ids, with its loss_mask (0 on tool/template tokens) that
    yatt.core.rollout_samples keeps."""

    trajectory: Trajectory
    request_index: int  # the row's position in the round: its GRPO group

    prompt_ids = property(lambda self: self.trajectory.prompt_ids)
    response_ids = property(lambda self: self.trajectory.response_ids)
    logprobs = property(lambda self: self.trajectory.logprobs)
    loss_mask = property(lambda self: self.trajectory.loss_mask)
    finish_reason = property(lambda self: self.trajectory.finish_reason)
    sample_index = property(lambda self: self.trajectory.sample_index)


def score_trajectories(
    trajectories: Sequence[Trajectory],
    prompts: Sequence[Any],
    scorer: Any | None,
    *,
    answer_key: str,
    env_reward_weight: float,
    should_stop: Callable[[], bool] | None = None,
) -> list[JudgedSample]:
    """Each trajectory judged: `scorer` (None: no reward but the environment's) over
    trajectory_sample's view (its reference: the row's `answer_key`, as text) plus
    env_reward_weight x its environment's reward. prompts[t.row_index] is the prompt object
    of trajectory t (its `.row` the data row), carried back in each JudgedSample.
    should_stop (None: not read): polled while the scorer works, ScoringStopped once true."""
    samples = [
        trajectory_sample(t, reference=_reference(prompts[t.row_index].row, answer_key))
        for t in trajectories
    ]
    verdicts = None
    if scorer is not None and samples:
        verdicts = scorer.score(samples, should_stop=should_stop)
    judged = []
    for i, (trajectory, sample) in enumerate(zip(trajectories, samples, strict=True)):
        env_part = env_reward_weight * (trajectory.env_reward or 0.0)
        if verdicts is None:
            verdict = Verdict(
                sample_id=sample.id,
                reward=env_part,
                status="ok",
                components={"env_reward": trajectory.env_reward},
            )
        else:
            verdict = dataclasses.replace(
                verdicts[i],
                reward=verdicts[i].reward + env_part,
                components={**verdicts[i].components, "env_reward": trajectory.env_reward},
            )
        completion = TrajectoryCompletion(trajectory, request_index=trajectory.row_index)
        judged.append(JudgedSample(completion, sample, verdict, prompts[trajectory.row_index]))
    return judged


def _reference(row: dict, answer_key: str) -> str | None:
    answer = row.get(answer_key) if answer_key else None
    return None if answer is None else str(answer)
