"""Issue 46: the reward functions' calling form and worker count as config fields
(JudgeSpec.function_forms, JudgeSpec.function_workers), checked when the spec is built and
honoured by build_judge."""

NUM_GPUS = 0

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from yatt import genrm
from yatt.genrm import _judge_build

REWARDS = textwrap.dedent(
    """
    def by_name(prompt, response, reference, row):
        return float(response == reference)

    def unnamed(*args, **kwargs):
        # TRL's call passes prompts= and completions= by keyword: one reward per completion.
        if "completions" in kwargs:
            return [float(c == "4") for c in kwargs["completions"]]
        return 0.5  # any other call: a value no TRL-form verdict can give

    def both(solution_str, ground_truth, completions=None, **kwargs):
        # verl's call passes one solution_str; TRL's would pass completions as a list.
        return 1.0 if solution_str == ground_truth else -1.0

    def trl_only(prompts, completions, **kwargs):
        return [1.0 for _ in completions]
    """
)


@dataclass(kw_only=True)
class _Reward(genrm.JudgeSpec):
    section: ClassVar[str] = "reward"


@pytest.fixture
def rewards(tmp_path: Path) -> str:
    path = tmp_path / "form_rewards.py"
    path.write_text(REWARDS)
    return str(path)


def _spec(rewards: str, names: list[str], **kwargs) -> _Reward:
    return _Reward(backend="none", functions=[f"{rewards}:{n}" for n in names], **kwargs)


def _samples() -> list[genrm.Sample]:
    return [genrm.Sample(prompt="2+2=", response=r, reference="4") for r in ("4", "5")]


def _score(spec: _Reward) -> list[float]:
    owned: list = []
    scorer, _ = genrm.build_judge(spec, None, owned)
    try:
        verdicts = scorer.score(_samples())
        assert all(v.status == "ok" for v in verdicts), [v.error for v in verdicts]
        return [v.reward for v in verdicts]
    finally:
        for closeable in owned:
            closeable.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"function_forms": ["batch"]}, r"reward\.function_forms\[0\]='batch': use one of"),
        ({"function_forms": ["trl", "verl"]}, r"reward\.function_forms=.*one form per"),
        ({"function_forms": "trl"}, r"reward\.function_forms='trl': a list"),
        ({"function_workers": -1}, r"reward\.function_workers=-1: must be >= 0"),
        ({"function_workers": 65}, r"reward\.function_workers=65: must be <= 64"),
        ({"function_workers": 2.5}, r"reward\.function_workers=2\.5: an int"),
        ({"function_workers": True}, r"reward\.function_workers=True: an int"),
        (
            {"function_workers": 2, "function_timeout_s": 0.0},
            r"reward\.function_workers=2: with reward\.function_timeout_s=0",
        ),
    ],
    ids=[
        "unknown-form",
        "forms-length",
        "forms-not-a-list",
        "negative-workers",
        "too-many-workers",
        "fractional-workers",
        "bool-workers",
        "workers-in-process",
    ],
)
def test_bad_values_name_the_field(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        _Reward(backend="none", functions=["m:f"], **kwargs)


def test_workers_without_functions_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"reward\.function_workers=3: .*functions is empty"):
        _Reward(function_workers=3)


def test_forms_default_to_auto_each_and_integral_floats_are_ints() -> None:
    spec = _Reward(backend="none", functions=["m:f", "m:g"], function_workers=4.0)
    assert spec.function_forms == ["auto", "auto"]
    assert spec.function_workers == 4 and isinstance(spec.function_workers, int)


@pytest.mark.parametrize("name", ["unnamed", "both"])
def test_a_signature_the_names_cannot_settle_asks_for_its_form(rewards, name) -> None:
    spec = _spec(rewards, ["by_name", name])
    with pytest.raises(ValueError, match=r"reward\.function_forms\[1\] .*cannot be told") as e:
        genrm.check_judge_resources(spec)
    assert "set its form" in str(e.value)


def test_a_declared_form_overrides_detection(rewards) -> None:
    # unnamed as TRL's batch: a list over the completions ("4" -> 1, "5" -> 0)
    assert _score(_spec(rewards, ["unnamed"], function_forms=["trl"])) == [1.0, 0.0]
    # unnamed per sample: the fallback value, 0.5 each
    assert _score(_spec(rewards, ["unnamed"], function_forms=["sample"])) == [0.5, 0.5]
    # both as verl's compute_score: solution_str against ground_truth
    assert _score(_spec(rewards, ["both"], function_forms=["verl"])) == [1.0, -1.0]
    # detection by name stays for the others ("auto"): by_name is yatt's form
    spec = _spec(rewards, ["by_name", "both"], function_forms=["auto", "verl"])
    assert _score(spec) == [2.0, -1.0]


def test_a_declared_form_that_does_not_fit_names_the_field(rewards) -> None:
    spec = _spec(rewards, ["trl_only"], function_forms=["verl"])
    with pytest.raises(ValueError, match=r"reward\.function_forms\[0\] .*cannot be called as"):
        genrm.check_judge_resources(spec)


def test_the_functions_share_one_pool_of_function_workers(rewards) -> None:
    spec = _spec(rewards, ["by_name", "trl_only"], function_workers=3)
    owned: list = []
    genrm.build_judge(spec, None, owned)
    try:
        functions = [c for c in owned if isinstance(c, genrm.RewardFunction)]
        assert len(functions) == 2
        assert functions[0]._pool is functions[1]._pool
        assert functions[0]._pool.num_workers == 3
    finally:
        for closeable in owned:
            closeable.close()


def test_the_default_pool_is_sized_from_the_rank_s_cpus(rewards, monkeypatch) -> None:
    monkeypatch.setattr(_judge_build, "default_function_workers", lambda: 5)
    owned: list = []
    genrm.build_judge(_spec(rewards, ["by_name"]), None, owned)
    try:
        (function,) = [c for c in owned if isinstance(c, genrm.RewardFunction)]
        assert function._pool.num_workers == 5
    finally:
        for closeable in owned:
            closeable.close()


@pytest.mark.parametrize(
    ("num_cpus", "local_world_size", "expected"),
    [
        (2, None, 1),  # a 2-core machine: one worker beside the trainer
        (1, None, 1),  # never none
        (4, None, 3),
        (64, None, 8),  # at most 8
        (8, "2", 3),  # two ranks on 8 cores: 4 each, one left to each trainer
        (2, "2", 1),
        (4, "x", 3),  # an unreadable LOCAL_WORLD_SIZE counts as one rank
    ],
)
def test_default_function_workers(monkeypatch, num_cpus, local_world_size, expected) -> None:
    monkeypatch.setattr(_judge_build.os, "sched_getaffinity", lambda pid: set(range(num_cpus)))
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert _judge_build.default_function_workers() == expected
