"""Shared test helpers for the yatt packages: tiny local models and tokenizers, rank launchers."""

from yatt.testing._ranks import free_port, run_ranks
from yatt.testing._tiny import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    VISION_TOKENS,
    VLM_CHAT_TEMPLATE,
    make_tiny_causal_lm,
    make_tiny_vlm,
    make_tokenizer,
)
from yatt.testing._version import __version__

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "VISION_TOKENS",
    "VLM_CHAT_TEMPLATE",
    "__version__",
    "free_port",
    "make_tiny_causal_lm",
    "make_tiny_vlm",
    "make_tokenizer",
    "run_ranks",
]
