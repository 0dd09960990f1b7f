"""AccuracySignal and JudgeSpec.accuracy: accuracy is read only from the signal a run declares
(issue 46), never from the reward; a verdict without the signal reads None, not 0."""

NUM_GPUS = 0

from dataclasses import dataclass
from typing import ClassVar

import pytest

from yatt import genrm


@dataclass(kw_only=True)
class _Reward(genrm.JudgeSpec):
    section: ClassVar[str] = "reward"


def _verdict(reward=0.5, components=None, metrics=None):
    return genrm.Verdict(
        sample_id="s",
        reward=reward,
        status="ok",
        components=components or {},
        metrics=metrics or {},
    )


RIGHT = genrm.Sample(prompt="3+4=", response="7", reference="7")
WRONG = genrm.Sample(prompt="3+4=", response="8", reference="7")


def test_the_rule_is_computed_from_the_sample_when_the_reward_does_not_weigh_it():
    accuracy = genrm.AccuracySignal("exact_match", rules=[genrm.ExactMatch()])
    # a judged reward of +1 on a wrong answer: accuracy says 0, the reward does not leak in
    assert accuracy.read(WRONG, _verdict(reward=1.0, components={"judge": 1.0})) == 0.0
    assert accuracy.read(RIGHT, _verdict(reward=-1.0)) == 1.0
    no_reference = genrm.Sample(prompt="q", response="7")
    assert accuracy.read(no_reference, _verdict()) == 0.0  # as the rule's old metric did


def test_a_weighted_rule_is_read_from_its_verdict_component():
    accuracy = genrm.AccuracySignal("exact_match", rules=[genrm.ExactMatch()])
    # the verdict's own value wins over recomputing (the sample says right, the verdict 0)
    assert accuracy.read(RIGHT, _verdict(components={"exact_match": 0.0})) == 0.0


def test_a_function_key_and_a_function_component_are_read_missing_ones_are_none():
    by_key = genrm.AccuracySignal("rewards:compute_score/acc")
    carried = _verdict(reward=0.1, metrics={"rewards:compute_score/acc": 1.0})
    assert by_key.read(WRONG, carried) == 1.0
    assert by_key.read(WRONG, _verdict(reward=0.9)) is None  # not 0: counted by the caller
    by_name = genrm.AccuracySignal("rewards:exact")
    assert by_name.read(WRONG, _verdict(components={"rewards:exact": 1.0})) == 1.0
    assert by_name.read(WRONG, _verdict(components={"rewards:exact": None})) is None


def test_from_spec_is_none_when_nothing_is_declared():
    assert genrm.AccuracySignal.from_spec(_Reward(), genrm.ExactMatch()) is None
    signal = genrm.AccuracySignal.from_spec(_Reward(accuracy="exact_match"), genrm.ExactMatch())
    assert signal.read(RIGHT, _verdict()) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accuracy": 1}, r"reward\.accuracy=1: a signal name"),
        ({"accuracy": " exact_match"}, r"reward\.accuracy=' exact_match'"),
        (
            {"backend": "none", "rule_weight": 1.0, "accuracy": "judge"},
            r"reward\.accuracy='judge': reward\.backend='none' has no judge",
        ),
        ({"accuracy": "rewards:score/acc"}, r"reward\.accuracy='rewards:score/acc': no reward"),
    ],
)
def test_bad_accuracy_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _Reward(**kwargs)


def test_good_accuracy_values_are_kept():
    assert _Reward(accuracy="exact_match").accuracy == "exact_match"
    assert _Reward(accuracy="judge").accuracy == "judge"
    spec = _Reward(backend="none", functions=["os.path:join"], accuracy="os.path:join/acc")
    assert spec.accuracy == "os.path:join/acc"
