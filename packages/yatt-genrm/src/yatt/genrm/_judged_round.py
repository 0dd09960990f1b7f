"""One round of generate -> judge: requests through a rollout engine, each response judged,
every response paired with its verdict; placed in a memory plan's phases and timed.

    completions, verdicts = generate_and_judge(requests, sampling, to_sample, engine=engine,
                                               scorer=judge, plan=plan, should_overlap=True,
                                               timings=timings)
    judged = judge_prompts(prompts, sampling, to_request=p.request, to_sample=view, ...)
    judged_samples(streamed_group)          # a JudgedStream's group as JudgedSamples

should_overlap (the rollout and the judge resident together): one "rollout+genrm" phase, each
response judged as soon as it finishes (score_as_completed), and the judge's tail (from the
rollout's last response to the last verdict) timed. Otherwise a "rollout" phase, then a
"genrm" one. `plan` is a yatt.placement.Plan or anything with its phase(name), phases,
has_memory_split and update_load(...): genrm does not depend on placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from yatt.genrm._as_completed import score_as_completed
from yatt.genrm._types import Sample, Scorer, Verdict
from yatt.rollout import Completion, Request, SamplingParams


@dataclass(frozen=True)
class JudgedSample:
    """One response, what the judge read of it, its verdict, and the caller's prompt object
    (a yatt.core.Prompt in the reference trainer: its row, ids and images)."""

    completion: Completion
    sample: Sample  # what the judge read: prompt text, the response decoded once, reference
    verdict: Verdict
    prompt: Any


@contextlib.contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def generate_and_judge(
    requests: list[Request],
    sampling: SamplingParams,
    to_sample: Callable[[Completion], Sample],
    *,
    engine: Any,
    scorer: Scorer,
    plan: Any,
    should_overlap: bool,
    timings: dict[str, float],
    should_stop: Callable[[], bool] | None = None,
) -> tuple[list[Completion], list[Verdict]]:
    """One rollout of `requests` and each response's verdict: (completions, verdicts), paired
    by position. should_overlap (rollout and judge resident together): one "rollout+genrm"
    phase, each response judged as soon as it finishes; timings["genrm_tail"] adds the
    seconds from the rollout's last response to the last verdict, and a plan with a memory
    split moves it toward this round's token loads. Otherwise the "rollout" phase, then the
    "genrm" one (outside any phase for a plan without one: its judge lives elsewhere). Each
    phase is timed into `timings` (responses and verdicts are host lists: the times include
    the device's work). should_stop (a stop signal's flag; None: not read) is polled while
    the judge works: once true the pending judge requests are aborted and ScoringStopped is
    raised (a round stopped mid-judge has no verdicts to keep)."""
    if should_overlap:
        rollout_end: list[float] = []

        async def noting_its_end(stream):  # the rollout's last response: the tail starts
            async for completion in stream:
                yield completion
            rollout_end.append(time.perf_counter())

        with _timed(timings, "rollout+genrm"), plan.phase("rollout"):
            stream = noting_its_end(engine.stream(requests, sampling))
            scored = asyncio.run(
                score_as_completed(stream, scorer, to_sample, should_stop=should_stop)
            )
            last_verdict = time.perf_counter()
        tail_s = last_verdict - rollout_end[-1] if rollout_end else 0.0
        timings["genrm_tail"] = timings.get("genrm_tail", 0.0) + tail_s
        completions, verdicts = scored
        if plan.has_memory_split:  # the next split follows this round's measured token loads
            rollout_tokens = sum(
                len(completion.prompt_ids) + len(completion.response_ids)
                for completion in completions
            )
            judge_tokens = scored.stats.num_judge_prompt_tokens
            plan.update_load(
                rollout_pending_tokens=rollout_tokens, genrm_pending_tokens=judge_tokens
            )
        return completions, verdicts
    with _timed(timings, "rollout"), plan.phase("rollout"):
        completions = engine.generate(requests, sampling)
    judge_phase = plan.phase("genrm") if "genrm" in plan.phases else contextlib.nullcontext()
    with _timed(timings, "genrm"), judge_phase:
        samples = [to_sample(completion) for completion in completions]
        verdicts = scorer.score(samples, should_stop=should_stop)
    return completions, verdicts


def judge_prompts(
    prompts: Sequence[Any],
    sampling: SamplingParams,
    *,
    to_request: Callable[[Any], Request],
    to_sample: Callable[[Any, Completion], Sample],
    engine: Any,
    scorer: Scorer,
    plan: Any,
    should_overlap: bool,
    timings: dict[str, float],
    should_stop: Callable[[], bool] | None = None,
) -> list[JudgedSample]:
    """sampling.n responses per prompt, each judged (generate_and_judge): to_request(prompt)
    is its request, to_sample(prompt, completion) what the judge reads of a response, called
    once per response. Each JudgedSample carries its prompt object back. should_stop: as
    generate_and_judge's (ScoringStopped once it turns true while the judge works)."""
    samples: dict[tuple[int, int], Sample] = {}

    def sample_of(completion: Completion) -> Sample:
        sample = to_sample(prompts[completion.request_index], completion)
        samples[completion.request_index, completion.sample_index] = sample
        return sample

    completions, verdicts = generate_and_judge(
        [to_request(prompt) for prompt in prompts],
        sampling,
        sample_of,
        engine=engine,
        scorer=scorer,
        plan=plan,
        should_overlap=should_overlap,
        timings=timings,
        should_stop=should_stop,
    )
    return [
        JudgedSample(
            completion,
            samples[completion.request_index, completion.sample_index],
            verdict,
            prompts[completion.request_index],
        )
        for completion, verdict in zip(completions, verdicts, strict=True)
    ]


def judged_samples(group: Any) -> list[JudgedSample]:
    """A JudgedStream's StreamedGroup as JudgedSamples: each response with what the judge
    read, its verdict and the group's payload (its prompt)."""
    return [
        JudgedSample(completion, sample, verdict, group.payload)
        for completion, sample, verdict in zip(
            group.completions, group.samples, group.verdicts, strict=True
        )
    ]
