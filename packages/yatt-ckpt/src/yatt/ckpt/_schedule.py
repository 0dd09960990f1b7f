"""When `maybe_save` saves: step and time intervals, phase boundaries, and the stop signal."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from yatt.ckpt._config import CkptConfig


@dataclass(kw_only=True, frozen=True)
class SaveDecision:
    """What one `maybe_save` call did."""

    is_saved: bool  # a checkpoint of this step was started (and committed, if should_stop)
    should_stop: bool  # a stop signal arrived: the final save is committed, leave the loop now
    # A save was due but the previous one was still being written (when_busy="defer"): the
    # next eligible call saves instead.
    is_deferred: bool = False


class SaveSchedule:
    """Tracks the last save and a stop flag set from signal handlers."""

    def __init__(self, config: CkptConfig) -> None:
        self._config = config
        self._last_save_monotonic = time.monotonic()
        self._last_saved_step: int | None = None
        # Set from a signal handler; a plain bool read once per maybe_save is enough, because
        # Python runs handlers between bytecodes of the main thread.
        self.is_stop_requested = False
        self.is_deferred = False  # a due save waits for the writer (when_busy="defer")
        self._previous_handlers: dict[int, Any] = {}

    def note_saved(self, step: int) -> None:
        self._last_save_monotonic = time.monotonic()
        self._last_saved_step = step
        self.is_deferred = False

    def is_eligible(self, phase: str | None) -> bool:
        if not self._config.phases:
            return True
        return phase is not None and phase in self._config.phases

    def is_step_due(self, step: int) -> bool:
        every = self._config.every_steps
        return (
            every is not None and step > 0 and step % every == 0 and step != self._last_saved_step
        )

    def is_time_due(self) -> bool:
        every = self._config.every_seconds
        return every is not None and time.monotonic() - self._last_save_monotonic >= every

    def install_signal_handlers(self, signals: tuple[int, ...]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "install_signal_handlers() was called from a non-main thread; Python delivers "
                "signals only to the main thread: call it there"
            )
        for sig in signals:
            if sig not in self._previous_handlers:
                self._previous_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    @property
    def has_signal_handlers(self) -> bool:
        return bool(self._previous_handlers)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self.is_stop_requested = True
