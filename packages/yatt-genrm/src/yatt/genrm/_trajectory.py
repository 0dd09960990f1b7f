"""Judging multi-turn trajectories: a trajectory as a judge Sample, and rules over it.

    Trajectory --trajectory_sample--> Sample(prompt = the task,
                                             response = the transcript: turns, calls, results,
                                             metadata = messages, tool_calls, env_reward, ...)
                 --> any JudgeTemplate ({prompt}, {response}; trajectory_template() by default)
                 --> CombinedRM(judge, [(EnvReward(), w), (TrajectoryReward(fn), w), ...])

So a trajectory's reward combines the environment's get_reward, functions of the whole
trajectory and the GenRM's verdict by weights, exactly as single-turn rewards are combined
(with_env_reward: the rule, written once for the round and the streamed paths). A trajectory
trains as a TrajectoryCompletion (a Completion with its own loss mask).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from yatt.genrm._templates import JudgeTemplate
from yatt.genrm._types import Sample, Verdict
from yatt.rollout import Trajectory

_TRAJECTORY_USER = (
    "Task:\n{prompt}\n\n"
    "The agent's transcript (its turns, tool calls and tool results):\n{response}\n\n"
    "Did the agent complete the task correctly? Reply with one word: Yes or No."
)
_TRAJECTORY_USER_REFERENCE = (
    "Task:\n{prompt}\n\n"
    "Reference answer:\n{reference}\n\n"
    "The agent's transcript (its turns, tool calls and tool results):\n{response}\n\n"
    "Is the agent's final answer correct (equivalent to the reference answer)? "
    "Reply with one word: Yes or No."
)


def trajectory_template(*, with_reference: bool = False, **kwargs: Any) -> JudgeTemplate:
    """A judge template for `trajectory_sample`s (kwargs: other JudgeTemplate fields)."""
    user = _TRAJECTORY_USER_REFERENCE if with_reference else _TRAJECTORY_USER
    return JudgeTemplate(user=user, **kwargs)


def trajectory_sample(
    trajectory: Any,
    *,
    reference: str | None = None,
    max_result_chars: int = 2000,
    sample_id: str | None = None,
) -> Sample:
    """The judge's view of a yatt.rollout.Trajectory (or anything with `messages`).

    prompt: the messages before the first assistant turn (system and user text). response:
    every later message as a transcript; a tool result longer than `max_result_chars` is cut.
    metadata: messages, tool_calls (per turn: name, arguments, error), num_turns, end_cause,
    env_reward, for rules (TrajectoryReward, EnvReward) and template fields.
    """
    messages = list(trajectory.messages)
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    prompt = "\n\n".join(_text(m) for m in messages[:first])
    response = "\n\n".join(_transcript_line(m, max_result_chars) for m in messages[first:])
    calls = [
        [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in turn]
        for turn in getattr(trajectory, "tool_calls", [])
    ]
    metadata = {
        "messages": messages,
        "tool_calls": calls,
        "num_turns": getattr(trajectory, "num_turns", None),
        "end_cause": getattr(trajectory, "end_cause", None),
        "env_reward": getattr(trajectory, "env_reward", None),
        "row": getattr(trajectory, "row", {}),
    }
    kwargs = {} if sample_id is None else {"id": sample_id}
    return Sample(
        prompt=prompt, response=response, reference=reference, metadata=metadata, **kwargs
    )


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # multimodal parts: the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _transcript_line(message: dict[str, Any], max_result_chars: int) -> str:
    role = message.get("role")
    text = _text(message)
    if role == "assistant":
        lines = [f"[assistant]\n{text}" if text else "[assistant]"]
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            arguments = json.dumps(function.get("arguments", {}), ensure_ascii=False)
            lines.append(f"[calls {function.get('name')}({arguments})]")
        return "\n".join(lines)
    if role == "tool":
        if len(text) > max_result_chars:
            text = text[:max_result_chars] + " ...[cut]"
        name = message.get("name")
        return f"[tool result{' of ' + name if name else ''}]\n{text}"
    return f"[{role}]\n{text}"


class EnvReward:
    """A rule: the environment's get_reward() (None when it has none or it failed)."""

    name = "env_reward"

    def verify(self, sample: Sample) -> float | None:
        return sample.metadata.get("env_reward")


class TrajectoryReward:
    """A rule from `fn(messages, tool_calls, row) -> float | None` over the whole trajectory
    (a trajectory_sample's metadata): e.g. a penalty per failed tool call."""

    def __init__(self, fn: Callable[..., float | None], *, name: str | None = None) -> None:
        if not callable(fn):
            raise ValueError(f"TrajectoryReward: {fn!r} is not callable")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "trajectory_reward")

    def verify(self, sample: Sample) -> float | None:
        meta = sample.metadata
        if "messages" not in meta:
            raise ValueError("the sample is not a trajectory_sample (no metadata['messages'])")
        return self.fn(meta["messages"], meta.get("tool_calls", []), meta.get("row", {}))


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


def with_env_reward(
    verdict: Verdict | None, sample: Any, env_reward: float | None, weight: float
) -> Verdict:
    """The scorer's verdict (None: no scorer) plus weight x the environment's reward (0 when
    it has none), which is also its "env_reward" component: the rule written once for the
    round and the streamed paths."""
    env_part = weight * (env_reward or 0.0)
    if verdict is None:
        return Verdict(
            sample_id=sample.id,
            reward=env_part,
            status="ok",
            components={"env_reward": env_reward},
        )
    return dataclasses.replace(
        verdict,
        reward=verdict.reward + env_part,
        components={**verdict.components, "env_reward": env_reward},
    )


def trajectory_reference(row: dict, answer_key: str) -> str | None:
    """The judge's reference for a row: its `answer_key` field as text (None without)."""
    answer = row.get(answer_key) if answer_key else None
    return None if answer is None else str(answer)
