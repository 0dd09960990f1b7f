NUM_GPUS = 0

import asyncio
import random
import re
import time
from collections import Counter

import pytest

from yatt.genrm import BatchingConfig, GenRM, JudgeTemplate, Sample, YesNoParser
from yatt.genrm.testing import FakeJudgeEngine

pytestmark = pytest.mark.timeout(60)

TEMPLATE = JudgeTemplate(user="response={response}")


def _judge(prompt_text: str, vote: int) -> str:
    # Even responses are right: the verdict depends on the sample, so a mix-up would show.
    return "Yes" if int(re.search(r"response=(\d+)", prompt_text).group(1)) % 2 == 0 else "No"


def _genrm(engine: FakeJudgeEngine, **batching) -> GenRM:
    config = {"max_batch_size": 8, "batch_window_millis": 5.0, **batching}
    return GenRM(engine, template=TEMPLATE, parser=YesNoParser(), batching=BatchingConfig(**config))


async def _produce(genrm: GenRM, samples: list[Sample], *, seed: int) -> None:
    rng = random.Random(seed)
    for sample in samples:
        await asyncio.sleep(rng.random() * 0.002)  # rollouts finish at random times
        await genrm.submit(sample)


@pytest.mark.parametrize("num_producers", [1, 4])
def test_every_sample_scored_exactly_once(num_producers: int) -> None:
    engine = FakeJudgeEngine(judge=_judge, batch_latency_s=0.005)
    genrm = _genrm(engine)
    samples = [Sample(prompt="q", response=str(i), id=f"s{i}") for i in range(120)]
    shards = [samples[i::num_producers] for i in range(num_producers)]

    async def main() -> list:
        async def producers() -> None:
            await asyncio.gather(*(_produce(genrm, s, seed=i) for i, s in enumerate(shards)))
            await genrm.finish()

        task = asyncio.create_task(producers())
        out = [v async for v in genrm.results()]
        await task
        await genrm.aclose()
        return out

    verdicts = asyncio.run(main())
    assert Counter(v.sample_id for v in verdicts) == Counter(s.id for s in samples)
    for v in verdicts:
        assert v.reward == (1.0 if int(v.sample_id[1:]) % 2 == 0 else -1.0)
    assert all(c.num_requests <= 8 for c in engine.calls)
    assert sum(c.num_requests for c in engine.calls) == 120
    assert genrm.metrics["num_samples"] == 120


def test_submit_waits_at_the_pending_bound() -> None:
    max_pending = 6
    genrm = _genrm(FakeJudgeEngine(judge=_judge), max_batch_size=4, max_pending=max_pending)
    samples = [Sample(prompt="q", response=str(i)) for i in range(40)]
    submitted = 0
    taken = 0
    peak = 0

    async def main() -> None:
        nonlocal submitted, taken, peak

        async def producer() -> None:
            nonlocal submitted, peak
            for s in samples:
                await genrm.submit(s)
                submitted += 1
                peak = max(peak, submitted - taken)
            await genrm.finish()

        task = asyncio.create_task(producer())
        await asyncio.sleep(0.2)  # no consumer yet: the producer must be stuck at the bound
        assert submitted == max_pending
        assert not task.done()
        async for _ in genrm.results():
            taken += 1
            await asyncio.sleep(0.001)  # a slow consumer
        await task
        await genrm.aclose()

    asyncio.run(main())
    assert taken == 40
    assert peak <= max_pending
    assert genrm.metrics["peak_outstanding"] <= max_pending


def test_verdicts_stream_out_while_samples_still_arrive() -> None:
    genrm = _genrm(FakeJudgeEngine(judge=_judge, batch_latency_s=0.002), max_batch_size=4)
    first_verdict_s = last_submit_s = 0.0

    async def main() -> None:
        nonlocal first_verdict_s, last_submit_s

        async def producer() -> None:
            nonlocal last_submit_s
            for i in range(20):
                await genrm.submit(Sample(prompt="q", response=str(i)))
                await asyncio.sleep(0.01)
            last_submit_s = time.perf_counter()
            await genrm.finish()

        task = asyncio.create_task(producer())
        async for _ in genrm.results():
            first_verdict_s = first_verdict_s or time.perf_counter()
        await task
        await genrm.aclose()

    asyncio.run(main())
    assert 0 < first_verdict_s < last_submit_s


def test_time_window_flushes_a_partial_batch() -> None:
    engine = FakeJudgeEngine(judge=_judge)
    genrm = _genrm(engine, max_batch_size=100, batch_window_millis=20.0)

    async def main() -> float:
        start = time.perf_counter()
        (verdict,) = await genrm.ascore([Sample(prompt="q", response="2")])
        assert verdict.reward == 1.0
        await genrm.aclose()
        return time.perf_counter() - start

    assert asyncio.run(main()) < 2.0  # well under "wait for 100 samples forever"
    assert [c.num_requests for c in engine.calls] == [1]


def test_engine_failure_still_gives_every_sample_a_verdict() -> None:
    # Each stream call yields 3 completions, then raises: later samples of a batch are errors.
    engine = FakeJudgeEngine(judge=_judge, fail_after=3)
    genrm = _genrm(engine, max_batch_size=8, batch_window_millis=50.0)
    samples = [Sample(prompt="q", response=str(i)) for i in range(32)]

    async def main() -> list:
        async def producer() -> None:
            for s in samples:
                await genrm.submit(s)
            await genrm.finish()

        task = asyncio.create_task(producer())
        out = [v async for v in genrm.results()]
        await task
        await genrm.aclose()
        return out

    verdicts = asyncio.run(main())
    assert Counter(v.sample_id for v in verdicts) == Counter(s.id for s in samples)
    statuses = Counter(v.status for v in verdicts)
    assert statuses["ok"] == 3 * len(engine.calls)
    assert statuses["error"] == 32 - statuses["ok"] > 0
    errors = [v for v in verdicts if v.status == "error"]
    assert all("fake judge engine failure" in v.error for v in errors)
    assert all(v.reward == genrm.default_reward for v in errors)


def test_inflight_batches_are_bounded() -> None:
    engine = FakeJudgeEngine(judge=_judge, batch_latency_s=0.02)
    genrm = _genrm(engine, max_batch_size=2, max_inflight_batches=3)

    async def main() -> None:
        await genrm.ascore([Sample(prompt="q", response=str(i)) for i in range(30)])
        await genrm.aclose()

    asyncio.run(main())
    assert 1 < engine.peak_active_streams <= 3


def test_rounds_reuse_the_genrm_and_guard_misuse() -> None:
    genrm = _genrm(FakeJudgeEngine(judge=_judge))

    async def round_of(n: int) -> int:
        for i in range(n):
            await genrm.submit(Sample(prompt="q", response=str(i)))
        await genrm.finish()
        return len([v async for v in genrm.results()])

    async def main() -> None:
        assert await round_of(5) == 5
        assert await round_of(3) == 3
        await genrm.submit(Sample(prompt="q", response="1"))
        await genrm.finish()
        with pytest.raises(RuntimeError, match="after finish"):
            await genrm.submit(Sample(prompt="q", response="1"))
        assert len([v async for v in genrm.results()]) == 1
        await genrm.aclose()

    asyncio.run(main())


def test_aclose_gives_in_flight_samples_error_verdicts() -> None:
    genrm = _genrm(FakeJudgeEngine(judge=_judge, batch_latency_s=30.0))

    async def main() -> list:
        task = asyncio.create_task(genrm.ascore([Sample(prompt="q", response="1")] * 3))
        await asyncio.sleep(0.05)
        await genrm.aclose()
        return await task

    verdicts = asyncio.run(main())
    assert [v.status for v in verdicts] == ["error"] * 3
    assert all("closed" in v.error or "cancelled" in v.error for v in verdicts)


def test_streaming_works_again_on_a_new_event_loop() -> None:
    genrm = _genrm(FakeJudgeEngine(judge=_judge))
    for _ in range(2):  # the second asyncio.run must not reuse the first loop's queues
        verdicts = asyncio.run(genrm.ascore([Sample(prompt="q", response="2")]))
        assert verdicts[0].reward == 1.0
