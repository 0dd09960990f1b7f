"""Which SDPA kernels a policy's forward and backward may use.

Training shapes change every step: lengths differ, micro-batches are cut by length, and packed
sequences run one attention call per sequence. cuDNN's attention builds an execution graph for
each new shape (hundreds of ms); on an H200 a long-tail step of the 0.5B shape took up to 2.6 s
the first time its shapes were seen and 0.9 s after (bench/results/train_step_profile_nvidia_h200.md).
Flash attention (causal, no mask), memory-efficient attention (a mask) and the math fallback
build nothing per shape. The backward runs the kernel its forward chose.
"""

from __future__ import annotations

import contextlib

from torch.nn.attention import SDPBackend, sdpa_kernel

TRAIN_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def training_attention() -> contextlib.AbstractContextManager:
    """SDPA restricted to TRAIN_SDPA_BACKENDS while open (restored after)."""
    return sdpa_kernel(list(TRAIN_SDPA_BACKENDS))
