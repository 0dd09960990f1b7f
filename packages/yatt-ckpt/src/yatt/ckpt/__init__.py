"""Asynchronous, crash-safe, resumable checkpoints saved along the training schedule."""

from yatt.ckpt._checkpointer import Checkpointer
from yatt.ckpt._config import CkptConfig
from yatt.ckpt._layout import CheckpointError, CheckpointInfo
from yatt.ckpt._schedule import SaveDecision
from yatt.ckpt._version import __version__

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "CkptConfig",
    "SaveDecision",
    "__version__",
]
