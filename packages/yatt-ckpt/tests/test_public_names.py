"""The public names of yatt.ckpt and its public submodules, frozen: adding, renaming or removing
one is a deliberate edit of PUBLIC_NAMES below (and of the README), never a side effect.

A module's public names are its `__all__` (else every name in dir() without a leading "_").
A new public submodule must be listed too.
"""

NUM_GPUS = 0

import importlib
import pkgutil

import pytest

PUBLIC_NAMES: dict[str, list[str]] = {
    "yatt.ckpt": [
        "CheckpointError",
        "CheckpointInfo",
        "Checkpointer",
        "CkptConfig",
        "DEFAULT_STOP_SIGNALS",
        "RunLock",
        "RunLockHolder",
        "RunLockedError",
        "SaveDecision",
        "__version__",
        "acquire_run_lock",
        "exit_code_for_signal",
    ],
}


def _public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in dir(module) if not n.startswith("_")]
    return sorted(names)


def _how_to_fix(what: str) -> str:
    return f"{what}; if that is deliberate, edit PUBLIC_NAMES in {__file__} to match"


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_public_names_are_frozen(module_name):
    module = importlib.import_module(module_name)
    got, frozen = set(_public_names(module)), set(PUBLIC_NAMES[module_name])
    added, removed = sorted(got - frozen), sorted(frozen - got)
    assert not (added or removed), _how_to_fix(
        f"{module_name}'s public names changed: new {added}, gone {removed}"
    )
    missing = sorted(n for n in got if not hasattr(module, n))
    assert not missing, f"{module_name}.__all__ lists {missing}, which it does not define"


def test_every_public_submodule_is_frozen():
    top = importlib.import_module("yatt.ckpt")
    found = {"yatt.ckpt"}
    for info in pkgutil.walk_packages(top.__path__, "yatt.ckpt."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            found.add(info.name)
    unlisted, gone = sorted(found - set(PUBLIC_NAMES)), sorted(set(PUBLIC_NAMES) - found)
    assert not (unlisted or gone), _how_to_fix(
        f"public modules not in PUBLIC_NAMES: {unlisted}; listed but gone: {gone}"
    )
