"""Rollout running ahead of training: a generator thread starts prompts as admission control
allows, worker threads generate them under the weights the engine holds, and the trainer takes
finished groups while the next ones generate.

    generator thread                      workers (num_workers)            trainer (caller)
    ---------------------------------     -----------------------------   --------------------
    n = admission.num_admissible(w)       result = generate(row, version)  groups = take(P)
    rows = loader.next_batch(n)             version() read per token:      train -> v + 1
    in_flight.add(...), admission.start     weights may change mid-way     push weights
    submit ------------------------------>  in_flight.finish(result) --->   set_version(v + 1)
          ^--------------------- wakes on set_version, release, take ----------'

One lock guards the loader, the admission count and the in-flight set, so state_dict() is a
consistent cut: every row the loader gave out and the trainer did not take is in flight.
`generate(row, version)` is the rollout for one prompt's group, called in a worker thread:
`version()` returns the version of the weights the engine holds now, which it records per
token (a response can span versions when weights arrive mid-generation). With
should_save_results (the default) its result must be JSON-able (the checkpoint keeps it);
without, state_dict() writes finished-untaken prompts as unfinished, so a resume generates
them again (each still exactly once) and the result may be any object (the reference trainer's
judged samples). An exception in it is counted and logged, the prompt is dropped and its slot
released: user code cannot kill a run (num_failed says how many).

paused() holds new generate calls back and waits for the running ones: a trainer whose phases
put the engines to sleep (one GPU without room for all three) trains and pushes inside it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from yatt.core.data._loader import ROW_INDEX_KEY
from yatt.core.rl._in_flight import InFlightPrompt, InFlightPrompts
from yatt.core.rl._staleness import AdmissionControl

logger = logging.getLogger("yatt.core")


class RowLoader(Protocol):
    def next_batch(self, num_rows: int | None = None) -> list[dict[str, Any]]: ...
    def read_rows(self, indices: list[int]) -> list[dict[str, Any] | None]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


GenerateFn = Callable[[dict[str, Any], Callable[[], int]], Any]


class AsyncRollout:
    """The driver in the module docstring. Call start() once (after load_state_dict when
    resuming), take() per step, set_version() after each weight push, close() at the end."""

    def __init__(
        self,
        *,
        loader: RowLoader,
        generate: GenerateFn,
        admission: AdmissionControl,
        version: int = 0,
        num_workers: int = 4,
        should_save_results: bool = True,
        abort: Callable[[], None] | None = None,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r}: must be an int >= 1")
        self._loader = loader
        self._generate = generate
        self._admission = admission
        self._in_flight = InFlightPrompts()
        self._version = int(version)
        self._next_number = 0
        self._cond = threading.Condition()
        self._is_closed = False
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="yatt-rollout")
        self.num_failed = 0  # prompts whose generate raised (dropped, counted, logged)
        self.num_requeued = 0  # in-flight prompts a resume restarted
        self.num_unusable_on_resume = 0  # re-queued rows the loader no longer gives
        self._take_wait_s = 0.0  # the trainer's wait in take() since the last metrics()
        self._should_save_results = should_save_results
        self._abort = abort  # ends the engine's running requests on close() (their tails)
        self._num_pauses = 0  # paused() blocks held: no generate call may start
        self._num_running = 0  # generate calls running now

    # -- the trainer's side ---------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version of the weights the engine holds (the last set_version)."""
        with self._cond:
            return self._version

    def set_version(self, version: int) -> None:
        """The engine now holds weights `version` (call after each push): new prompts start
        under it, and admission may allow more."""
        with self._cond:
            assert version >= self._version, (version, self._version)
            self._version = int(version)
            self._cond.notify_all()

    def take(self, num_prompts: int, *, timeout_s: float | None = None) -> list[InFlightPrompt]:
        """The next `num_prompts` finished groups in the order they finished (blocks until
        that many have; TimeoutError past timeout_s). They leave the in-flight set: the
        checkpoint after this step does not hold them."""
        start_s = time.perf_counter()
        with self._cond:
            is_ready = self._cond.wait_for(
                lambda: self._in_flight.num_finished >= num_prompts or self._is_closed,
                timeout=timeout_s,
            )
            self._take_wait_s += time.perf_counter() - start_s
            if not is_ready:
                raise TimeoutError(
                    f"AsyncRollout.take({num_prompts}): {self._in_flight.num_finished} finished "
                    f"after {timeout_s} s ({len(self._in_flight)} in flight)"
                )
            if self._is_closed:
                raise RuntimeError("AsyncRollout.take after close()")
            taken = self._in_flight.take_finished(num_prompts)
            self._cond.notify_all()
            return taken

    @property
    def is_stalled(self) -> bool:
        """No prompt in flight and none may start before the next set_version(). A trainer
        that took fewer groups than a step trains and finds this has lost slots (prompts
        neither trained nor released): its take() would wait forever."""
        with self._cond:
            return (
                len(self._in_flight) == 0
                and self._thread is not None
                and self._admission.num_admissible(version=self._version) == 0
            )

    def metrics(self) -> dict[str, float]:
        """Per-step scalars (resets the wait): the trainer's wait for finished groups since the
        last call (rollout on the critical path when it is large), prompts in flight and
        finished-but-untaken, failures, resumed prompts."""
        with self._cond:
            out = {
                "offpolicy/take_wait_s": self._take_wait_s,
                "offpolicy/num_in_flight": float(len(self._in_flight)),
                "offpolicy/num_finished_waiting": float(self._in_flight.num_finished),
                "offpolicy/num_failed": float(self.num_failed),
                "offpolicy/num_requeued": float(self.num_requeued),
            }
            self._take_wait_s = 0.0
            return out

    def release(self, num_prompts: int) -> None:
        """Give back the admission slots of taken prompts that were not trained (groups the
        dynamic sampler filtered out), so they do not slow generation."""
        with self._cond:
            self._admission.release(num_prompts)
            self._cond.notify_all()

    def finish_step(self, num_trained: int) -> None:
        """The step trained `num_trained` groups (fewer than prompts_per_step: an unfilled
        batch, 0: a step a stop signal ended): admission accounts for the slots left
        (AdmissionControl.record_step). Call once per step, before its set_version."""
        with self._cond:
            self._admission.record_step(num_trained)
            self._cond.notify_all()

    def put_back(self, prompts: list[InFlightPrompt]) -> None:
        """Taken groups the trainer did not train after all (a stop signal ended the step):
        in flight again with their slots, so the next take() or a resume has them."""
        with self._cond:
            for prompt in prompts:
                self._in_flight.put_back(prompt)
            self._cond.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No generate call starts inside, and the running ones have returned on entry: the
        engines may sleep (a phase switch) and wake again before it ends."""
        with self._cond:
            self._num_pauses += 1
            self._cond.wait_for(lambda: self._num_running == 0)
        try:
            yield
        finally:
            with self._cond:
                self._num_pauses -= 1
                self._cond.notify_all()

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._in_flight)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start generating; a resumed run first restarts its re-queued prompts, once."""
        assert self._thread is None, "AsyncRollout.start() called twice"
        with self._cond:
            resumed = self._in_flight.unfinished()
            rows = self._loader.read_rows([p.row_index for p in resumed]) if resumed else []
            for prompt, row in zip(resumed, rows, strict=True):
                if row is None:
                    # Unusable now (a row the loader would skip): never trained; counted.
                    self._in_flight.drop(prompt.number)
                    self._admission.release(1)
                    self.num_unusable_on_resume += 1
                    continue
                self._in_flight.restart(prompt.number, version=self._version)
                self._submit(prompt.number, row)
                self.num_requeued += 1
        self._thread = threading.Thread(target=self._run, name="yatt-generator", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop starting prompts and wait for the workers (a real engine's requests should be
        aborted first so that its tails end)."""
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()
        if self._abort is not None:
            self._abort()
        if self._thread is not None:
            self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> AsyncRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- checkpoint -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The loader, admission and in-flight state as one consistent cut."""
        with self._cond:
            in_flight = self._in_flight.state_dict(should_save_results=self._should_save_results)
            return {
                "loader": self._loader.state_dict(),
                "admission": self._admission.state_dict(),
                "in_flight": in_flight,
                "next_number": self._next_number,
                "version": self._version,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from state_dict() (before start())."""
        assert self._thread is None, "load_state_dict after start()"
        with self._cond:
            self._loader.load_state_dict(state["loader"])
            self._admission.load_state_dict(state["admission"])
            self._in_flight.load_state_dict(state["in_flight"])
            self._next_number = int(state["next_number"])
            self._version = max(self._version, int(state["version"]))

    # -- the generator thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._is_closed or self._admission.num_admissible(version=self._version) > 0
                    )
                )
                if self._is_closed:
                    return
                version = self._version
                num_rows = self._admission.num_admissible(version=version)
                # Host work under the lock (reading rows): it keeps state_dict a consistent
                # cut; rows are small next to a generation.
                rows = self._loader.next_batch(num_rows)
                self._admission.start(len(rows), version=version)
                started = []
                for row in rows:
                    number = self._next_number
                    self._next_number += 1
                    self._in_flight.add(number, row_index=row[ROW_INDEX_KEY], version=version)
                    started.append((number, row))
                for number, row in started:
                    self._submit(number, row)

    def _submit(self, number: int, row: dict[str, Any]) -> None:
        self._pool.submit(self._generate_one, number, row)

    def _read_version(self) -> int:
        with self._cond:
            return self._version

    def _generate_one(self, number: int, row: dict[str, Any]) -> None:
        with self._cond:  # paused(): the engines may be asleep
            self._cond.wait_for(lambda: self._num_pauses == 0 or self._is_closed)
            self._num_running += 1
        try:
            result = self._generate(row, self._read_version)
        except Exception:
            logger.exception(
                "rollout of prompt %d (row %s) failed; dropped", number, row.get(ROW_INDEX_KEY)
            )
            with self._cond:
                self._num_running -= 1
                self._in_flight.drop(number)
                self._admission.release(1)
                self.num_failed += 1
                self._cond.notify_all()
            return
        with self._cond:
            self._num_running -= 1
            if number in self._in_flight:
                self._in_flight.finish(number, result)
            self._cond.notify_all()
