"""Rollout engines for RL post-training: the protocol, a built-in engine, vLLM and SGLang
adapters (imported lazily: `import yatt.rollout` needs neither), and weight sync."""

from yatt.rollout._config import EngineConfig
from yatt.rollout._engine import BuiltinEngine
from yatt.rollout._sglang import SGLangConfig, SGLangEngine
from yatt.rollout._types import (
    DEFAULT_BUCKET_BYTES,
    Completion,
    FinishReason,
    Request,
    RolloutEngine,
    SamplingParams,
)
from yatt.rollout._version import __version__
from yatt.rollout._vllm import VLLMConfig, VLLMEngine
from yatt.rollout._weights import NameMapper, iter_buckets, map_names

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BuiltinEngine",
    "Completion",
    "EngineConfig",
    "FinishReason",
    "NameMapper",
    "Request",
    "RolloutEngine",
    "SGLangConfig",
    "SGLangEngine",
    "SamplingParams",
    "VLLMConfig",
    "VLLMEngine",
    "__version__",
    "iter_buckets",
    "map_names",
]
