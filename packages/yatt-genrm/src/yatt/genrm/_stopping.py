"""A blocking score() that a stop signal can end while it waits on the judge or reward workers.

    scorer.score(samples, should_stop=lambda: ckpt.stop_signal is not None)
        -> verdicts, as without should_stop
        -> ScoringStopped once should_stop() is true (polled every POLL_S while waiting):
           the judge's pending requests aborted, reward worker calls killed, no verdicts

    caller thread (or a helper thread when a loop already runs there)
        event loop: work() task ----------------------------> verdicts
                    every POLL_S: should_stop()? --yes--> cancel work, abort() --> ScoringStopped

A step whose judge or reward function never answers cannot reach the trainer's next safe point
(between rounds, between judged groups); this is the safe point inside one blocking call. What
"abort" means is the scorer's: a local judge's engine stream is closed (the engine drops those
requests), an endpoint's HTTP requests are cancelled, a reward function's worker processes are
killed whole (programs they started too) and replaced by fresh ones at the next call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

# How often should_stop() is read while waiting: a stop lands within this (plus the abort).
# It is a flag read (the trainer's reads an int), so 20 reads a second cost nothing.
POLL_S = 0.05


class ScoringStopped(Exception):
    """should_stop() turned true while score() waited: the pending judge requests were aborted
    and reward worker calls killed; no verdicts. The caller saves what it has and exits."""

    def __init__(self, *, num_samples: int, waited_s: float) -> None:
        super().__init__(
            f"a stop was requested while scoring {num_samples} samples ({waited_s:.2f} s in): "
            "the judge's pending requests were aborted and reward worker calls killed"
        )
        self.num_samples = num_samples
        self.waited_s = waited_s


def check_should_stop(should_stop: object) -> None:
    """ValueError unless `should_stop` is None or a callable (a flag passed by mistake, e.g.
    `should_stop=event.is_set()`, would never change)."""
    if should_stop is not None and not callable(should_stop):
        raise ValueError(
            f"should_stop={should_stop!r}: pass a callable returning True once scoring should "
            "stop (e.g. event.is_set, without the call), or None"
        )


def run_until_stopped(
    work: Callable[[], Awaitable[T]],
    should_stop: Callable[[], bool],
    abort: Callable[[], Awaitable[None]],
    *,
    num_samples: int,
    poll_s: float = POLL_S,
) -> T:
    """`await work()` on an event loop of its own, reading should_stop() before it starts and
    every `poll_s` until it ends; once true, the work is cancelled, `abort()` awaited (it ends
    what the cancel cannot reach: worker processes, engine requests) and ScoringStopped raised.
    If should_stop itself raises, the work is aborted the same way and that error raised."""
    begin = time.monotonic()

    async def run() -> T:
        if should_stop():  # before any request leaves
            raise ScoringStopped(num_samples=num_samples, waited_s=0.0)
        task = asyncio.ensure_future(work())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=poll_s)
                if not task.done() and should_stop():
                    break
        except BaseException:
            await _cancel_and_abort(task, abort)
            raise
        if task.done():
            return task.result()
        await _cancel_and_abort(task, abort)
        raise ScoringStopped(num_samples=num_samples, waited_s=time.monotonic() - begin)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run())
    # Called from a running loop's thread (a blocking call there): a loop of its own elsewhere.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="yatt-genrm-score") as one:
        return one.submit(asyncio.run, run()).result()


async def _cancel_and_abort(task: asyncio.Future, abort: Callable[[], Awaitable[None]]) -> None:
    task.cancel()
    try:
        await abort()
    finally:
        await asyncio.gather(task, return_exceptions=True)
