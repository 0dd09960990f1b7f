"""genrm.generate_and_judge, judge_prompts and judged_samples with a fake engine, judge and
plan: responses paired with their verdicts, each phase timed, the judge's tail measured and
the memory split moved by the round's loads (the round the reference trainer and bench/step
run)."""

NUM_GPUS = 0

import contextlib
from typing import Any

import pytest

from yatt import genrm, rollout
from yatt.genrm.testing import RecordingScorer

ROLLOUT_GAP_S = 0.03  # the fake engine's time before each response
JUDGE_TAIL_S = 0.05  # the fake judge's time after the last sample before its verdicts


class _FakeEngine:
    """Each request's one response is its index; streamed last request first, one per gap."""

    def _completion(self, index: int, request) -> object:
        from yatt import rollout

        return rollout.Completion(
            request_index=index,
            sample_index=0,
            prompt_ids=list(request.prompt_ids),
            response_ids=[index] * (index + 1),
            logprobs=[0.0] * (index + 1),
            finish_reason="length",
        )

    def generate(self, requests, sampling):
        return [self._completion(i, r) for i, r in enumerate(requests)]

    async def stream(self, requests, sampling):
        import asyncio

        for i in reversed(range(len(requests))):
            await asyncio.sleep(ROLLOUT_GAP_S)
            yield self._completion(i, requests[i])


def _judge(plan) -> RecordingScorer:
    """Reward = the response's request index (its text); `phases` notes the plan's phase at
    each judged sample. Streamed verdicts come JUDGE_TAIL_S after the last sample."""
    phases: list[str | None] = []
    judge = RecordingScorer(
        lambda sample: float(sample.response),
        tail_s=JUDGE_TAIL_S,
        on_verdict=lambda sample: phases.append(plan.current_phase),
    )
    judge.phases = phases
    return judge


def _judge_round(plan, should_overlap: bool, timings: dict) -> tuple[list, list, Any, list]:
    judge = _judge(plan)
    requests = [rollout.Request(prompt_ids=[7] * (i + 2)) for i in range(4)]
    completions, verdicts = genrm.generate_and_judge(
        requests,
        rollout.SamplingParams(max_new_tokens=8),
        lambda c: genrm.Sample(prompt="q" * len(c.prompt_ids), response=str(c.request_index)),
        engine=_FakeEngine(),
        scorer=judge,
        plan=plan,
        should_overlap=should_overlap,
        timings=timings,
    )
    timers = [name for name in timings if name != "genrm_tail"]  # the phases timed, in order
    return completions, verdicts, judge, timers


class _FakePlan:
    """A yatt.placement.Plan's surface as a round uses it: phases, the current phase, the
    memory split's load updates (recorded)."""

    def __init__(self, mode: str) -> None:
        # full: rollout, genrm and train take turns; partial: rollout and genrm resident
        # together (one rollout phase, a memory split); no_judge: the judge lives elsewhere
        self.phases = ("rollout", "genrm", "train") if mode == "full" else ("rollout", "train")
        self.has_memory_split = mode == "partial"
        self.current_phase: str | None = None
        self.loads: list[dict] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        assert name in self.phases, name
        self.current_phase = name
        try:
            yield
        finally:
            self.current_phase = None

    def update_load(self, **load) -> float:
        self.loads.append(load)
        return 0.5


def _fake_plan(mode: str) -> _FakePlan:
    return _FakePlan(mode)


def test_an_overlapped_round_pairs_verdicts_times_the_judges_tail_and_moves_the_split():
    plan, timings = _fake_plan("partial"), {}
    loads = plan.loads
    completions, verdicts, judge, timers = _judge_round(plan, True, timings)
    # Arrival order (last request first), each verdict its own response's.
    assert [c.request_index for c in completions] == [3, 2, 1, 0]
    assert [v.reward for v in verdicts] == [3.0, 2.0, 1.0, 0.0]
    assert timers == ["rollout+genrm"] and set(judge.phases) == {"rollout"}
    # The tail: from the last response (after 4 gaps) to the last verdict (the judge's delay).
    assert timings["genrm_tail"] >= JUDGE_TAIL_S
    assert timings["genrm_tail"] <= timings["rollout+genrm"] - 4 * ROLLOUT_GAP_S
    # The split follows the round's loads: prompt + response tokens, the judge's prompt tokens.
    rollout_tokens = sum((i + 2) + (i + 1) for i in range(4))
    assert loads == [{"rollout_pending_tokens": rollout_tokens, "genrm_pending_tokens": 14}]
    _judge_round(plan, True, timings)  # a second round adds its tail
    assert timings["genrm_tail"] >= 2 * JUDGE_TAIL_S


@pytest.mark.parametrize("mode", ["full", "no_judge"])
def test_a_round_in_phases_judges_in_the_genrm_phase_or_outside_any(mode):
    plan, timings = _fake_plan(mode), {}
    completions, verdicts, judge, timers = _judge_round(plan, False, timings)
    assert [c.request_index for c in completions] == [0, 1, 2, 3]
    assert [v.reward for v in verdicts] == [0.0, 1.0, 2.0, 3.0]
    assert timers == ["rollout", "genrm"] and "genrm_tail" not in timings
    assert set(judge.phases) == ({"genrm"} if mode == "full" else {None})


def test_judge_prompts_pairs_each_response_with_its_prompt_and_what_the_judge_read():
    plan, timings = _fake_plan("full"), {}
    judge = _judge(plan)
    prompts = ["p0", "p1", "p2"]
    seen = []

    def to_sample(prompt, completion):
        seen.append((prompt, completion.request_index))
        return genrm.Sample(prompt=prompt, response=str(completion.request_index))

    judged = genrm.judge_prompts(
        prompts,
        rollout.SamplingParams(max_new_tokens=8),
        to_request=lambda p: rollout.Request(prompt_ids=[7] * (int(p[1]) + 2)),
        to_sample=to_sample,
        engine=_FakeEngine(),
        scorer=judge,
        plan=plan,
        should_overlap=False,
        timings=timings,
    )
    assert seen == [("p0", 0), ("p1", 1), ("p2", 2)]  # once per response
    assert [item.prompt for item in judged] == prompts
    assert [item.sample.prompt for item in judged] == prompts
    assert [item.verdict.reward for item in judged] == [0.0, 1.0, 2.0]
    assert [item.completion.prompt_ids for item in judged] == [[7] * 2, [7] * 3, [7] * 4]


def test_judged_samples_reads_a_streamed_group_with_its_payload():
    completions = [_FakeEngine()._completion(i, rollout.Request(prompt_ids=[1])) for i in (0, 1)]
    samples = [genrm.Sample(prompt="q", response=str(i)) for i in (0, 1)]
    verdicts = [
        genrm.Verdict(sample_id=s.id, reward=float(i), status="ok") for i, s in enumerate(samples)
    ]
    group = type(
        "G",
        (),
        {"completions": completions, "samples": samples, "verdicts": verdicts, "payload": "P"},
    )
    judged = genrm.judged_samples(group)
    assert [(j.completion, j.sample, j.verdict, j.prompt) for j in judged] == [
        (completions[0], samples[0], verdicts[0], "P"),
        (completions[1], samples[1], verdicts[1], "P"),
    ]


@pytest.mark.parametrize("should_overlap", [False, True])
def test_a_stop_flag_reaches_the_judge_and_ends_the_round(should_overlap):
    # issue 49: a trainer's stop signal reaches a blocking score() and score_as_completed
    plan = _fake_plan("partial" if should_overlap else "full")
    requests = [rollout.Request(prompt_ids=[7, 7]) for _ in range(3)]
    kwargs = dict(
        engine=_FakeEngine(),
        scorer=_judge(plan),  # ScoringStopped once should_stop is true
        plan=plan,
        should_overlap=should_overlap,
        timings={},
    )
    to_sample = lambda c: genrm.Sample(prompt="q", response=str(c.request_index))  # noqa: E731
    sampling = rollout.SamplingParams(max_new_tokens=8)
    with pytest.raises(genrm.ScoringStopped):
        genrm.generate_and_judge(requests, sampling, to_sample, should_stop=lambda: True, **kwargs)
    _, verdicts = genrm.generate_and_judge(
        requests, sampling, to_sample, should_stop=lambda: False, **kwargs
    )
    assert sorted(v.reward for v in verdicts) == [0.0, 1.0, 2.0]
