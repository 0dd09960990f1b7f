"""Streaming scoring: samples in as rollouts finish, verdicts out as the judge finishes them.

    submit(sample) --slots (max_pending)--> queue --batcher: count or time window--> batch
        batch --(at most max_inflight_batches at once)--> judge_batch(items): resolves futures
        future done --> out queue --> results()  (a taken verdict frees its slot)

Back-pressure: `submit` waits while `max_pending` samples are submitted but their verdicts not
yet taken from `results()`, so memory stays bounded however fast rollouts finish. Every
submitted sample gets exactly one verdict: whatever `judge_batch` leaves unresolved (it raised,
or the engine lost a request) is resolved here with status "error".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from yatt.genrm._stopping import check_should_stop, run_until_stopped
from yatt.genrm._types import Sample, Verdict, describe_failure, error_verdict


@dataclass(kw_only=True, frozen=True)
class BatchingConfig:
    """How samples are grouped into judge calls while streaming."""

    max_batch_size: int = 32  # samples per engine call
    batch_window_millis: float = 20.0  # after a batch's first sample, wait at most this long
    max_pending: int = 256  # submitted but not yet taken from results(); submit() waits beyond
    # Engine calls in flight at once. Engines that batch across calls (the built-in engine joins
    # compatible calls into its running decode loop; vLLM, SGLang) start each batch as soon as
    # it is formed; a batch over this cap waits for a whole earlier decode to end (at the end of
    # a long-tail rollout that wait is the judge's tail). max_pending bounds the samples anyway.
    # 1 = one call at a time.
    max_inflight_batches: int = 16

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_pending", "max_inflight_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BatchingConfig.{name}={value!r}: must be an int >= 1")
        if not self.batch_window_millis >= 0:
            raise ValueError(
                f"BatchingConfig.batch_window_millis={self.batch_window_millis!r}: must be >= 0"
            )


def per_sample_batching() -> BatchingConfig:
    """For scorers that take each sample on its own (an HTTP request, a function call) and
    bound their own concurrency: no window, and a batch never waits for an earlier one (a batch
    of one sample would otherwise hold one of max_inflight_batches slots)."""
    max_pending = BatchingConfig().max_pending
    return BatchingConfig(batch_window_millis=0.0, max_inflight_batches=max_pending)


@dataclass
class Item:
    """A sample waiting for its verdict; `future` is resolved exactly once."""

    sample: Sample
    future: asyncio.Future[Verdict]
    # The judge's work so far for this sample, kept by the judge as it goes so that a verdict
    # made here on failure still reports the tokens already spent (Verdict's fields).
    num_judge_prompt_tokens: int = 0
    num_judge_response_tokens: int = 0

    def resolve(self, verdict: Verdict) -> bool:
        if self.future.done():
            return False
        self.future.set_result(verdict)
        return True

    def with_tokens(self, verdict: Verdict) -> Verdict:
        """`verdict` carrying this item's judge token counts."""
        return dataclasses.replace(
            verdict,
            num_judge_prompt_tokens=self.num_judge_prompt_tokens,
            num_judge_response_tokens=self.num_judge_response_tokens,
        )


class StreamingScorer:
    """The submit/finish/results/ascore machinery; subclasses implement `_judge_batch`."""

    def __init__(self, *, batching: BatchingConfig | None, error_reward: float) -> None:
        self.batching = batching or BatchingConfig()
        self._error_reward = error_reward
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics: dict[str, int] = {
            "num_samples": 0,
            "num_ok": 0,
            "num_unparsable": 0,
            "num_errors": 0,
            "num_batches": 0,
            "peak_outstanding": 0,
        }

    async def _judge_batch(self, items: list[Item]) -> None:
        """Resolve each item's future (as early as possible); raising marks the rest errors."""
        raise NotImplementedError

    def _record(self, verdict: Verdict) -> None:
        self.metrics["num_samples"] += 1
        key = {"ok": "num_ok", "unparsable": "num_unparsable", "error": "num_errors"}
        self.metrics[key[verdict.status]] += 1

    # -- per-event-loop state -------------------------------------------------------------
    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        # A new loop (e.g. a second asyncio.run): the old loop's tasks and queues are dead.
        self._loop = loop
        self._queue: asyncio.Queue[Item] = asyncio.Queue(maxsize=self.batching.max_pending)
        self._inflight = asyncio.Semaphore(self.batching.max_inflight_batches)
        self._tasks: set[asyncio.Task[None]] = set()
        self._out: asyncio.Queue[Verdict | None] = asyncio.Queue()
        self._slots = asyncio.Semaphore(self.batching.max_pending)
        self._num_submitted = self._num_taken = 0
        self._is_finished = False
        self._batcher = loop.create_task(self._run_batcher(), name="yatt.genrm.batcher")

    async def _enqueue(self, sample: Sample) -> asyncio.Future[Verdict]:
        if not isinstance(sample, Sample):
            raise ValueError(f"expected a yatt.genrm.Sample, got {type(sample).__name__}")
        self._ensure_started()
        future: asyncio.Future[Verdict] = self._loop.create_future()
        future.add_done_callback(lambda f: f.cancelled() or self._record(f.result()))
        await self._queue.put(Item(sample, future))
        return future

    async def _run_batcher(self) -> None:
        loop = asyncio.get_running_loop()
        window_s = self.batching.batch_window_millis / 1000
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + window_s
            while len(batch) < self.batching.max_batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                timeout_s = deadline - loop.time()
                if timeout_s <= 0:
                    break
                try:
                    # Queue.get is cancellation-safe: on timeout no item is lost.
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout_s))
                except TimeoutError:
                    break
            await self._inflight.acquire()
            self.metrics["num_batches"] += 1
            task = loop.create_task(self._judge_and_settle(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _judge_and_settle(self, batch: list[Item]) -> None:
        message = "the judge returned no verdict for this sample"
        try:
            await self._judge_batch(batch)
        except asyncio.CancelledError:
            message = "scoring was cancelled (GenRM closed)"
            raise
        except Exception as e:
            message = f"judge failed: {describe_failure(e)}"
        finally:
            self._inflight.release()
            for item in batch:
                if not item.future.done():
                    verdict = error_verdict(item.sample.id, message, reward=self._error_reward)
                    item.resolve(item.with_tokens(verdict))

    # -- public streaming API ----------------------------------------------------------------
    async def submit(self, sample: Sample) -> None:
        """Queue `sample` for judging; waits while `max_pending` verdicts are not yet taken."""
        self._ensure_started()
        if self._is_finished:
            raise RuntimeError(
                "submit() after finish(): iterate results() to its end before the next round"
            )
        await self._slots.acquire()
        try:
            future = await self._enqueue(sample)
        except BaseException:
            self._slots.release()
            raise
        self._num_submitted += 1
        outstanding = self._num_submitted - self._num_taken
        self.metrics["peak_outstanding"] = max(self.metrics["peak_outstanding"], outstanding)
        future.add_done_callback(lambda f: f.cancelled() or self._out.put_nowait(f.result()))

    async def finish(self) -> None:
        """No more samples this round: `results()` ends once every submitted one is out."""
        self._ensure_started()
        self._is_finished = True
        self._out.put_nowait(None)  # wakes a results() waiting on an already-drained queue

    async def results(self) -> AsyncIterator[Verdict]:
        """Each verdict as soon as it is ready (any order), until finish() and all are out."""
        self._ensure_started()
        while not (self._is_finished and self._num_taken == self._num_submitted):
            verdict = await self._out.get()
            if verdict is None:
                continue
            self._num_taken += 1
            self._slots.release()
            yield verdict
        self._is_finished = False  # the next round may start

    async def ascore(self, samples: Sequence[Sample]) -> list[Verdict]:
        """Verdicts for `samples` in order, batched with any concurrent callers' samples."""
        futures = [await self._enqueue(s) for s in samples]
        return list(await asyncio.gather(*futures))

    # -- a blocking score() that a stop can end (yatt.genrm._stopping) -------------------------
    def _score_until_stopped(
        self, samples: Sequence[Sample], should_stop: Callable[[], bool]
    ) -> list[Verdict]:
        """score()'s verdicts from `_ascore_all` on a loop of its own, should_stop() polled while
        it waits; ScoringStopped after `_abort()` once it is true."""
        check_should_stop(should_stop)
        return run_until_stopped(
            lambda: self._ascore_all(samples),
            should_stop,
            self._abort,
            num_samples=len(samples),
        )

    async def _ascore_all(self, samples: Sequence[Sample]) -> list[Verdict]:
        """What score() computes, awaited (verdicts recorded in metrics): ascore by default."""
        return await self.ascore(samples)

    async def _abort(self) -> None:
        """End this loop's pending work at a stop: cancel the batcher and the in-flight judge
        calls (their samples get error verdicts). Subclasses also end what a cancel cannot
        reach (worker processes); the scorer stays usable."""
        await self._cancel_pending("scoring was stopped before this sample was judged")

    async def aclose(self) -> None:
        """Cancel the batcher and in-flight judge calls; their samples get error verdicts."""
        await self._cancel_pending("GenRM closed before scoring")

    async def _cancel_pending(self, message: str) -> None:
        if self._loop is None or self._loop is not asyncio.get_running_loop():
            return
        self._batcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._batcher
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while not self._queue.empty():
            item = self._queue.get_nowait()
            item.resolve(error_verdict(item.sample.id, message, reward=self._error_reward))
        self._loop = None
