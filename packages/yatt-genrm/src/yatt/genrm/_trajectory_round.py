"""Multi-turn trajectories judged as one round: each yatt.rollout.Trajectory as the Completion
a trainer turns into a training sample, and its reward.

    judged = score_trajectories(trajectories, prompts, scorer, answer_key="answer",
                                env_reward_weight=1.0)      # list[JudgedSample]
    core.rollout_samples([j.completion for j in judged], ...)  # loss on sampled tokens only
    judged, turn_stats = judge_trajectories(multiturn, rows, prompts, sampling, scorer=...,
                                            plan=plan, timings=timings, ...)  # a whole round

The reward of a trajectory: the scorer (a judge over trajectory_sample's transcript, reward
functions over the whole trajectory, rules) plus env_reward_weight x the environment's
get_reward() (0 when it has none or it failed); the environment's reward is also a verdict
component ("env_reward").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from yatt.genrm._judged_round import JudgedSample, _timed
from yatt.genrm._trajectory import (
    TrajectoryCompletion,
    trajectory_reference,
    trajectory_sample,
    with_env_reward,
)
from yatt.genrm._trajectory_stream import TrajectoryStream
from yatt.genrm._types import Scorer
from yatt.rollout import SamplingParams, Trajectory


def score_trajectories(
    trajectories: Sequence[Trajectory],
    prompts: Sequence[Any],
    scorer: Scorer | None,
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
        trajectory_sample(t, reference=trajectory_reference(prompts[t.row_index].row, answer_key))
        for t in trajectories
    ]
    verdicts = None
    if scorer is not None and samples:
        verdicts = scorer.score(samples, should_stop=should_stop)
    judged = []
    for i, (trajectory, sample) in enumerate(zip(trajectories, samples, strict=True)):
        verdict = with_env_reward(
            None if verdicts is None else verdicts[i],
            sample,
            trajectory.env_reward,
            env_reward_weight,
        )
        completion = TrajectoryCompletion(trajectory, request_index=trajectory.row_index)
        judged.append(JudgedSample(completion, sample, verdict, prompts[trajectory.row_index]))
    return judged


def judge_trajectories(
    multiturn: Any,
    rows: Sequence[dict],
    prompts: Sequence[Any],
    sampling: SamplingParams,
    *,
    scorer: Scorer | None,
    plan: Any,
    timings: dict[str, float],
    answer_key: str,
    env_reward_weight: float,
    should_stop: Callable[[], bool] | None = None,
    should_overlap: bool = False,
    judge_engine: Any = None,
) -> tuple[list[JudgedSample], Any]:
    """One multi-turn round: `rows` (what each environment's reset(**row) reads; rows[i] is
    prompts[i]'s) run as sampling.n trajectories each by `multiturn` (a
    yatt.rollout.MultiTurnRollout) in the plan's "rollout" phase, then judged
    (score_trajectories) in its "genrm" phase (outside any phase for a plan without one), each
    phase timed into `timings`. should_overlap (rollout and judge resident together: partial
    colocation): one "rollout+genrm" phase instead, each trajectory judged as soon as it ends
    while the others are still in their tool loops (TrajectoryStream; judge_engine aborted if
    a stop cuts it). A row with fewer than sampling.n trajectories (its reset failed) is
    dropped: a GRPO group must be whole. Returns (the whole groups' JudgedSamples by (row,
    sample), the round's yatt.rollout.MultiTurnStats); ScoringStopped once should_stop() turns
    true while the judge works."""
    if should_overlap:

        async def judge_as_they_end() -> tuple[list[JudgedSample], Any]:
            stream = TrajectoryStream(
                multiturn=multiturn,
                scorer=scorer,
                sampling=sampling,
                to_row=lambda index: rows[index],
                answer_key=answer_key,
                env_reward_weight=env_reward_weight,
                judge_engine=judge_engine,
            )
            judged = await stream.judge_all(range(len(rows)), should_stop=should_stop)
            # the payload was the row's index: carry its prompt object back
            judged = [dataclasses.replace(j, prompt=prompts[j.prompt]) for j in judged]
            return judged, stream.turn_stats

        with _timed(timings, "rollout+genrm"), plan.phase("rollout"):
            return asyncio.run(judge_as_they_end())
    with _timed(timings, "rollout"), plan.phase("rollout"):
        trajectories, turn_stats = asyncio.run(multiturn.run(list(rows), sampling))
    judge_phase = plan.phase("genrm") if "genrm" in plan.phases else contextlib.nullcontext()
    with _timed(timings, "genrm"), judge_phase:
        judged = score_trajectories(
            trajectories,
            prompts,
            scorer,
            answer_key=answer_key,
            env_reward_weight=env_reward_weight,
            should_stop=should_stop,
        )
    counts: dict[int, int] = {}
    for item in judged:
        counts[item.completion.request_index] = counts.get(item.completion.request_index, 0) + 1
    whole = [item for item in judged if counts[item.completion.request_index] == sampling.n]
    return whole, turn_stats
