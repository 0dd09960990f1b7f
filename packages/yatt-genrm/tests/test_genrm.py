NUM_GPUS = 0

import asyncio
import logging
import re

import pytest

from yatt.genrm import (
    GenRM,
    JudgeTemplate,
    Sample,
    ScoreParser,
    ScoreStats,
    YesNoParser,
    verification_template,
)
from yatt.genrm._votes import aggregate_rewards
from yatt.genrm.testing import FakeJudgeEngine
from yatt.rollout import SamplingParams


def _response_of(prompt_text: str) -> str:
    return re.search(r"Response to grade:\n(.*?)\n\n", prompt_text, re.S).group(1)


def _samples(responses: list[str]) -> list[Sample]:
    return [Sample(prompt=f"q{i}", response=r, reference="4") for i, r in enumerate(responses)]


@pytest.mark.parametrize(
    ("rewards", "how", "expected"),
    [
        ([1.0, 1.0, -1.0], "mean", 1 / 3),
        ([1.0, 1.0, -1.0], "majority", 1.0),
        ([1.0, -1.0], "majority", 0.0),  # a tie is the mean of the tied values
        ([0.2, 0.2, 0.9, 0.9, 0.5], "majority", 0.55),
        ([0.5], "majority", 0.5),
    ],
    ids=["mean", "majority", "tie", "two_way_tie", "single"],
)
def test_aggregate_rewards(rewards, how, expected) -> None:
    assert aggregate_rewards(rewards, how) == pytest.approx(expected)


def test_score_uses_the_judges_verdict_per_sample() -> None:
    engine = FakeJudgeEngine(judge=lambda p, k: "Yes" if _response_of(p) == "4" else "No")
    genrm = GenRM(engine, template=verification_template(), parser=YesNoParser())
    verdicts = genrm.score(_samples(["4", "5", "4"]))
    assert [v.reward for v in verdicts] == [1.0, -1.0, 1.0]
    assert [v.status for v in verdicts] == ["ok"] * 3
    assert [v.text for v in verdicts] == ["Yes", "No", "Yes"]


def test_votes_use_n_samples_and_aggregate() -> None:
    # Votes 0 and 2 say Yes, vote 1 says No: mean 1/3, majority +1.
    engine = FakeJudgeEngine(judge=lambda p, k: "No" if k == 1 else "Yes")
    sampling = SamplingParams(temperature=0.7, max_new_tokens=8)
    for how, expected in (("mean", 1 / 3), ("majority", 1.0)):
        genrm = GenRM(
            engine,
            template=verification_template(),
            parser=YesNoParser(),
            votes=3,
            sampling=sampling,
            aggregate=how,
        )
        (verdict,) = genrm.score(_samples(["4"]))
        assert verdict.reward == pytest.approx(expected)
        assert [v.reward for v in verdict.votes] == [1.0, -1.0, 1.0]
    assert all(call.sampling.n == 3 for call in engine.calls)


def test_unparsable_votes_are_skipped_then_defaulted_and_logged(caplog) -> None:
    texts = {0: "Yes", 1: "the model rambles", 2: "Yes"}
    engine = FakeJudgeEngine(
        judge=lambda p, k: texts[k] if _response_of(p) == "4" else "no idea at all?!"
    )
    genrm = GenRM(
        engine,
        template=verification_template(),
        parser=YesNoParser(yes_label="yes", no_label="nope"),
        votes=3,
        sampling=SamplingParams(temperature=1.0),
        default_reward=-0.5,
    )
    with caplog.at_level(logging.WARNING, logger="yatt.genrm"):
        partly, none = genrm.score(_samples(["4", "5"]))
    assert (partly.status, partly.reward) == ("ok", 1.0)  # the unparsable vote does not count
    assert (none.status, none.reward) == ("unparsable", -0.5)
    assert genrm.metrics["num_unparsable"] == 1
    assert genrm.metrics["num_unparsable_votes"] == 4
    assert "no idea at all" in caplog.text


def test_parser_that_raises_counts_as_unparsable() -> None:
    class Broken:
        def parse(self, text: str) -> float | None:
            raise ZeroDivisionError("bug")

    genrm = GenRM(FakeJudgeEngine(), template=verification_template(), parser=Broken())
    (verdict,) = genrm.score(_samples(["4"]))
    assert verdict.status == "unparsable"


def test_engine_error_becomes_error_verdicts_for_the_batch() -> None:
    genrm = GenRM(
        FakeJudgeEngine(fail_after=0), template=verification_template(), parser=YesNoParser()
    )
    verdicts = genrm.score(_samples(["4", "5"]))
    assert [v.status for v in verdicts] == ["error", "error"]
    assert all("fake judge engine failure" in v.error for v in verdicts)
    assert genrm.metrics["num_errors"] == 2


def test_an_engine_error_verdict_names_its_chained_cause() -> None:
    # The built-in engine wraps a failed CUDA-graph capture in its own RuntimeError; the CUDA
    # error under it is what says why, and a verdict's error is read as text (H200, 16ea75f:
    # only the wrapper reached the log).
    class CaptureFailing(FakeJudgeEngine):
        def generate(self, requests, sampling):
            try:
                raise OSError("CUDA error: operation not permitted when stream is capturing")
            except OSError as cause:
                raise RuntimeError("capturing the decode step failed") from cause

    genrm = GenRM(CaptureFailing(), template=verification_template(), parser=YesNoParser())
    (verdict,) = genrm.score(_samples(["4"]))
    assert verdict.status == "error"
    assert verdict.error == (
        "judge failed: RuntimeError: capturing the decode step failed; caused by OSError: "
        "CUDA error: operation not permitted when stream is capturing"
    )


def test_describe_failure_follows_causes_and_context_but_not_suppressed_context() -> None:
    from yatt.genrm._types import describe_failure

    try:
        try:
            raise KeyError("inner")
        except KeyError:
            raise ValueError("outer")  # noqa: B904  (an implicit context, on purpose)
    except ValueError as exc:
        assert describe_failure(exc) == "ValueError: outer; caused by KeyError: 'inner'"
    try:
        try:
            raise KeyError("inner")
        except KeyError:
            raise ValueError("outer") from None
    except ValueError as exc:
        assert describe_failure(exc) == "ValueError: outer"
    looped = RuntimeError("a")
    looped.__cause__ = RuntimeError("b")
    looped.__cause__.__cause__ = looped  # a cycle ends
    assert describe_failure(looped) == "RuntimeError: a; caused by RuntimeError: b"


def test_template_error_fails_only_its_sample() -> None:
    genrm = GenRM(FakeJudgeEngine(), template=verification_template(), parser=YesNoParser())
    samples = [Sample(prompt="q", response="4", reference="4"), Sample(prompt="q", response="4")]
    ok, missing = genrm.score(samples)
    assert ok.status == "ok"
    assert missing.status == "error" and "{reference}" in missing.error


def test_prompt_over_the_judge_context_fails_only_its_sample() -> None:
    genrm = GenRM(
        FakeJudgeEngine(),
        template=JudgeTemplate(user="{prompt}{response}", max_response_tokens=16),
        parser=YesNoParser(),
        max_prompt_tokens=200,
    )
    short, long = genrm.score(
        [Sample(prompt="q", response="4"), Sample(prompt="x" * 500, response="4")]
    )
    assert short.status == "ok"
    assert long.status == "error" and "max_prompt_tokens=200" in long.error
    # The row is too long for the judge: a data skip, not the judge's error.
    assert long.skip_cause == long.error
    stats = ScoreStats.from_verdicts([short, long])
    assert (stats.num_ok, stats.num_errors, stats.num_data_skips) == (1, 0, 1)


@pytest.mark.parametrize("field", ["reference", "response", "prompt", "row"])
def test_a_lone_surrogate_is_a_data_skip_not_a_crash(field) -> None:
    """The issue: a lone surrogate in the answer field killed the run in preflight with a raw
    tokenizer TypeError; later such rows failed as judge errors."""
    genrm = GenRM(
        FakeJudgeEngine(),
        template=JudgeTemplate(user="{prompt} {response} {reference}"),
        parser=YesNoParser(),
    )
    bad = {"prompt": "q", "response": "4", "reference": "4", "metadata": {}}
    if field == "row":
        bad["metadata"] = {"note": "x\ud800y"}
    else:
        bad[field] = "x\ud800y"
    samples = [Sample(**bad), Sample(prompt="q", response="4", reference="4")]
    for verdicts in (genrm.score(samples), asyncio.run(genrm.ascore(samples))):
        skipped, fine = verdicts
        assert skipped.status == "error" and fine.status == "ok"
        assert skipped.skip_cause is not None and "not valid Unicode" in skipped.skip_cause
        assert "surrogates not allowed" in skipped.skip_cause
        stats = ScoreStats.from_verdicts(verdicts)
        assert (stats.num_errors, stats.num_data_skips) == (0, 1)


def test_score_batches_by_max_batch_size() -> None:
    from yatt.genrm import BatchingConfig

    engine = FakeJudgeEngine()
    genrm = GenRM(
        engine,
        template=verification_template(),
        parser=YesNoParser(),
        batching=BatchingConfig(max_batch_size=4),
    )
    assert len(genrm.score(_samples(["4"] * 10))) == 10
    assert [c.num_requests for c in engine.calls] == [4, 4, 2]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"votes": 0}, "votes=0"),
        ({"votes": 3, "sampling": SamplingParams(temperature=0.0)}, "greedy votes"),
        ({"sampling": SamplingParams(n=4)}, "sampling.n=4"),
        ({"aggregate": "median"}, "aggregate='median'"),
        ({"default_reward": float("inf")}, "default_reward"),
        ({"parser": object()}, "parse"),
    ],
    ids=["votes", "greedy_votes", "n", "aggregate", "default_reward", "parser"],
)
def test_bad_configuration_is_rejected(kwargs: dict, match: str) -> None:
    args = {"template": verification_template(), "parser": ScoreParser(), **kwargs}
    with pytest.raises(ValueError, match=match):
        GenRM(FakeJudgeEngine(), **args)


def test_prompt_tokens_count_the_judges_load() -> None:
    engine = FakeJudgeEngine()
    genrm = GenRM(engine, template=JudgeTemplate(user="{response}!"), parser=YesNoParser(), votes=3)
    samples = [Sample(prompt="q", response="ab"), Sample(prompt="q", response="abcdefgh")]
    verdicts = genrm.score(samples)
    lengths = [len(genrm.template.render_ids(s, engine.tokenizer)[0]) for s in samples]
    assert lengths[1] - lengths[0] == 6  # one token per byte: the longer response shows
    assert genrm.metrics["num_prompt_tokens"] == 3 * sum(lengths)  # every vote reads the prompt
    # Each verdict carries its own share: a call's load without differencing the counter.
    assert [v.num_judge_prompt_tokens for v in verdicts] == [3 * n for n in lengths]
    assert [v.num_judge_response_tokens for v in verdicts] == [3 * len("Yes")] * 2
    stats = ScoreStats.from_verdicts(verdicts)
    assert stats.num_judge_prompt_tokens == genrm.metrics["num_prompt_tokens"]
