"""Asynchronous, crash-safe, resumable checkpoints saved along the training schedule."""

from yatt.ckpt._checkpointer import Checkpointer
from yatt.ckpt._closing import ClosingStack
from yatt.ckpt._config import CkptConfig
from yatt.ckpt._layout import CheckpointError, CheckpointInfo
from yatt.ckpt._runlock import RunLock, RunLockedError, RunLockHolder, acquire_run_lock
from yatt.ckpt._schedule import DEFAULT_STOP_SIGNALS, SaveDecision, exit_code_for_signal
from yatt.ckpt._space import CheckpointSpaceError
from yatt.ckpt._version import __version__

__all__ = [
    "DEFAULT_STOP_SIGNALS",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointSpaceError",
    "Checkpointer",
    "CkptConfig",
    "ClosingStack",
    "RunLock",
    "RunLockHolder",
    "RunLockedError",
    "SaveDecision",
    "__version__",
    "acquire_run_lock",
    "exit_code_for_signal",
]
