"""Shared test helpers for the yatt packages: tiny local models and tokenizers, rank launchers,
the frozen-public-names checks, spies that count work, a native-thread lister, a command
stopped by a signal at a given point."""

from yatt.testing._public_names import check_public_modules, check_public_names
from yatt.testing._ranks import free_port, run_rank_script, run_ranks
from yatt.testing._signals import SignalledRun, signal_when_ready
from yatt.testing._spies import CountingImageProcessor, CountingTokenizer
from yatt.testing._threads import native_threads
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
    "CountingImageProcessor",
    "CountingTokenizer",
    "SignalledRun",
    "__version__",
    "check_public_modules",
    "check_public_names",
    "free_port",
    "make_tiny_causal_lm",
    "make_tiny_vlm",
    "make_tokenizer",
    "native_threads",
    "run_rank_script",
    "run_ranks",
    "signal_when_ready",
]
