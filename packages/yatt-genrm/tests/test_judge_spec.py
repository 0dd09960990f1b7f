"""JudgeSpec: the judge as a config section (checked when built, reading nothing), and
build_judge making the scorer a trainer calls."""

NUM_GPUS = 0

from dataclasses import dataclass
from typing import ClassVar

import pytest

from yatt import genrm
from yatt.genrm.testing import FakeJudgeEngine


@dataclass(kw_only=True)
class _Reward(genrm.JudgeSpec):
    section: ClassVar[str] = "reward"


_ENDPOINT = {"base_url": "http://127.0.0.1:9/v1", "model": "m"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "tgi"}, r"reward\.backend='tgi': use one of"),
        ({"votes": 0}, r"reward\.votes=0: must be >= 1"),
        ({"votes": 65}, r"reward\.votes=65: must be <= 64"),
        (
            {"function_timeout_s": 1e10},
            r"reward\.function_timeout_s=10000000000\.0: must be <= 86400",
        ),
        ({"rule_weight": float("nan")}, r"reward\.rule_weight=nan: must be a finite number"),
        ({"judge_template": "{prompt:>99999999}"}, r"\{prompt:>99999999\} has a format spec"),
        ({"backend": "none"}, r"reward\.backend='none' loads no judge"),
        ({"backend_options": {"x": 1}}, r"reward\.backend_options=\{'x': 1\}: only for"),
        ({"backend": "openai", "backend_options": {"x": 1}}, r"not 'openai'"),
        (
            {"backend": "openai", "openai": {**_ENDPOINT, "max_retries": 1e9}},
            r"reward\.openai\.max_retries=1000000000: must be <= 20",
        ),
        ({"openai": _ENDPOINT}, r"reward\.openai=.*only for reward\.backend='openai'"),
        ({"verdict_parser": "nonsense"}, r"reward\.verdict_parser='nonsense'"),
        (
            {"backend": "none", "functions": ["os.path:join", "os.path:join"]},
            r"'os\.path:join' is listed twice",
        ),
    ],
)
def test_bad_values_name_the_field_when_the_spec_is_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _Reward(**kwargs)


def test_resources_are_checked_apart_from_the_values(monkeypatch):
    monkeypatch.delenv("YATT_NO_SUCH_KEY", raising=False)
    spec = _Reward(backend="openai", openai={**_ENDPOINT, "api_key_env": "YATT_NO_SUCH_KEY"})
    with pytest.raises(ValueError, match=r"reward\.openai: .*YATT_NO_SUCH_KEY.*not set"):
        genrm.check_judge_resources(spec)
    with pytest.raises(ValueError, match=r"reward\.functions: .*no_such_module"):
        genrm.check_judge_resources(_Reward(backend="none", functions=["no_such_module:f"]))


def test_build_judge_reads_verdicts_and_adds_the_rule():
    spec = _Reward(verdict_from="text", rule_weight=0.5, judge_template="{prompt}{response}")
    outputs = iter(["Yes", "No"])
    engine = FakeJudgeEngine(judge=lambda prompt, vote: next(outputs))
    closeables: list = []
    scorer, exact_match = genrm.build_judge(spec, engine, closeables)
    samples = [
        genrm.Sample(prompt="2+2=", response="4", reference="4"),
        genrm.Sample(prompt="2+2=", response="5", reference="4"),
    ]
    verdicts = scorer.score(samples)
    # judge +1 / -1, plus 0.5 x the exact-match rule (1 for "4", 0 for "5")
    assert [v.reward for v in verdicts] == [1.5, -1.0]
    assert isinstance(exact_match, genrm.ExactMatch) and closeables == [scorer]
    for closeable in closeables:
        closeable.close()
