"""Multi-turn rollouts with environments and tools (TRL's environment shape), token-exact.

    class GuessEnv:                       # one instance per trajectory
        def reset(self, **row) -> str | None: ...     # first user message (None: the row's)
        def guess(self, number: int) -> str:          # every public method is a tool
            '''Guess the number.

            Args:
                number: your guess
            '''
        def get_reward(self) -> float: ...            # optional, read when the episode ends

    rollout = MultiTurnRollout(engine, EnvConfig(environment=("guess.py:GuessEnv",)))
    trajectories, stats = await rollout.run(rows, SamplingParams(n=4))

Each Trajectory holds the engine's sampled ids and logprobs (loss mask 1) and, between turns,
the chat template's ids for the tool results (mask 0), never a re-tokenization of text.

A tool may return a PIL image (or image content parts) for a vision-language policy: the
observation shows it, and the trajectory carries it (env/_images.py).
"""

from yatt.rollout.env._config import EnvConfig
from yatt.rollout.env._driver import MultiTurnRollout
from yatt.rollout.env._images import ImageInputs, ToolImages
from yatt.rollout.env._parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    ParsedTurn,
    ToolCall,
    ToolParser,
    load_tool_parser,
    register_tool_parser,
)
from yatt.rollout.env._runner import (
    EnvSession,
    PoolToolRunner,
    ThreadToolRunner,
    ToolFailure,
    ToolRunner,
)
from yatt.rollout.env._tokens import ChatTokens, TemplateMismatchError
from yatt.rollout.env._tools import EnvKind, build_env_kinds
from yatt.rollout.env._trajectory import EndCause, MultiTurnStats, Trajectory

__all__ = [
    "TOOL_PARSERS",
    "ChatTokens",
    "EndCause",
    "EnvConfig",
    "EnvKind",
    "EnvSession",
    "HermesToolParser",
    "ImageInputs",
    "MultiTurnRollout",
    "MultiTurnStats",
    "ParsedTurn",
    "PoolToolRunner",
    "TemplateMismatchError",
    "ThreadToolRunner",
    "ToolCall",
    "ToolFailure",
    "ToolImages",
    "ToolParser",
    "ToolRunner",
    "Trajectory",
    "build_env_kinds",
    "load_tool_parser",
    "register_tool_parser",
]
