"""One engine, many callers: compatible calls join the running loop, everything else takes turns.

    call --compatible loop running?--yes--> its items join the loop's pending list; wait
       |                                         (admitted into free slots at the next check)
       no
       v
    wait until the engine is free --> lead: begin a loop, drive it until no call has work left

A call is compatible with the running loop when it samples the way the loop was configured
(temperature, top-p, top-k, stop ids with EOS handling: the per-slot settings the runner fills
once per loop); n, seed and max_new_tokens are per sample already. Everything else (an
incompatible call, update_weights, sleep, wake_up, close) waits until the engine is free, and
while such a waiter is queued no call joins, so joiners cannot starve it.

The loop is driven by one calling thread at a time. When the driver's own call is done but other
calls still have samples, it hands the loop to one of their (waiting) threads and returns, so
every call returns as soon as its own samples are done. Ending the loop is decided under the
same lock a joiner takes, so a call arriving just then either joins (and is served) or finds no
loop and starts its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

from yatt.rollout.builtin._batcher import WorkItem
from yatt.rollout.builtin._host_loop import Call, SlotLoop

# (after_caller) -> the context every driving thread enters (device, stream, no_grad)
Scope = Callable[..., AbstractContextManager]


@dataclass(eq=False, kw_only=True)
class _Session:
    signature: Hashable  # what a call must match to join
    loop: SlotLoop
    driver: Call  # whose thread runs the loop now
    calls: list[Call]  # not yet done
    pending: list[WorkItem] = field(default_factory=list)  # joined, not yet in the loop's queue


class CallScheduler:
    """Runs an engine's calls: joins compatible ones into the running loop (if allowed)."""

    def __init__(self, *, should_join: bool) -> None:
        self.should_join = should_join
        self._cond = threading.Condition()  # guards every field below
        self._is_busy = False  # a loop runs or an exclusive operation holds the engine
        self._session: _Session | None = None
        # Signatures of waiters for a free engine (None: an exclusive operation).
        self._waiting: list[Hashable] = []
        self.num_joined_calls = 0

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine alone, for anything but generation (weights, sleep, wake-up, close)."""
        self._acquire(None)
        try:
            yield
        finally:
            self._release()

    def wake_waiters(self) -> None:
        """Let waiting calls see a cancellation (their stream was closed)."""
        with self._cond:
            self._cond.notify_all()

    def run(
        self,
        call: Call,
        *,
        signature: Hashable,
        begin: Callable[[], SlotLoop],
        scope: Scope,
        end: Callable[[], None],
    ) -> None:
        """Serve `call` to the end: join a compatible loop, else lead a new one.

        begin: configures the runner and returns a fresh loop (under `scope()`, the engine held).
        end: runs once the loop is over, before the engine is free (engine stream synchronised).
        """
        role, session = self._acquire(signature, call)
        if role == "join":
            assert session is not None
            self._wait_or_drive(call, session, scope, end)
        elif role == "lead" and call.cancelled.is_set():  # closed while waiting: nothing to do
            self._release()
        elif role == "lead":
            try:
                with scope(after_caller=True):
                    loop = begin()
            except BaseException:
                self._finish(end)
                raise
            session = _Session(
                signature=signature,
                loop=loop,
                driver=call,
                calls=[call],
                pending=list(call.items),
            )
            with self._cond:
                self._session = session
                self._cond.notify_all()  # waiters of the same signature may join now
            self._drive(call, session, scope, end)
        if call.error is not None:
            raise call.error

    # -- waiting --------------------------------------------------------------------------------

    def _acquire(
        self, signature: Hashable, call: Call | None = None
    ) -> tuple[str, _Session | None]:
        """Wait until the engine is free ("lead": it is ours) or, for a call, until a loop to
        join ("join") or its cancellation ("skip": the caller left, the engine is not ours)."""
        with self._cond:
            self._waiting.append(signature)
            try:
                while True:
                    if call is not None and (session := self._joinable(signature)) is not None:
                        session.calls.append(call)
                        session.pending.extend(call.items)
                        self.num_joined_calls += 1
                        return "join", session
                    if not self._is_busy:
                        self._is_busy = True
                        return "lead", None
                    if call is not None and call.cancelled.is_set():
                        call.is_done = True
                        return "skip", None
                    self._cond.wait()
            finally:
                self._waiting.remove(signature)
                self._cond.notify_all()  # one waiter fewer may unblock joining

    def _joinable(self, signature: Hashable) -> _Session | None:
        session = self._session
        if not self.should_join or session is None or session.signature != signature:
            return None
        # Joining would overtake whoever waits for the engine with other work.
        if any(waiting != signature for waiting in self._waiting):
            return None
        return session

    def _release(self) -> None:
        with self._cond:
            self._is_busy = False
            self._cond.notify_all()

    def _wait_or_drive(self, call: Call, session: _Session, scope: Scope, end) -> None:
        with self._cond:
            self._cond.wait_for(lambda: call.is_done or session.driver is call)
            if call.is_done:
                return
        self._drive(call, session, scope, end)

    # -- driving --------------------------------------------------------------------------------

    def _drive(self, call: Call, session: _Session, scope: Scope, end) -> None:
        """Run the loop until it is empty (then end it) or `call` is done (then hand it over)."""
        loop = session.loop
        try:
            with scope(after_caller=False):
                while True:
                    with self._cond:
                        new_items, session.pending = session.pending, []
                        dropped = [c for c in session.calls if c.cancelled.is_set()]
                        for c in dropped:
                            c.is_dropped = True
                    loop.step(new_items, dropped)
                    with self._cond:
                        self._settle(session)
                        if not session.pending and not loop.has_work():
                            # From here a new call finds no loop and waits for the engine.
                            assert not session.calls, "a call is not done but nothing runs"
                            self._session = None
                            break
                        if call.is_done:  # hand over to a call that still has samples
                            session.driver = session.calls[0]
                            self._cond.notify_all()
                            return
        except BaseException as exc:
            with self._cond:
                if self._session is session:
                    self._session = None
                for other in session.calls:
                    other.is_done = True
                    if other is not call:
                        other.error = RuntimeError(
                            "the engine's generation loop failed while driven by another call"
                        )
                        other.error.__cause__ = exc
                self._cond.notify_all()
            self._finish(end)
            raise
        self._finish(end)

    def _finish(self, end: Callable[[], None]) -> None:
        try:
            end()
        finally:  # even if the device failed: a busy engine nobody holds would hang every call
            self._release()

    def _settle(self, session: _Session) -> None:
        """Mark calls with nothing left as done and wake their threads (under the lock)."""
        finished = [c for c in session.calls if c.num_left == 0 or c.is_dropped]
        if finished:
            for c in finished:
                c.is_done = True
            session.calls = [c for c in session.calls if not c.is_done]
            self._cond.notify_all()
