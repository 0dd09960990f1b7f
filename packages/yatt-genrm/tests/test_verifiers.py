NUM_GPUS = 0

import asyncio
import re
from fractions import Fraction

import pytest

from yatt.genrm import (
    CombinedRM,
    ExactMatch,
    GenRM,
    JudgeTemplate,
    NumericMatch,
    RegexMatch,
    Sample,
    YesNoParser,
)
from yatt.genrm._verifiers import parse_number
from yatt.genrm.testing import FakeJudgeEngine


def _s(response: str, reference: str | None) -> Sample:
    return Sample(prompt="q", response=response, reference=reference)


EXACT_CASES = [
    ("same", "Paris", "Paris", 1.0),
    ("case_and_punct", "**paris.**", "Paris", 1.0),
    ("boxed", "So the answer is \\boxed{Paris}", "paris", 1.0),
    ("last_boxed_counts", "\\boxed{Rome} no wait \\boxed{Paris}", "Paris", 1.0),
    ("different", "Lyon", "Paris", 0.0),
    ("substring_is_not_match", "Paris, Texas", "Paris", 0.0),
    ("no_reference", "Paris", None, None),
]


@pytest.mark.parametrize(
    ("response", "reference", "expected"),
    [c[1:] for c in EXACT_CASES],
    ids=[c[0] for c in EXACT_CASES],
)
def test_exact_match(response, reference, expected) -> None:
    assert ExactMatch().verify(_s(response, reference)) == expected


NUMERIC_CASES = [
    ("integer", "The answer is 42", "42", 1.0),
    ("boxed_fraction", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("thousands", "Total: 1,234", "1234", 1.0),
    ("percent", "50%", "0.5", 1.0),
    ("negative_decimal", "x = -3.50", "-3.5", 1.0),
    ("last_number_counts", "Try 7, then 8", "8", 1.0),
    ("wrong", "41", "42", 0.0),
    ("no_number", "I don't know", "42", 0.0),
    ("no_reference", "42", None, None),
]


@pytest.mark.parametrize("use_math_verify", [False, True], ids=["builtin", "math_verify"])
@pytest.mark.parametrize(
    ("response", "reference", "expected"),
    [c[1:] for c in NUMERIC_CASES],
    ids=[c[0] for c in NUMERIC_CASES],
)
def test_numeric_match(response, reference, expected, use_math_verify) -> None:
    if use_math_verify:
        pytest.importorskip("math_verify")
    got = NumericMatch(use_math_verify=use_math_verify).verify(_s(response, reference))
    assert got == expected


def test_math_verify_handles_symbolic_answers() -> None:
    pytest.importorskip("math_verify")
    assert NumericMatch().verify(_s("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}")) == 1.0
    assert NumericMatch(use_math_verify=False).verify(_s("\\boxed{\\sqrt{2}/2}", "0.7071")) == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3/4", Fraction(3, 4)), ("1,000.5", Fraction(2001, 2)), ("5/0", None), ("none", None)],
    ids=["fraction", "thousands_decimal", "div_zero", "none"],
)
def test_parse_number(text, expected) -> None:
    assert parse_number(text) == expected


def test_regex_match() -> None:
    assert RegexMatch(pattern=r"\bparis\b").verify(_s("It is PARIS.", None)) == 1.0
    assert RegexMatch().verify(_s("answer: 12", r"\b1[0-9]\b")) == 1.0  # reference as pattern
    assert RegexMatch().verify(_s("answer: 12", None)) is None
    assert RegexMatch().verify(_s("x", "(unclosed")) is None  # hostile reference, no raise
    with pytest.raises(ValueError, match="does not compile"):
        RegexMatch(pattern="(unclosed")


def _judge_engine() -> FakeJudgeEngine:
    # The judge likes responses that say "please", whatever their correctness.
    return FakeJudgeEngine(
        judge=lambda p, k: "Yes" if "please" in re.search(r"R=(.*)", p).group(1) else "No"
    )


def _genrm(engine: FakeJudgeEngine) -> GenRM:
    return GenRM(engine, template=JudgeTemplate(user="R={response}"), parser=YesNoParser())


SAMPLES = [
    _s("42 please", "42"),  # rule 1, judge +1
    _s("42", "42"),  # rule 1, judge -1
    _s("41 please", "42"),  # rule 0, judge +1
    _s("41", "42"),  # rule 0, judge -1
]


def test_weighted_sum() -> None:
    combined = CombinedRM(_genrm(_judge_engine()), [(NumericMatch(), 2.0)], judge_weight=0.5)
    verdicts = combined.score(SAMPLES)
    assert [v.reward for v in verdicts] == [2.5, 1.5, 0.5, -0.5]
    assert verdicts[0].components == {"numeric_match": 1.0, "judge": 1.0}


def test_rule_gate_skips_the_judge_for_failed_answers() -> None:
    engine = _judge_engine()
    combined = CombinedRM(_genrm(engine), [(NumericMatch(), 1.0)], mode="gate", gate_reward=-1.0)
    verdicts = combined.score(SAMPLES)
    assert [v.reward for v in verdicts] == [1.0, -1.0, -1.0, -1.0]
    assert sum(c.num_requests for c in engine.calls) == 2  # only the rule-passing ones
    assert verdicts[2].components == {"numeric_match": 0.0, "judge": None}
    assert combined.metrics["num_gated"] == 2


def test_combined_streaming_matches_blocking() -> None:
    blocking = CombinedRM(_genrm(_judge_engine()), [(NumericMatch(), 1.0)], mode="gate")
    streaming = CombinedRM(_genrm(_judge_engine()), [(NumericMatch(), 1.0)], mode="gate")
    expected = {s.id: v.reward for s, v in zip(SAMPLES, blocking.score(SAMPLES), strict=True)}

    async def main() -> dict[str, float]:
        async def producer() -> None:
            for s in SAMPLES * 1:
                await streaming.submit(s)
            await streaming.finish()

        task = asyncio.create_task(producer())
        got = {v.sample_id: v.reward async for v in streaming.results()}
        await task
        await streaming.aclose()
        return got

    assert asyncio.run(main()) == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rules": []}, "rules is empty"),
        ({"mode": "max"}, "mode='max'"),
        ({"rules": [(ExactMatch(), 1.0), (ExactMatch(), 1.0)]}, "unique"),
        ({"rules": [(ExactMatch(), float("nan"))]}, "finite weight"),
    ],
    ids=["empty", "mode", "duplicate", "nan_weight"],
)
def test_combined_rejects_bad_config(kwargs, match) -> None:
    args = {"rules": [(ExactMatch(), 1.0)], **kwargs}
    with pytest.raises(ValueError, match=match):
        CombinedRM(_genrm(_judge_engine()), **args)
