"""Fakes for tests and benchmarks: a judge engine implementing `yatt.rollout.RolloutEngine`, and
a scorer (`RecordingScorer`) for code that takes a `genrm.Scorer`.

FakeJudgeEngine "generates" whatever `judge(prompt_text, vote_index)` returns, after a
configurable latency, so tests control verdict text exactly and benchmarks model a judge's
per-batch cost without a GPU. RecordingScorer skips the judge engine: each sample's reward is a
function of the sample, and it records what it was asked to judge.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from yatt.genrm._stopping import ScoringStopped
from yatt.genrm._types import Sample, Verdict
from yatt.rollout import DEFAULT_BUCKET_BYTES, Completion, Request, SamplingParams

__all__ = ["ByteTokenizer", "EngineCall", "FakeJudgeEngine", "RecordingScorer", "always_yes"]


class ByteTokenizer:
    """UTF-8 bytes as token ids; no chat template (so templates render as plain text)."""

    eos_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@dataclass
class EngineCall:
    """One generate/stream call as the fake saw it."""

    num_requests: int
    sampling: SamplingParams
    start_s: float
    end_s: float = float("nan")


def always_yes(prompt_text: str, vote_index: int) -> str:
    return "Yes"


@dataclass(kw_only=True)
class FakeJudgeEngine:
    """A RolloutEngine whose completions are `judge(decoded prompt, vote index)`.

    Latency of one call: `batch_latency_s + per_request_latency_s * len(requests)` before the
    first completion (a batch's prefill and decode), completions then stream out. `fail_after`
    makes stream/generate raise RuntimeError after that many completions of a call.
    """

    judge: Callable[[str, int], str] = always_yes
    tokenizer: Any = field(default_factory=ByteTokenizer)
    batch_latency_s: float = 0.0
    per_request_latency_s: float = 0.0
    fail_after: int | None = None
    calls: list[EngineCall] = field(default_factory=list)
    num_active_streams: int = 0
    peak_active_streams: int = 0
    is_closed: bool = False

    def _completions(
        self, requests: Sequence[Request], sampling: SamplingParams
    ) -> list[Completion]:
        out = []
        for i, request in enumerate(requests):
            prompt_text = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
            for k in range(sampling.n):
                text = self.judge(prompt_text, k)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                out.append(
                    Completion(
                        request_index=i,
                        sample_index=k,
                        prompt_ids=list(request.prompt_ids),
                        response_ids=ids,
                        logprobs=[0.0] * len(ids),
                        finish_reason="stop",
                        request_id=request.request_id,
                        metadata=dict(request.metadata),
                    )
                )
        return out

    def _latency_s(self, num_requests: int) -> float:
        return self.batch_latency_s + self.per_request_latency_s * num_requests

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Completion]:
        call = EngineCall(len(requests), sampling, time.perf_counter())
        self.calls.append(call)
        time.sleep(self._latency_s(len(requests)))
        out = self._completions(requests, sampling)
        if self.fail_after is not None and len(out) > self.fail_after:
            raise RuntimeError("fake judge engine failure")
        call.end_s = time.perf_counter()
        return out

    async def stream(
        self, requests: Sequence[Request], sampling: SamplingParams
    ) -> AsyncIterator[Completion]:
        call = EngineCall(len(requests), sampling, time.perf_counter())
        self.calls.append(call)
        self.num_active_streams += 1
        self.peak_active_streams = max(self.peak_active_streams, self.num_active_streams)
        try:
            await asyncio.sleep(self._latency_s(len(requests)))
            # Later requests of a batch finish later: yield in reverse to exercise any-order.
            for n, completion in enumerate(reversed(self._completions(requests, sampling))):
                if self.fail_after is not None and n >= self.fail_after:
                    raise RuntimeError("fake judge engine failure")
                yield completion
                await asyncio.sleep(0)
        finally:
            self.num_active_streams -= 1
            call.end_s = time.perf_counter()

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        for _ in named_tensors:
            pass

    def sleep(self) -> None:
        pass

    def wake_up(self, tags: Sequence[str] | None = ("weights", "kv_cache")) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self) -> None:
        self.is_closed = True


class RecordingScorer:
    """A `genrm.Scorer` for tests: sample -> Verdict(reward=reward(sample), status "ok"), with
    num_judge_prompt_tokens = len(sample.prompt) and, given `component`, that one component
    (the reward under that name). Every sample judged is appended to `samples`, and
    `on_verdict(sample)` runs as each verdict is made (a test notes the plan's phase there).

    score(should_stop=) raises ScoringStopped when the flag is already true, as a real scorer
    does once it sees it. It also streams (submit / finish / results, as
    genrm.score_as_completed drives a streaming scorer): the verdicts come `tail_s` seconds
    after finish(), the judge's tail."""

    def __init__(
        self,
        reward: Callable[[Sample], float] = lambda sample: 1.0,
        *,
        component: str | None = None,
        tail_s: float = 0.0,
        on_verdict: Callable[[Sample], None] | None = None,
    ) -> None:
        self.reward = reward
        self.component = component
        self.tail_s = tail_s
        self.on_verdict = on_verdict
        self.samples: list[Sample] = []
        self._submitted: list[Sample] = []
        self._is_finished = False

    def _verdict(self, sample: Sample) -> Verdict:
        self.samples.append(sample)
        if self.on_verdict is not None:
            self.on_verdict(sample)
        reward = float(self.reward(sample))
        return Verdict(
            sample_id=sample.id,
            reward=reward,
            status="ok",
            components={self.component: reward} if self.component else {},
            num_judge_prompt_tokens=len(sample.prompt),
        )

    def score(
        self, samples: list[Sample], *, should_stop: Callable[[], bool] | None = None
    ) -> list[Verdict]:
        if should_stop is not None and should_stop():
            raise ScoringStopped(num_samples=len(samples), waited_s=0.0)
        return [self._verdict(sample) for sample in samples]

    async def ascore(self, samples: list[Sample]) -> list[Verdict]:
        return [self._verdict(sample) for sample in samples]

    async def submit(self, sample: Sample) -> None:
        self._submitted.append(sample)

    async def finish(self) -> None:
        self._is_finished = True

    async def results(self) -> AsyncIterator[Verdict]:
        while not self._is_finished:
            await asyncio.sleep(0.001)
        await asyncio.sleep(self.tail_s)
        for sample in self._submitted:
            yield self._verdict(sample)
