"""GenRM reads engine capabilities through yatt.rollout's protocols: an engine that does not
declare a capability does not have it (the safe default for a judge: text verdicts, no images),
and the fake judge engine of yatt.genrm.testing declares what it does."""

NUM_GPUS = 0

import types

from yatt.genrm._label_verdict import supports_label_logprobs
from yatt.genrm.testing import FakeJudgeEngine
from yatt.rollout import Abortable, AcceptsImages, RolloutEngine, SupportsLabelLogprobs


def test_label_logprobs_only_when_the_engine_says_so():
    assert supports_label_logprobs(types.SimpleNamespace(supports_label_logprobs=True))
    assert not supports_label_logprobs(types.SimpleNamespace(supports_label_logprobs=False))
    assert not supports_label_logprobs(types.SimpleNamespace())  # undeclared: no


def test_fake_judge_engine_can_abort_and_declares_nothing_else():
    engine = FakeJudgeEngine()
    assert isinstance(engine, RolloutEngine)
    assert isinstance(engine, Abortable)
    assert not isinstance(engine, SupportsLabelLogprobs)
    assert not isinstance(engine, AcceptsImages)
    assert not supports_label_logprobs(engine)
