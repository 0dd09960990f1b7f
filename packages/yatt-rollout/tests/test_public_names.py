"""The public names of yatt.rollout and its public submodules, frozen: adding, renaming or removing
one is a deliberate edit of PUBLIC_NAMES below (and of the README), never a side effect.

A module's public names are its `__all__` (else every name in dir() without a leading "_").
A new public submodule must be listed too.
"""

NUM_GPUS = 0

import pytest

from yatt.testing import check_public_modules, check_public_names

PUBLIC_NAMES: dict[str, list[str]] = {
    "yatt.rollout": [
        "Abortable",
        "AcceptsImages",
        "AdapterBinding",
        "BuiltinEngine",
        "Completion",
        "DEFAULT_BUCKET_BYTES",
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
    ],
    "yatt.rollout.builtin": [
        "AdapterBinding",
        "BuiltinEngine",
        "EngineConfig",
        "sample_tokens",
    ],
    "yatt.rollout.builtin.decode_kernel": [
        "BENCH_CONFIGS",
        "DEFAULT_CONFIG",
        "LEGACY_CONFIG",
        "DecodeKernelConfig",
        "available",
        "choose_splits",
        "last_compiled",
        "num_sms",
        "run_decode_attention",
        "sdpa_decode_attention",
        "triton_decode_attention",
    ],
    "yatt.rollout.env": [
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
        "TOOL_PARSERS",
        "TemplateMismatchError",
        "ThreadToolRunner",
        "ToolCall",
        "ToolFailure",
        "ToolParser",
        "ToolImages",
        "ToolRunner",
        "Trajectory",
        "build_env_kinds",
        "load_tool_parser",
        "register_tool_parser",
    ],
    "yatt.rollout.env.testing": [
        "COMPACT_TOOL_TEMPLATE",
        "QWEN25_TOOL_TEMPLATE",
        "QWEN2_VL_CHAT_TEMPLATE",
        "QWEN3_TOOL_TEMPLATE",
        "ScriptedEngine",
        "TOOL_TOKENS",
    ],
    "yatt.rollout.testing": [
        "CONFORMANCE_CHECKS",
        "ConformanceTarget",
        "FakeLLM",
        "FakeSGLEngine",
        "LocalSerializedTensor",
        "SGLANG_VERSION",
        "VLLMLogprob",
        "VLLM_VERSION",
        "run_conformance",
        "sglang_modules",
        "vllm_modules",
    ],
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_public_names_are_frozen(module_name):
    check_public_names(module_name, PUBLIC_NAMES[module_name], __file__)


def test_every_public_submodule_is_frozen():
    check_public_modules("yatt.rollout", PUBLIC_NAMES, __file__)
