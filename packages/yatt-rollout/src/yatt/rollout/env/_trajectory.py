"""What a multi-turn rollout gives back: trajectories and the counts a step logs."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from yatt.rollout.env._images import ImageInputs
from yatt.rollout.env._parsers import ToolCall

# Why a trajectory ended:
#   stop                   the model answered without calling a tool
#   max_turns              EnvConfig.max_turns turns were generated (the last one's tools ran)
#   max_trajectory_tokens  the next turn or observation would not fit EnvConfig.max_trajectory_tokens
#   length                 a turn reached SamplingParams.max_new_tokens without ending
#   env_ended              the environment set `done = True` in a tool
#   abort                  the engine aborted the turn
#   template_mismatch      the chat template does not close turns with the token the engine stopped at
#                          (or wrote another number of image placeholders than there are images)
#   image_token            a vision-language policy sampled an image token (no image follows it:
#                          the turn is kept up to it)
EndCause = Literal[
    "stop",
    "max_turns",
    "max_trajectory_tokens",
    "length",
    "env_ended",
    "abort",
    "template_mismatch",
    "image_token",
]


@dataclass(kw_only=True)
class Trajectory:
    """One sampled conversation, token-exact.

    The trained sequence is prompt_ids + response_ids. response_ids holds every turn the engine
    sampled and, between turns, the template's and tools' ids:
        response_ids  [turn 1 sampled][\\n<|im_start|>user<tool_response>..</..><|im_start|>assistant\\n][turn 2 sampled]
        loss_mask     [1 1 ... 1      ][0 0 ...                                                      0][1 1 ... 1     ]
        logprobs      [engine's       ][0.0 ...                                                    0.0][engine's      ]
    """

    row_index: int  # the row's position in the call's rows
    sample_index: int  # 0 .. n-1 within the row's group
    env_name: str  # the environment class ("" for tools only)
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    messages: list[dict[str, Any]]  # the conversation, as chat messages
    tool_calls: list[list[ToolCall]]  # per turn, as the model wrote them
    num_turns: int
    end_cause: EndCause
    env_reward: float | None = None  # get_reward(), when the environment has one and it answered
    row: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None  # the engine session its turns shared (Request.session_id)
    # Its images, in the order of their token runs in prompt_ids + response_ids (the first
    # messages' images, then the tools' results'): raw (PIL), and processed for a Qwen2-VL-family
    # model (None without images; core.VisionInputs(*image_inputs) is the trainer's form).
    images: list[Any] = field(default_factory=list)
    image_inputs: ImageInputs | None = None

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def finish_reason(self) -> str:
        """As a Completion's (yatt.core.rollout_samples reads it): "length" when the
        trajectory was cut at a token limit (no end: DAPO's overlong rules apply), "abort" when
        the engine aborted it, else "stop"."""
        if self.end_cause in ("length", "max_trajectory_tokens"):
            return "length"
        return "abort" if self.end_cause == "abort" else "stop"


@dataclass
class MultiTurnStats:
    """Counts over one rollout call (or several: `merge`); `as_metrics` flattens them."""

    num_trajectories: int = 0
    num_reset_errors: int = 0  # rows skipped: reset raised or timed out
    num_unrouted: int = 0  # rows skipped: no environment of the routed name
    num_bad_rows: int = 0  # rows skipped: no messages or prompt, and reset gave none
    num_tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)  # cause -> count
    end_causes: Counter = field(default_factory=Counter)
    turns: list[int] = field(default_factory=list)
    num_template_rewrites: int = 0  # an earlier turn rendered differently later (see _tokens)
    num_reward_errors: int = 0  # get_reward raised or timed out

    def merge(self, other: MultiTurnStats) -> None:
        self.num_trajectories += other.num_trajectories
        self.num_reset_errors += other.num_reset_errors
        self.num_unrouted += other.num_unrouted
        self.num_bad_rows += other.num_bad_rows
        self.num_tool_calls += other.num_tool_calls
        self.tool_errors.update(other.tool_errors)
        self.end_causes.update(other.end_causes)
        self.turns += other.turns
        self.num_template_rewrites += other.num_template_rewrites
        self.num_reward_errors += other.num_reward_errors

    def as_metrics(self, prefix: str = "multiturn/") -> dict[str, float]:
        turns = self.turns
        metrics = {
            "num_trajectories": self.num_trajectories,
            "num_reset_errors": self.num_reset_errors,
            "num_unrouted": self.num_unrouted,
            "num_bad_rows": self.num_bad_rows,
            "num_tool_calls": self.num_tool_calls,
            "num_tool_errors": sum(self.tool_errors.values()),
            "turns_mean": sum(turns) / len(turns) if turns else 0.0,
            "turns_max": max(turns, default=0),
            "num_template_rewrites": self.num_template_rewrites,
            "num_reward_errors": self.num_reward_errors,
        }
        metrics.update({f"tool_errors/{k}": v for k, v in sorted(self.tool_errors.items())})
        metrics.update({f"end/{k}": v for k, v in sorted(self.end_causes.items())})
        return {prefix + k: float(v) for k, v in metrics.items()}
