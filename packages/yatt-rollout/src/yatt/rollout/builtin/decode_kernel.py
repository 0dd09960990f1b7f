"""The built-in engine's decode attention, public for benchmarks and for decode loops of one's own.

`triton_decode_attention` is the engine's split-K Triton kernel over its static KV cache (one
query token per row, grouped-query heads); `DecodeKernelConfig` picks its variant and tiling,
`BENCH_CONFIGS` are the candidates bench/rollout/decode_attention_gpu.py times against each other,
and `DEFAULT_CONFIG` is the one the engine runs. `sdpa_decode_attention` is the engine's PyTorch
path (SDPA with an additive mask), the reference the kernel is checked against.
"""

import torch

from yatt.rollout.builtin import _decode_kernel
from yatt.rollout.builtin._decode_kernel import (
    BENCH_CONFIGS,
    DEFAULT_CONFIG,
    LEGACY_CONFIG,
    DecodeKernelConfig,
    available,
    choose_splits,
    last_compiled,
    run_decode_attention,
    triton_decode_attention,
)
from yatt.rollout.builtin._static_kv import decode_attention as sdpa_decode_attention


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors the kernel plans its splits for (a default where no GPU says)."""
    return _decode_kernel._num_sms(device)


__all__ = [
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
]
