"""One step's rollout as a stream of judged groups: generate, judge each response as it ends.

    stream = JudgedStream(engine=engine, scorer=scorer, sampling=sampling, step=step,
                          to_request=lambda prompt: prompt.request(),      # payload -> Request
                          to_sample=lambda prompt, completion: Sample(...), # what the judge reads
                          judge_engine=judge_engine, carry=partials,
                          load=placement.PendingLoad())                     # the live queues
    await stream.run(sampler, draw=draw, keep=keep)   # feed, judge, hand back, cut the tail
    # or by hand:
    stream.resume(groups)                  # last step's cut groups, finished first
    stream.feed(payloads)                  # generate: n responses per payload enter the engine
    group = await stream.next_group()      # a StreamedGroup whose every response is judged
    await stream.cut()                     # abort the rollout and the judge's leftover work
    stream.cut_groups()                    # what the abort cut, as CutGroup (to resume later)
    stream.pending_tokens()                # Plan.update_load's arguments (the memory split)

A payload is the caller's own (a prompt with its row and images): the stream never looks inside
it; `to_request(payload)` gives its engine request and `to_sample(payload, completion)` what the
judge reads of a response. Each response goes to the judge the moment the engine yields it
(GroupJudging), so the judge works while the rollout's long tail still runs, and payloads keep
entering the engine as the caller asks. The live queues (tokens the rollout's unfinished requests
may still hold, and the judge's pending prompts) are recorded at each change into `load`
(yatt.placement.PendingLoad, passed in: genrm does not depend on placement): their time-weighted
means move the next step's memory split.

A resumed response keeps its old tokens and their logprobs (the engine's, by last step's
weights); its continuation is sampled from the prompt plus those tokens, within the budget left
under the step's max_new_tokens. `carry` (e.g. yatt.core.PartialRollouts) holds cut groups from
one step to the next: run() resumes its take(step) first and put()s what the abort cut.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from yatt.genrm._groups import GroupJudging
from yatt.genrm._types import Sample, Scorer, Verdict
from yatt.rollout import Abortable, Completion, Request, SamplingParams

ABORT = "abort"  # yatt.rollout's finish_reason for a response cut by engine.abort()
SEED_STRIDE = 7_919  # each engine call's seed: sampling.seed + call number * SEED_STRIDE


class _Sampler(Protocol):  # e.g. yatt.core.DynamicSampler in stream mode
    def num_to_draw(self, *, in_flight: int) -> int: ...

    def should_abort(self) -> bool: ...


class _Stream(Protocol):  # JudgedStream, TrajectoryStream
    num_in_flight: int

    def feed(self, payloads: Sequence[Any]) -> None: ...

    async def next_group(self) -> Any: ...

    async def cut(self) -> None: ...


async def keep_fed_until_full(
    stream: _Stream,
    sampler: _Sampler,
    draw: Callable[[int], Sequence[Any]],
    keep: Callable[[Any], None],
    should_stop: Callable[[], bool],
) -> None:
    """A stream's step: payloads from draw(count) as the sampler asks (num_to_draw counts the
    groups in flight), each judged group to keep() at once; once should_abort() (every rank
    full: polls, never blocks) or should_stop(), or nothing is in flight or to draw, the long
    tail is cut."""
    if first := sampler.num_to_draw(in_flight=stream.num_in_flight):
        stream.feed(draw(first))
    while True:
        group = await stream.next_group()
        if group is not None:
            keep(group)
        if sampler.should_abort() or should_stop():
            break
        if more := sampler.num_to_draw(in_flight=stream.num_in_flight):
            stream.feed(draw(more))  # keep the engine fed
        if not stream.num_in_flight:  # nothing in flight, nothing to draw: the sampler decides
            break
    await stream.cut()


class _Load(Protocol):  # e.g. yatt.placement.PendingLoad
    def record(self, now: float, *, rollout_tokens: float, genrm_tokens: float) -> None: ...

    def pending_tokens(self, end: float) -> dict[str, float]: ...


class _Carry(Protocol):  # e.g. yatt.core.PartialRollouts
    def take(self, step: int) -> Sequence[Any]: ...

    def put(self, group: Any) -> None: ...


@dataclass
class StreamedGroup:
    """A group whose every response is judged, by sample index: its payload, each response,
    what the judge read of it and its verdict."""

    key: int
    payload: Any
    completions: list[Completion]
    samples: list[Sample]
    verdicts: list[Verdict]


@dataclass
class CutGroup:
    """A group the abort cut: every sample (finished ones, and what the cut ones had written,
    finish_reason "abort"), the step whose weights sampled its oldest tokens, and its payload.
    Shaped as yatt.core.PartialGroup (samples, step, prompt), which resume() also takes."""

    samples: list[Completion]
    step: int
    prompt: Any


@dataclass
class _Group:
    key: int
    payload: Any
    first_step: int  # the step whose weights sampled its oldest tokens
    parts: dict[int, Any] = field(default_factory=dict)  # cut last step: to continue
    completions: dict[int, Completion] = field(default_factory=dict)  # finished, resumed


class JudgedStream:
    """One step's stream of judged groups (module docstring). Use inside one running event loop.

    sampling: the step's sampling (n = the group size); each engine call gets its own seed.
    judge_engine: the judge's engine when it has one (aborted at cut() if it can abort).
    """

    def __init__(
        self,
        *,
        engine: Any,
        scorer: Scorer,
        sampling: SamplingParams,
        to_request: Callable[[Any], Request],
        to_sample: Callable[[Any, Completion], Sample],
        step: int,
        judge_engine: Any = None,
        carry: _Carry | None = None,
        load: _Load | None = None,
    ) -> None:
        self.engine, self.judge_engine = engine, judge_engine
        self.sampling = sampling
        self.step = step
        self.carry = carry
        self.group_size = sampling.n
        self.judging = GroupJudging(
            scorer, self._to_sample, group_size=sampling.n, on_verdict=self._on_verdict
        )
        self._to_request = to_request
        self._make_sample = to_sample
        self.groups: dict[int, _Group] = {}
        self.num_in_flight = 0  # groups fed and not yet handed back judged
        self.num_calls = 0  # engine.stream calls (each its own seed)
        self.num_resumed = 0  # cut groups resumed
        self.num_aborted_tokens = 0  # response tokens of responses the abort cut
        self.load = load
        self._samples: dict[int, Sample] = {}  # id(completion) -> what the judge read
        self._cut: list[CutGroup] | None = None
        self._rollout_pending = 0
        self._genrm_pending = 0
        self._request_tokens: dict[tuple[int, int], int] = {}
        self._judge_tokens: dict[int, int] = {}  # id(completion) -> its pending judge tokens
        self._pumps: set[asyncio.Task] = set()

    # -- the whole step ----------------------------------------------------------------------

    async def run(
        self,
        sampler: _Sampler,
        *,
        draw: Callable[[int], Sequence[Any]],
        keep: Callable[[StreamedGroup], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """The carry's groups first, then payloads from draw(count) as the sampler asks
        (num_to_draw counts the groups in flight); each judged group to keep() at once; once
        should_abort() (every rank full: polls, never blocks) or should_stop() (a stop signal),
        or nothing is in flight or to draw, the long tail is cut and the cut groups go to the
        carry."""
        if self.carry is not None:
            self.resume(self.carry.take(self.step))
        await keep_fed_until_full(self, sampler, draw, keep, should_stop)
        if self.carry is not None:
            for cut in self.cut_groups():
                self.carry.put(cut)

    # -- generate ----------------------------------------------------------------------------

    def feed(self, payloads: Sequence[Any]) -> None:
        """n responses per payload into the engine (a new group each)."""
        groups = [self._new_group(payload, first_step=self.step) for payload in payloads]
        requests = [self._request(g, metadata={"group": g.key}) for g in groups]
        for request in requests:
            self._owe(
                request, num_samples=self.group_size, max_new_tokens=self.sampling.max_new_tokens
            )
        self._start(requests, self.sampling)

    def resume(self, groups: Sequence[Any]) -> None:
        """Cut groups (CutGroup or core.PartialGroup: samples, step, prompt): finished samples
        straight to the judge, cut ones continued where they stopped (one response each,
        within the budget left)."""
        requests = []
        self.num_resumed += len(groups)
        budget = self.sampling.max_new_tokens
        for cut in groups:
            g = self._new_group(cut.prompt, first_step=cut.step)
            for j, sample in enumerate(cut.samples):
                left = max(budget - len(sample.response_ids), 0)
                if sample.finish_reason != ABORT or not left:  # no budget: cut at length
                    reason = sample.finish_reason if sample.finish_reason != ABORT else "length"
                    g.completions[j] = _completion(g.key, j, sample, reason)
                    continue
                g.parts[j] = sample
                request = self._request(
                    g,
                    prompt_ids=[*sample.prompt_ids, *sample.response_ids],
                    metadata={"group": g.key, "sample": j},
                    max_new_tokens=left,
                )
                self._owe(request, num_samples=1, max_new_tokens=left)
                requests.append(request)
            for j, completion in g.completions.items():
                self._judge(completion, g.key, j)
        if requests:
            self._start(requests, replace(self.sampling, n=1))

    def _request(self, group: _Group, *, metadata: dict, **changes: Any) -> Request:
        request = self._to_request(group.payload)
        return replace(request, metadata={**request.metadata, **metadata}, **changes)

    def _new_group(self, payload: Any, *, first_step: int) -> _Group:
        key = len(self.groups)
        self.groups[key] = _Group(key=key, payload=payload, first_step=first_step)
        self.num_in_flight += 1
        return self.groups[key]

    def _owe(self, request: Request, *, num_samples: int, max_new_tokens: int) -> None:
        # The KV a request may hold until it finishes: its prompt and the tokens it may write.
        key = request.metadata["group"]
        for j in range(num_samples):
            index = request.metadata.get("sample", j)
            tokens = len(request.prompt_ids) + max_new_tokens
            self._request_tokens[key, index] = tokens
            self._rollout_pending += tokens
        self._note()

    def _start(self, requests: list[Request], sampling: SamplingParams) -> None:
        self.num_calls += 1
        # Seeded per call: two calls never draw alike; the same run draws the same.
        seed = (sampling.seed + self.num_calls * SEED_STRIDE) % 2**31
        stream = self.engine.stream(requests, replace(sampling, seed=seed))
        task = asyncio.get_running_loop().create_task(self._pump(stream))
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)

    async def _pump(self, stream) -> None:
        async for c in stream:
            key = c.metadata["group"]
            j = c.metadata.get("sample", c.sample_index)
            self._rollout_pending -= self._request_tokens.pop((key, j), 0)
            self._note()
            if c.finish_reason == ABORT:
                self.num_aborted_tokens += len(c.response_ids)
            part = self.groups[key].parts.get(j)
            if part is not None:  # a continuation: last step's tokens and logprobs, then these
                c = _completion(key, j, _joined(part, c), c.finish_reason)
            self._judge(c, key, j)

    # -- judge -------------------------------------------------------------------------------

    def _judge(self, completion: Completion, key: int, j: int) -> None:
        if completion.finish_reason != ABORT:
            # The judge reads the question and the response (its template's tokens aside).
            tokens = len(completion.prompt_ids) + len(completion.response_ids)
            self._judge_tokens[id(completion)] = tokens
            self._genrm_pending += tokens
            self._note()
        self.judging.add(completion, group=key, index=j)

    def _to_sample(self, completion: Completion) -> Sample:
        payload = self.groups[completion.metadata["group"]].payload
        sample = self._make_sample(payload, completion)
        self._samples[id(completion)] = sample
        return sample

    def _on_verdict(self, key: Any, completion: Any, verdict: Verdict) -> None:
        self._genrm_pending -= self._judge_tokens.pop(id(completion), 0)
        self._note()

    async def next_group(self, timeout_s: float = 0.01) -> StreamedGroup | None:
        """A group whose every response is judged, else None after `timeout_s`."""
        group = await self.judging.next_group(timeout_s=timeout_s)
        if group is None:
            return None
        self.num_in_flight -= 1
        return StreamedGroup(
            key=group.group,
            payload=self.groups[group.group].payload,
            completions=group.completions,
            samples=[self._samples.pop(id(c)) for c in group.completions],
            verdicts=group.verdicts,
        )

    # -- the end of the step -----------------------------------------------------------------

    async def cut(self) -> None:
        """Abort the rollout's in-flight requests (their partial responses come back as
        "abort"), then the judge's work nobody needs any more."""
        if self._pumps:
            self.engine.abort()
            await asyncio.gather(*self._pumps)
        self._rollout_pending = 0
        self._note()
        judge = self.judge_engine
        await self.judging.drain(abort=judge.abort if isinstance(judge, Abortable) else None)
        self._genrm_pending = 0
        self._note()

    def cut_groups(self) -> list[CutGroup]:
        """The groups the abort cut (a response of theirs unfinished), all samples each: the
        finished ones and what the cut ones had generated. The same list on each call."""
        if self._cut is not None:
            return self._cut
        out = []
        for key, (judged, aborted) in self.judging.unfinished().items():
            g = self.groups[key]
            by_index = {j: c for j, (c, _) in judged.items()} | dict(aborted)
            if len(by_index) < self.group_size:  # a sample never came back: nothing to resume
                continue
            samples = [by_index[j] for j in sorted(by_index)]
            out.append(CutGroup(samples=samples, step=g.first_step, prompt=g.payload))
        self._cut = out
        return out

    def pending_tokens(self) -> dict[str, float]:
        """The step's time-weighted mean live queues: Plan.update_load's arguments ({}
        without a `load`)."""
        return {} if self.load is None else self.load.pending_tokens(time.perf_counter())

    def stats(self) -> dict[str, float]:
        """The step's stream counters (after cut()): engine calls, groups resumed and cut,
        the aborted responses' tokens, and the mean live queues."""
        return {
            "num_engine_calls": float(self.num_calls),
            "num_groups_resumed": float(self.num_resumed),
            "num_groups_cut": float(len(self.cut_groups())),
            "num_aborted_tokens": float(self.num_aborted_tokens),
            **{key: float(value) for key, value in self.pending_tokens().items()},
        }

    def _note(self) -> None:
        if self.load is None:
            return
        self.load.record(
            time.perf_counter(),
            rollout_tokens=max(self._rollout_pending, 0),
            genrm_tokens=max(self._genrm_pending, 0),
        )


def _joined(part: Any, continuation: Completion) -> Completion:
    """A cut response with its continuation appended (the old tokens keep the old logprobs)."""
    resume_ids = [*part.prompt_ids, *part.response_ids]
    if list(continuation.prompt_ids) != resume_ids:
        raise ValueError(
            "a continuation's prompt_ids are not its cut sample's prompt and response: "
            "the engine must echo each request's metadata"
        )
    return Completion(
        request_index=continuation.request_index,
        sample_index=continuation.sample_index,
        prompt_ids=list(part.prompt_ids),
        response_ids=[*part.response_ids, *continuation.response_ids],
        logprobs=[*part.logprobs, *continuation.logprobs],
        finish_reason=continuation.finish_reason,
    )


def _completion(key: int, j: int, sample: Any, reason: str) -> Completion:
    return Completion(
        request_index=key,
        sample_index=j,
        prompt_ids=list(sample.prompt_ids),
        response_ids=list(sample.response_ids),
        logprobs=list(sample.logprobs),
        finish_reason=reason,
        metadata={"group": key},
    )
