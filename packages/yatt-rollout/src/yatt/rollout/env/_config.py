"""The multi-turn rollout's config: which environment or tools, and the limits of a trajectory."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

# apply_chat_template's own arguments, which the token layer sets: not template variables.
RESERVED_TEMPLATE_ARGS = frozenset(
    {"conversation", "messages", "add_generation_prompt", "tokenize", "tools", "chat_template"}
)


@dataclass(kw_only=True)
class EnvConfig:
    """Environments and tools for multi-turn rollouts; validated when built (no model loaded).

    `environment` and `tools` are specs: "path/to/file.py:Name" or "package.module:Name". Give an
    environment class (one instance per trajectory: `reset(**row)`, public methods as tools,
    optional `get_reward()`), plain function tools, or both (the functions join every
    environment's tools). Several environments: list them and name the row field that picks
    one (`route_key`); the field's value is the class name.
    """

    # Environment class spec(s); () with `tools` set: a tool-only rollout (no env state).
    # Both empty (the default): no multi-turn rollout is configured.
    environment: tuple[str, ...] = ()
    # Plain function tools, as specs; they join every environment's methods.
    tools: tuple[str, ...] = ()
    # Assistant turns (generations) per trajectory; the last turn's tool calls still run.
    max_turns: int = 4
    # Prompt + every turn + every observation, in tokens; a turn is cut to fit it.
    max_trajectory_tokens: int = 2048
    # Seconds one tool call (or reset/get_reward) may take; then it is an error observation.
    tool_timeout_s: float = 10.0
    # A tool's output is cut to this many UTF-8 bytes, then to this many tokens.
    max_tool_output_bytes: int = 8192
    max_tool_output_tokens: int = 512
    # How tool calls are read from the model's text: a name in TOOL_PARSERS ("hermes": the
    # Qwen2.5/Qwen3/Hermes <tool_call>{json}</tool_call> format) or a "file.py:Class" spec.
    tool_parser: str = "hermes"
    # The row field naming the environment class when several are listed ("" with one).
    route_key: str = ""
    # The chat template's own variables, given at every rendering of a trajectory (its first
    # prompt and each turn's appended ids), e.g. {"enable_thinking": False} (Qwen3): what the
    # prompt encoder gives single-turn prompts (core.PromptEncoder(chat_template_kwargs=...)).
    chat_template_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.environment = _as_tuple(self.environment, "environment")
        self.tools = _as_tuple(self.tools, "tools")
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int):
            raise ValueError(f"EnvConfig.max_turns={self.max_turns!r}: must be an int >= 1")
        if self.max_turns < 1:
            raise ValueError(
                f"EnvConfig.max_turns={self.max_turns!r}: must be >= 1 (1 is a single turn "
                "whose tool calls still run)"
            )
        for name in ("max_trajectory_tokens", "max_tool_output_bytes", "max_tool_output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EnvConfig.{name}={value!r}: must be an int >= 1")
        if not math.isfinite(self.tool_timeout_s) or self.tool_timeout_s <= 0:
            raise ValueError(
                f"EnvConfig.tool_timeout_s={self.tool_timeout_s!r}: must be a finite number of "
                "seconds > 0"
            )
        if len(self.environment) > 1 and not self.route_key:
            raise ValueError(
                f"EnvConfig.route_key='' with {len(self.environment)} environments: name the "
                "row field whose value is the environment class to use"
            )
        kwargs = self.chat_template_kwargs
        if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
            raise ValueError(
                f"EnvConfig.chat_template_kwargs={kwargs!r}: must be a mapping of the chat "
                'template\'s variables (names as keys), e.g. {"enable_thinking": False}'
            )
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_ARGS)
        if reserved:
            raise ValueError(
                f"EnvConfig.chat_template_kwargs={dict(kwargs)!r}: {reserved} are set by the "
                "token layer itself; give only the template's own variables"
            )
        self.chat_template_kwargs = dict(kwargs)
        # Imported here: the parser registry lives with the parsers.
        from yatt.rollout.env._parsers import load_tool_parser

        load_tool_parser(self.tool_parser)


def _as_tuple(value: object, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,) if value else ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"EnvConfig.{name}={value!r}: must be a spec string or a list of them")
    return tuple(value)
