"""The public names of yatt.ckpt and its public submodules, frozen: adding, renaming or removing
one is a deliberate edit of PUBLIC_NAMES below (and of the README), never a side effect.

A module's public names are its `__all__` (else every name in dir() without a leading "_").
A new public submodule must be listed too.
"""

NUM_GPUS = 0

import pytest

from yatt.testing import check_public_modules, check_public_names

PUBLIC_NAMES: dict[str, list[str]] = {
    "yatt.ckpt": [
        "CheckpointError",
        "CheckpointInfo",
        "CheckpointSpaceError",
        "Checkpointer",
        "CkptConfig",
        "ClosingStack",
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


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_public_names_are_frozen(module_name):
    check_public_names(module_name, PUBLIC_NAMES[module_name], __file__)


def test_every_public_submodule_is_frozen():
    check_public_modules("yatt.ckpt", PUBLIC_NAMES, __file__)
