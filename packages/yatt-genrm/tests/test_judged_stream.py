"""genrm.JudgedStream: responses judged as the engine yields them, groups handed back whole with
their payload, the long tail cut and its groups kept (tokens and logprobs) to resume, the live
queues recorded for the memory split. A scripted engine stands in for the rollout: each test
states which responses finish, which the abort cuts, and what the stream must make of them."""

NUM_GPUS = 0

import asyncio
from dataclasses import dataclass

import pytest

from yatt import genrm, rollout
from yatt.genrm.testing import RecordingScorer
from yatt.placement import PendingLoad


@dataclass
class _Prompt:  # the caller's payload: the stream never looks inside it
    text: str
    ids: list[int]


def _request(prompt: _Prompt) -> rollout.Request:
    return rollout.Request(prompt_ids=list(prompt.ids), metadata={"origin": prompt.text})


def _sample(prompt: _Prompt, completion: rollout.Completion) -> genrm.Sample:
    return genrm.Sample(prompt=prompt.text, response=str(completion.response_ids))


class _Engine:
    """Answers each sample with `tokens` (logprob -0.5 each), except the samples in `hold`
    ((request's origin text, sample index)): those wait for abort() and come back "abort"
    with their first token. Records every call."""

    def __init__(self, *, tokens=(7, 8), hold=()) -> None:
        self.tokens = list(tokens)
        self.hold = set(hold)
        self.calls: list[tuple[list[rollout.Request], rollout.SamplingParams]] = []
        self.aborted = asyncio.Event()

    def stream(self, requests, sampling):
        self.calls.append((list(requests), sampling))

        async def completions():
            held = []
            for i, request in enumerate(requests):
                for j in range(sampling.n):
                    args = dict(request_index=i, sample_index=j, metadata=dict(request.metadata))
                    if (request.metadata.get("origin"), j) in self.hold:
                        held.append(args | {"prompt_ids": list(request.prompt_ids)})
                        continue
                    yield rollout.Completion(
                        prompt_ids=list(request.prompt_ids),
                        response_ids=list(self.tokens),
                        logprobs=[-0.5] * len(self.tokens),
                        finish_reason="stop",
                        **args,
                    )
            if held:
                await self.aborted.wait()
            for args in held:
                yield rollout.Completion(
                    response_ids=self.tokens[:1], logprobs=[-0.5], finish_reason="abort", **args
                )

        return completions()

    def abort(self) -> None:
        self.aborted.set()


def _judge() -> RecordingScorer:
    """Reward = the response's length (so each verdict names its response)."""
    return RecordingScorer(lambda sample: float(len(sample.response)))


class _Sampler:
    """Asks for `draws` in turn (then 0); full once `target` groups were kept."""

    def __init__(self, draws, target) -> None:
        self.draws = list(draws)
        self.target = target
        self.kept: list[genrm.StreamedGroup] = []
        self.in_flight_seen: list[int] = []

    def num_to_draw(self, *, in_flight: int) -> int:
        self.in_flight_seen.append(in_flight)
        return self.draws.pop(0) if self.draws else 0

    def should_abort(self) -> bool:
        return len(self.kept) >= self.target


class _Carry:
    def __init__(self, groups=()) -> None:
        self.groups = list(groups)
        self.taken_at: list[int] = []

    def take(self, step):
        self.taken_at.append(step)
        groups, self.groups = self.groups, []
        return groups

    def put(self, group):
        self.groups.append(group)


def _stream(engine, *, n=2, max_new_tokens=4, seed=3, step=5, carry=None, load=None):
    return genrm.JudgedStream(
        engine=engine,
        scorer=_judge(),
        sampling=rollout.SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed),
        to_request=_request,
        to_sample=_sample,
        step=step,
        carry=carry,
        load=load,
    )


def _prompts(count: int) -> list[_Prompt]:
    return [_Prompt(text=f"q{i}", ids=[10 + i, 20 + i, 30 + i]) for i in range(count)]


def test_each_group_comes_back_whole_with_its_payload_and_what_the_judge_read():
    engine = _Engine()
    stream = _stream(engine)
    sampler = _Sampler(draws=[2], target=2)
    prompts = _prompts(2)
    asyncio.run(stream.run(sampler, draw=lambda count: prompts[:count], keep=sampler.kept.append))
    assert sorted(group.payload.text for group in sampler.kept) == ["q0", "q1"]
    for group in sampler.kept:
        assert [c.sample_index for c in group.completions] == [0, 1]  # by sample index
        assert [s.prompt for s in group.samples] == [group.payload.text] * 2
        assert [s.response for s in group.samples] == ["[7, 8]"] * 2
        assert [v.reward for v in group.verdicts] == [6.0, 6.0]  # len("[7, 8]")
    assert stream.num_in_flight == 0 and stream.cut_groups() == []
    # the caller's request kept (its metadata too), the group key added
    ((requests, sampling),) = engine.calls
    assert [(r.prompt_ids, r.metadata) for r in requests] == [
        ([10, 20, 30], {"origin": "q0", "group": 0}),
        ([11, 21, 31], {"origin": "q1", "group": 1}),
    ]
    assert sampling.n == 2 and sampling.seed == 3 + 7_919  # the first call's own seed


def test_the_engine_is_fed_again_while_the_sampler_asks_for_more():
    # one prompt a draw: only a stream that draws again once a group is back reaches 3 kept
    engine = _Engine()
    stream = _stream(engine)
    sampler = _Sampler(draws=[1, 1, 1], target=3)
    prompts = iter(_prompts(3))
    asyncio.run(
        stream.run(
            sampler,
            draw=lambda count: [next(prompts) for _ in range(count)],
            keep=sampler.kept.append,
        )
    )
    assert [group.payload.text for group in sampler.kept] == ["q0", "q1", "q2"]
    assert len(engine.calls) == 3  # one engine call per draw
    assert sampler.in_flight_seen[0] == 0  # the first draw, before anything was fed
    assert stream.num_in_flight == 0 and stream.cut_groups() == []


def test_each_engine_call_draws_with_its_own_seed():
    engine = _Engine()
    stream = _stream(engine, seed=11)

    async def two_feeds():
        stream.feed(_prompts(1))
        stream.feed(_prompts(1))
        await stream.next_group(timeout_s=5)
        await stream.next_group(timeout_s=5)
        await stream.cut()

    asyncio.run(two_feeds())
    assert [sampling.seed for _, sampling in engine.calls] == [11 + 7_919, 11 + 2 * 7_919]
    assert stream.stats()["num_engine_calls"] == 2.0


def test_the_abort_cuts_the_tail_and_the_cut_group_goes_to_the_carry_with_its_tokens():
    # q1's second sample never finishes: once q0's group is kept the sampler is full
    engine = _Engine(hold={("q1", 1)})
    carry = _Carry()
    stream = _stream(engine, carry=carry, step=5)
    sampler = _Sampler(draws=[2], target=1)
    prompts = _prompts(2)
    asyncio.run(stream.run(sampler, draw=lambda count: prompts[:count], keep=sampler.kept.append))
    assert [group.payload.text for group in sampler.kept] == ["q0"]
    assert carry.taken_at == [5]  # resumed first (nothing held)
    (cut,) = carry.groups
    assert cut.step == 5 and cut.prompt is prompts[1]
    finished, aborted = cut.samples
    assert (finished.response_ids, finished.finish_reason) == ([7, 8], "stop")
    assert (aborted.response_ids, aborted.logprobs, aborted.finish_reason) == ([7], [-0.5], "abort")
    assert stream.num_aborted_tokens == 1
    stats = stream.stats()
    assert stats["num_groups_cut"] == 1.0 and stats["num_aborted_tokens"] == 1.0


def test_a_resumed_sample_keeps_its_old_tokens_and_logprobs():
    prompt = _Prompt(text="1+1", ids=[1, 2])
    cut = genrm.CutGroup(
        samples=[
            rollout.Completion(
                request_index=0,
                sample_index=0,
                prompt_ids=[1, 2],
                response_ids=[5, 6],
                logprobs=[-0.1, -0.2],
                finish_reason="abort",
            ),
            rollout.Completion(
                request_index=0,
                sample_index=1,
                prompt_ids=[1, 2],
                response_ids=[9],
                logprobs=[-0.5],
                finish_reason="stop",
            ),
        ],
        step=3,
        prompt=prompt,
    )
    engine = _Engine(tokens=[7])
    stream = _stream(engine, max_new_tokens=5, step=4)

    async def resume_one_step():
        stream.resume([cut])
        group = await stream.next_group(timeout_s=30)
        await stream.cut()
        return group

    group = asyncio.run(resume_one_step())
    ((request,), sampling) = engine.calls[0]  # only the cut sample is continued
    assert request.prompt_ids == [1, 2, 5, 6]  # the prompt and what it had
    assert request.max_new_tokens == 3 and sampling.n == 1  # 5 - 2 tokens left, one response
    assert request.metadata == {"origin": "1+1", "group": 0, "sample": 0}
    resumed, finished = group.completions
    assert (resumed.prompt_ids, resumed.response_ids) == ([1, 2], [5, 6, 7])
    assert resumed.logprobs == [-0.1, -0.2, -0.5]  # the old engine's, then the new
    assert (finished.response_ids, finished.logprobs) == ([9], [-0.5])  # judged as it was
    assert [s.response for s in group.samples] == ["[5, 6, 7]", "[9]"]
    assert group.payload is prompt
    assert stream.num_resumed == 1 and stream.num_in_flight == 0 and not stream.cut_groups()


def test_a_cut_sample_without_budget_left_is_judged_as_cut_at_length():
    prompt = _Prompt(text="q", ids=[1])
    full = rollout.Completion(
        request_index=0,
        sample_index=0,
        prompt_ids=[1],
        response_ids=[5, 6],
        logprobs=[-0.1, -0.2],
        finish_reason="abort",
    )
    engine = _Engine()
    stream = _stream(engine, n=1, max_new_tokens=2)

    async def resume():
        stream.resume([genrm.CutGroup(samples=[full], step=4, prompt=prompt)])
        group = await stream.next_group(timeout_s=30)
        await stream.cut()
        return group

    group = asyncio.run(resume())
    assert engine.calls == []  # nothing to continue
    assert group.completions[0].finish_reason == "length"


class _RecordingLoad(PendingLoad):
    def __init__(self) -> None:
        super().__init__()
        self.queues: list[tuple[float, float]] = []

    def record(self, now, *, rollout_tokens, genrm_tokens) -> None:
        self.queues.append((rollout_tokens, genrm_tokens))
        super().record(now, rollout_tokens=rollout_tokens, genrm_tokens=genrm_tokens)


def test_the_live_queues_are_recorded_for_the_memory_split():
    load = _RecordingLoad()
    engine = _Engine(hold={("q0", 1)})
    stream = _stream(engine, load=load, max_new_tokens=4)

    async def feed_then_cut():
        stream.feed(_prompts(1))
        await asyncio.sleep(0.05)  # sample 0 finished and judged, sample 1 still running
        await stream.cut()

    asyncio.run(feed_then_cut())
    queues = load.queues
    # fed: two samples, each may hold its 3 prompt tokens + 4 new ones
    assert queues[0] == (14.0, 0.0)
    assert (7.0, 5.0) in queues  # sample 0 back: 3 + 2 tokens for the judge
    assert queues[-1] == (0.0, 0.0)  # after the cut nothing is pending
    assert set(stream.pending_tokens()) == {"rollout_pending_tokens", "genrm_pending_tokens"}


def test_a_scorer_fits_the_public_protocol():
    assert isinstance(_judge(), genrm.Scorer)
    with pytest.raises(AssertionError):
        assert isinstance(object(), genrm.Scorer)


def test_every_scorer_the_library_builds_fits_the_protocol():
    # GenRM, OpenAIJudge, RewardFunction, CombinedRM and GenRMClient share StreamingScorer: the
    # protocol's five methods (batch and stream) are what generate_and_judge and the stream use.
    for scorer_class in (
        genrm.GenRM,
        genrm.OpenAIJudge,
        genrm.RewardFunction,
        genrm.CombinedRM,
        genrm.GenRMClient,
    ):
        missing = [
            name
            for name in ("score", "ascore", "submit", "finish", "results")
            if not callable(getattr(scorer_class, name, None))
        ]
        assert not missing, f"{scorer_class.__name__} lacks {missing}"
