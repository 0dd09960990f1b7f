"""The public names of yatt.testing and its public submodules, frozen: adding, renaming or removing
one is a deliberate edit of PUBLIC_NAMES below (and of the README), never a side effect.

A module's public names are its `__all__` (else every name in dir() without a leading "_").
A new public submodule must be listed too.
"""

NUM_GPUS = 0

import sys
import types

import pytest

from yatt.testing import check_public_modules, check_public_names

PUBLIC_NAMES: dict[str, list[str]] = {
    "yatt.testing": [
        "CHAT_TEMPLATE",
        "CountingImageProcessor",
        "CountingTokenizer",
        "SignalledRun",
        "SPECIAL_TOKENS",
        "VISION_TOKENS",
        "VLM_CHAT_TEMPLATE",
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
    ],
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_public_names_are_frozen(module_name):
    check_public_names(module_name, PUBLIC_NAMES[module_name], __file__)


def test_every_public_submodule_is_frozen():
    check_public_modules("yatt.testing", PUBLIC_NAMES, __file__)


def test_a_name_added_or_removed_is_caught(monkeypatch):
    module = types.ModuleType("yatt_fake_public")
    module.__all__ = ["kept", "added"]
    module.kept = module.added = object()
    monkeypatch.setitem(sys.modules, "yatt_fake_public", module)
    with pytest.raises(AssertionError, match=r"new \['added'\], gone \['removed'\]"):
        check_public_names("yatt_fake_public", ["kept", "removed"], "the list")
    module.__all__ = ["kept", "ghost"]
    with pytest.raises(AssertionError, match="ghost"):
        check_public_names("yatt_fake_public", ["kept", "ghost"], "the list")
