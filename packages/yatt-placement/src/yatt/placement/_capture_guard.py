"""CUDA-graph captures against device-wide synchronisation in other threads of the process.

A capture in one thread (`capture_error_mode="thread_local"`) is invalidated by a call in any
other thread that synchronises the whole device: `torch.cuda.synchronize()`, `empty_cache()`
(its cudaFree), torch_memory_saver's pause and resume, and inductor's autotuning, which
benchmarks a new kernel's configurations with device synchronisations the first time a compiled
function runs. Under partial colocation the rollout and the judge engines run in two threads
and the trainer in a third: on an H200 at 16ea75f a 1.5B judge's first capture met the 0.5B
policy engine's first compiled prefill, every verdict of the step failed, and the process
aborted at exit on the allocator's "captures_underway.empty()" assert.

`capturing()` (exclusive) and `may_sync()` (shared) order them: a capture waits until every
open may_sync section of other threads has ended and holds new ones back until it is done;
may_sync sections run side by side otherwise. The capturing thread's own may_sync sections
pass (a capture's warm-up steps run compiled code). `synchronize()` and `empty_cache()` are the
guarded forms of torch's. One guard per process, as the device is.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

_SLOW_WAIT_S = 30.0  # a wait this long is logged (what waits for what), then waits on


class CaptureGuard:
    """One capture at a time, never beside another thread's device-wide synchronisation."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._capturer: int | None = None  # the thread capturing now
        self._capture_depth = 0  # its nested capturing() sections
        self._num_waiting_captures = 0
        self._open: dict[int, int] = {}  # thread -> its open may_sync sections

    def _others_open(self, me: int) -> int:
        return sum(n for thread, n in self._open.items() if thread != me)

    def _wait(self, ready, what: str) -> None:
        start = time.monotonic()
        while not self._cond.wait_for(ready, timeout=_SLOW_WAIT_S):
            logger.warning(
                "%s has waited %.0f s (capturing thread %s, %d sync sections open elsewhere)",
                what,
                time.monotonic() - start,
                self._capturer,
                sum(self._open.values()),
            )

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Exclusive: while it is open, no other thread is inside a may_sync section."""
        me = threading.get_ident()
        with self._cond:
            if self._capturer == me:
                self._capture_depth += 1
            else:
                self._num_waiting_captures += 1
                try:
                    self._wait(
                        lambda: self._capturer is None and not self._others_open(me),
                        "a CUDA-graph capture",
                    )
                finally:
                    self._num_waiting_captures -= 1
                self._capturer, self._capture_depth = me, 1
        try:
            yield
        finally:
            with self._cond:
                self._capture_depth -= 1
                if self._capture_depth == 0:
                    self._capturer = None
                    self._cond.notify_all()

    @contextlib.contextmanager
    def may_sync(self) -> Iterator[None]:
        """Shared: code that may synchronise the device (or compile and autotune) runs here.

        It waits while another thread captures, and while one waits to (captures go first),
        unless this thread already holds a section (no deadlock on nesting)."""
        me = threading.get_ident()
        with self._cond:
            if self._capturer != me and me not in self._open:
                self._wait(
                    lambda: self._capturer is None and not self._num_waiting_captures,
                    "a device synchronisation",
                )
            self._open[me] = self._open.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._open[me] -= 1
                if not self._open[me]:
                    del self._open[me]
                    self._cond.notify_all()


_GUARD = CaptureGuard()


def capturing() -> contextlib.AbstractContextManager[None]:
    """Hold around CUDA-graph captures (torch.cuda.graph): see this module's docstring."""
    return _GUARD.capturing()


def may_sync() -> contextlib.AbstractContextManager[None]:
    """Hold around code that may synchronise the device while another thread could capture:
    the first calls of compiled functions (compile, autotune), synchronize, empty_cache."""
    return _GUARD.may_sync()


def synchronize() -> None:
    """torch.cuda.synchronize(), never during another thread's CUDA-graph capture."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        with _GUARD.may_sync():
            torch.cuda.synchronize()


def empty_cache() -> None:
    """torch.cuda.empty_cache(), never during another thread's CUDA-graph capture."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        with _GUARD.may_sync():
            torch.cuda.empty_cache()
