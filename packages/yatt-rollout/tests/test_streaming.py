NUM_GPUS = 0

import asyncio
import threading
import time

import pytest

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams
from yatt.rollout._streaming import stream_from_thread

LINGER_S = 0.3


class _LingeringThread(threading.Thread):
    """A stream's worker that stays alive a while after its producer returned.

    That is the window in which the reported race struck: the consumer has the last item and
    `_DONE`, the thread is still alive, and the stream used to abort whatever ran next.
    """

    def run(self) -> None:
        super().run()
        if self.name.startswith("yatt-"):
            time.sleep(LINGER_S)


@pytest.fixture
def lingering_workers(monkeypatch):
    monkeypatch.setattr(threading, "Thread", _LingeringThread)


def test_overlapping_streams_do_not_abort_each_other(tiny_model_dir, lingering_workers):
    engine = BuiltinEngine(
        tiny_model_dir, config=EngineConfig(max_batch_size=2, max_seq_len=256, region_prefix="s")
    )
    sampling = SamplingParams(n=2, max_new_tokens=60, ignore_eos=True, seed=1)
    requests = [Request(prompt_ids=[5 + i, 6, 7]) for i in range(3)]

    async def consume():
        return [c async for c in engine.stream(requests, sampling)]

    async def main():
        # Each stream's generation waits for the previous one (one call at a time), so every
        # stream but the first is running when the one before it ends.
        return await asyncio.gather(*(consume() for _ in range(4)))

    results = asyncio.run(main())
    engine.close()
    reasons = [c.finish_reason for completions in results for c in completions]
    assert len(reasons) == 4 * len(requests) * 2
    assert set(reasons) == {"length"}, reasons


def _producer(num_items: int, started: threading.Event, release: threading.Event):
    def produce(emit):
        started.set()
        for i in range(num_items):
            emit(i)
        release.wait(5)

    return produce


def test_stream_consumed_to_the_end_never_aborts(lingering_workers):
    aborts = []
    started, release = threading.Event(), threading.Event()
    release.set()

    async def main():
        stream = stream_from_thread(
            _producer(3, started, release), abort=lambda: aborts.append(1), name="yatt-test"
        )
        return [item async for item in stream]

    assert asyncio.run(main()) == [0, 1, 2]
    assert aborts == []


def test_stream_closed_early_aborts_the_running_producer():
    aborts = []
    started, release = threading.Event(), threading.Event()

    def abort():
        aborts.append(1)
        release.set()  # the producer ends only when aborted

    async def main():
        stream = stream_from_thread(_producer(3, started, release), abort=abort, name="yatt-t")
        first = await anext(stream)
        await stream.aclose()
        return first

    assert asyncio.run(main()) == 0
    assert aborts == [1]
