"""Rollout engines for RL post-training: the protocol, a built-in engine, vLLM and SGLang
adapters (imported lazily: `import yatt.rollout` needs neither), weight sync, and
`UserCodePool`: user code (tools, reward functions) in worker processes killed whole, and
`describe_raise`: a user's exception as a one-line cause naming the user's frame.

The built-in engine's modules live in `yatt.rollout.builtin`; its two public names are here too.
"""

from yatt.rollout._capabilities import Abortable, AcceptsImages, SupportsLabelLogprobs
from yatt.rollout._engine_spec import EngineSpec, build_engine
from yatt.rollout._sglang import SGLangConfig, SGLangEngine
from yatt.rollout._types import (
    DEFAULT_BUCKET_BYTES,
    Completion,
    FinishReason,
    Request,
    RolloutEngine,
    SamplingParams,
)
from yatt.rollout._user_code import UserCodePool, UserCodeResult
from yatt.rollout._user_code_worker import describe_raise
from yatt.rollout._version import __version__
from yatt.rollout._vllm import VLLMConfig, VLLMEngine
from yatt.rollout._weights import NameMapper, iter_buckets, map_names
from yatt.rollout.builtin import AdapterBinding, BuiltinEngine, EngineConfig

# Multi-turn rollouts with environments and tools (the rest: yatt.rollout.env).
from yatt.rollout.env import EnvConfig, MultiTurnRollout, MultiTurnStats, Trajectory

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Abortable",
    "AcceptsImages",
    "AdapterBinding",
    "BuiltinEngine",
    "Completion",
    "EngineConfig",
    "EngineSpec",
    "EnvConfig",
    "FinishReason",
    "MultiTurnRollout",
    "MultiTurnStats",
    "NameMapper",
    "Request",
    "RolloutEngine",
    "SGLangConfig",
    "SGLangEngine",
    "SamplingParams",
    "SupportsLabelLogprobs",
    "Trajectory",
    "UserCodePool",
    "UserCodeResult",
    "VLLMConfig",
    "VLLMEngine",
    "__version__",
    "build_engine",
    "describe_raise",
    "iter_buckets",
    "map_names",
]
