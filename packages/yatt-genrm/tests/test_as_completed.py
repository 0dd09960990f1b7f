NUM_GPUS = 0

import asyncio
import random
import re
import time

import pytest

from yatt.genrm import BatchingConfig, GenRM, JudgeTemplate, Sample, YesNoParser, score_as_completed
from yatt.genrm.testing import FakeJudgeEngine

pytestmark = pytest.mark.timeout(60)


def _judge(prompt_text: str, vote: int) -> str:
    return "Yes" if int(re.search(r"response=(\d+)", prompt_text).group(1)) % 3 == 0 else "No"


def _genrm() -> GenRM:
    return GenRM(
        FakeJudgeEngine(judge=_judge),
        template=JudgeTemplate(user="response={response}"),
        parser=YesNoParser(),
        batching=BatchingConfig(max_batch_size=4, batch_window_millis=2.0, max_pending=8),
    )


async def _completions(n: int, *, delay_s: float, fail_at: int | None = None, log=None):
    rng = random.Random(0)
    for i in range(n):
        await asyncio.sleep(delay_s * rng.random())
        if i == fail_at:
            raise RuntimeError("engine died")
        if log is not None:
            log.append(time.perf_counter())
        yield {"value": (i * 7) % 50}


def test_verdicts_pair_with_completions_in_arrival_order():
    completions, verdicts = asyncio.run(
        score_as_completed(
            _completions(40, delay_s=0.002),
            _genrm(),
            lambda c: Sample(prompt="p", response=str(c["value"]), id="same-id-for-all"),
        )
    )
    assert len(completions) == len(verdicts) == 40
    for c, v in zip(completions, verdicts, strict=True):
        assert v.reward == (1.0 if c["value"] % 3 == 0 else -1.0)


def test_judging_overlaps_the_stream():
    arrivals: list[float] = []
    scorer = _genrm()
    engine = scorer.engine
    asyncio.run(
        score_as_completed(
            _completions(30, delay_s=0.02, log=arrivals),
            scorer,
            lambda c: Sample(prompt="p", response=str(c["value"])),
        )
    )
    # Judge calls started before the last completion arrived: scoring overlapped the rollout.
    assert min(call.start_s for call in engine.calls) < arrivals[-1]


def test_stream_error_propagates_without_hanging():
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(
            score_as_completed(
                _completions(10, delay_s=0.001, fail_at=5),
                _genrm(),
                lambda c: Sample(prompt="p", response=str(c["value"])),
            )
        )
