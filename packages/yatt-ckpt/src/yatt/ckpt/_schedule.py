"""When `maybe_save` saves: step and time intervals, phase boundaries, and the stop signal."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from yatt.ckpt._config import CkptConfig

# Signals install_signal_handlers turns into a final save by default: SIGTERM (schedulers'
# preemption notice), SIGUSR1 (Slurm's --signal), SIGINT (Ctrl-C; a second one aborts at once),
# SIGHUP (the terminal or ssh session closed: its default kills the run unsaved).
DEFAULT_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


def exit_code_for_signal(signum: int) -> int:
    """The exit status for a run stopped (after its final save) by signal `signum`: 128 +
    signum, what a shell reports for a process killed by it (SIGTERM 143, SIGINT 130, SIGUSR1
    138), so a scheduler or a script sees "stopped by that signal", not success."""
    return 128 + int(signum)


@dataclass(kw_only=True, frozen=True)
class SaveDecision:
    """What one `maybe_save` call did."""

    is_saved: bool  # a checkpoint of this step was started (and committed, if should_stop)
    should_stop: bool  # a stop signal arrived: the final save is committed, leave the loop now
    # A save was due but the previous one was still being written (when_busy="defer"): the
    # next eligible call saves instead.
    is_deferred: bool = False
    # A save was due but would not fit on the disk (Checkpointer.num_skipped_saves counts them,
    # last_skip_reason says why); the next due save tries again.
    is_skipped: bool = False
    # The signal that asked to stop (the same on every rank; the highest number when ranks got
    # different ones), None when should_stop is False.
    stop_signal: int | None = None

    @property
    def exit_code(self) -> int:
        """0, or `exit_code_for_signal(stop_signal)` after a stop signal: what the trainer's
        process should exit with once it left its loop."""
        return 0 if self.stop_signal is None else exit_code_for_signal(self.stop_signal)


class SaveSchedule:
    """Tracks the last save and a stop flag set from signal handlers."""

    def __init__(self, config: CkptConfig) -> None:
        self._config = config
        self._last_save_monotonic = time.monotonic()
        self._last_saved_step: int | None = None
        # Set from a signal handler; a plain bool read once per maybe_save is enough, because
        # Python runs handlers between bytecodes of the main thread.
        self.is_stop_requested = False
        self.stop_signal: int | None = None  # the first signal that set is_stop_requested
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
        del frame
        if signum == signal.SIGINT and self.is_stop_requested:
            # A second Ctrl-C: the user does not want to wait for the final save.
            raise KeyboardInterrupt
        self.is_stop_requested = True
        if self.stop_signal is None:
            self.stop_signal = signum
