NUM_GPUS = 0

import asyncio
import random
import re
import time

import pytest

from yatt.genrm import (
    BatchingConfig,
    GenRM,
    JudgeTemplate,
    Sample,
    ScoreStats,
    Verdict,
    Vote,
    YesNoParser,
    score_as_completed,
)
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


def _mixed_judge(prompt_text: str, vote: int) -> str:
    value = int(re.search(r"response=(\d+)", prompt_text).group(1))
    return ["Yes", "No", "let me think about it"][value % 3]


def _mixed_sample(completion: dict) -> Sample:
    # Every 5th sample lacks the reference its template needs: an error verdict.
    reference = None if completion["value"] % 5 == 4 else "r"
    return Sample(prompt="p", response=str(completion["value"]), reference=reference)


def _mixed_genrm() -> GenRM:
    return GenRM(
        FakeJudgeEngine(judge=_mixed_judge),
        template=JudgeTemplate(user="response={response} ref={reference}"),
        parser=YesNoParser(),
        batching=BatchingConfig(max_batch_size=4, batch_window_millis=2.0, max_pending=8),
    )


def test_stats_count_one_calls_statuses_causes_and_judge_tokens():
    genrm = _mixed_genrm()
    scored = asyncio.run(score_as_completed(_completions(40, delay_s=0.001), genrm, _mixed_sample))
    completions, verdicts = scored  # still unpacks as before
    statuses = [
        "error" if c["value"] % 5 == 4 else ("ok", "ok", "unparsable")[c["value"] % 3]
        for c in completions
    ]
    assert [v.status for v in verdicts] == statuses
    stats = scored.stats
    assert stats == ScoreStats.from_verdicts(verdicts)
    assert (stats.num_verdicts, stats.num_ok) == (40, statuses.count("ok"))
    assert (stats.num_unparsable, stats.num_errors) == (
        statuses.count("unparsable"),
        statuses.count("error"),
    )
    first_unparsable = statuses.index("unparsable")  # sample ids are arrival indices
    assert stats.first_unparsable.startswith(f"sample {first_unparsable}: ")
    assert "let me think about it" in stats.first_unparsable
    assert stats.first_error.startswith(f"sample {statuses.index('error')}: template")
    assert "{reference}" in stats.first_error
    # The judge's load of this call, without differencing the scorer's running counters.
    assert stats.num_judge_prompt_tokens == genrm.metrics["num_prompt_tokens"] > 0
    judged = [v for v in verdicts if v.status != "error"]
    assert stats.num_judge_response_tokens == sum(len(v.text.encode()) for v in judged)


def test_stats_stay_per_call_when_calls_share_the_scorer():
    # Concurrent calls share the judge's batches (as the service's requests do); each call's
    # stats still count only its own samples.
    genrm = _mixed_genrm()
    long = [_mixed_sample({"value": i}) for i in range(30)]
    short = [_mixed_sample({"value": i}) for i in range(7)]

    async def both():
        return await asyncio.gather(genrm.ascore(long), genrm.ascore(short))

    first, second = (ScoreStats.from_verdicts(v) for v in asyncio.run(both()))
    assert (first.num_verdicts, second.num_verdicts) == (30, 7)
    assert 0 < second.num_judge_prompt_tokens < first.num_judge_prompt_tokens
    total = first.num_judge_prompt_tokens + second.num_judge_prompt_tokens
    assert total == genrm.metrics["num_prompt_tokens"]
    assert any(c.num_requests > 1 for c in genrm.engine.calls)


def test_failed_judge_batches_still_report_their_prompt_tokens():
    genrm = GenRM(
        FakeJudgeEngine(judge=_judge, fail_after=1),
        template=JudgeTemplate(user="response={response}"),
        parser=YesNoParser(),
    )
    samples = [Sample(prompt="p", response=str(i)) for i in range(4)]
    verdicts = asyncio.run(genrm.ascore(samples))
    stats = ScoreStats.from_verdicts(verdicts)
    assert (stats.num_ok, stats.num_errors) == (1, 3)
    assert "fake judge engine failure" in stats.first_error
    assert stats.num_judge_prompt_tokens == genrm.metrics["num_prompt_tokens"] > 0


def test_unparsable_cause_says_when_the_judge_was_cut():
    vote = Vote(
        reward=None, text="Let me reason step by", status="unparsable", finish_reason="length"
    )
    verdict = Verdict(sample_id="7", reward=0.0, status="unparsable", text=vote.text, votes=(vote,))
    stats = ScoreStats.from_verdicts([verdict])
    assert stats.first_unparsable == (
        "sample 7: no verdict in the judge's text 'Let me reason step by' "
        "(cut at the judge's max_new_tokens)"
    )
    assert stats.first_error is None
