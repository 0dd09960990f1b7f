"""The conformance suite every rollout engine must pass (no pytest needed to import it), and
fakes of vLLM 0.26.0 and SGLang 0.5.17 for the adapters' tests."""

from yatt.rollout.testing._conformance import (
    CONFORMANCE_CHECKS,
    ConformanceTarget,
    run_conformance,
)
from yatt.rollout.testing._engine_fakes import (
    SGLANG_VERSION,
    VLLM_VERSION,
    FakeLLM,
    FakeSGLEngine,
    LocalSerializedTensor,
    VLLMLogprob,
    sglang_modules,
    vllm_modules,
)

__all__ = [
    "CONFORMANCE_CHECKS",
    "SGLANG_VERSION",
    "VLLM_VERSION",
    "ConformanceTarget",
    "FakeLLM",
    "FakeSGLEngine",
    "LocalSerializedTensor",
    "VLLMLogprob",
    "run_conformance",
    "sglang_modules",
    "vllm_modules",
]
