"""rollout.sampling_mode=stream (placement=partial): one step's rollout as a stream of groups.

    stream = RolloutStream(engine=..., judge_engine=..., scorer=..., ...)
    stream.resume(partials.take(step))     # keep_partial: last step's cut groups, finished first
    stream.feed(prompts)                   # generate: n responses per prompt enter the engine
    group = await stream.next_group()      # score: a group whose every response is judged
    ...                                    # keep: the loop's sampler.add(...)
    await stream.cut()                     # every rank is full: abort the rollout and judge
    stream.cut_groups(step)                # what the abort cut, as core.PartialGroup

Each response goes to the judge the moment the engine yields it (genrm.GroupJudging), so the
judge works while the rollout's long tail still runs, and prompts keep entering the engine as
the loop asks. The live queues (tokens the rollout's unfinished requests may still hold, and
the judge's pending prompts) are recorded at each change (placement.PendingLoad): their
time-weighted means move the next step's memory split between the two engines.

A resumed response keeps its old tokens and their logprobs (the engine's, by last step's
weights); its continuation is sampled from the prompt plus those tokens, within the budget
left under rollout.max_new_tokens. Training on it is off-policy by one step, which the loss's
rollout correction weighs (the config refuses keep_partial without it).

A checkpoint keeps the held cut groups (core.PartialRollouts.state_dict), each prompt as its
data row and ids (saved_prompt; loaded_prompt rebuilds it through the run's encoder), so a run
resumed after a crash resumes the groups the uninterrupted run would have. A row with opened
images is not JSON: it is kept by its dataset index (core.ROW_INDEX_KEY) and read again on
resume (ShardedLoader.read_rows), its images opened anew. A group whose prompt cannot be
rebuilt (its row unusable now, other ids) is dropped, counted and logged.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from grpo_prompts import Prompt

from yatt import core, genrm, rollout
from yatt.placement import PendingLoad


@dataclass
class StreamGroup:
    """A group in flight: its prompt, and (resumed) last step's samples by index."""

    key: int
    prompt: Prompt
    first_step: int  # the step whose weights sampled its oldest tokens
    parts: dict[int, core.PartialSample] = field(default_factory=dict)  # cut: to continue
    completions: dict[int, rollout.Completion] = field(default_factory=dict)  # finished


class RolloutStream:
    """One step's stream of groups (module docstring). Use inside one running event loop.

    to_sample(prompt, completion) -> genrm.Sample: what the judge reads of a response.
    sampling: the step's sampling (n = the group size); each feed() gets its own seed.
    """

    def __init__(
        self,
        *,
        engine: Any,
        judge_engine: Any,
        scorer: Any,
        to_sample: Callable[[Prompt, rollout.Completion], genrm.Sample],
        sampling: rollout.SamplingParams,
        step: int,
    ) -> None:
        self.engine, self.judge_engine = engine, judge_engine
        self.sampling = sampling
        self.step = step
        self.group_size = sampling.n
        self.judging = genrm.GroupJudging(
            scorer, self._to_sample, group_size=sampling.n, on_verdict=self._on_verdict
        )
        self._make_sample = to_sample
        self.groups: dict[int, StreamGroup] = {}
        self.samples: dict[int, genrm.Sample] = {}  # id(completion) -> what the judge read
        self.num_in_flight = 0  # groups fed and not yet handed back judged
        self.num_calls = 0  # engine.stream calls (each its own seed)
        self.num_resumed = 0  # last step's cut groups resumed
        self.num_aborted_tokens = 0  # response tokens of responses the abort cut
        self.load = PendingLoad()
        self._rollout_pending = 0
        self._genrm_pending = 0
        self._request_tokens: dict[tuple[int, int], int] = {}
        self._judge_tokens: dict[int, int] = {}  # id(completion) -> its pending judge tokens
        self._pumps: set[asyncio.Task] = set()

    # -- generate ------------------------------------------------------------------------------

    def feed(self, prompts: list[Prompt]) -> None:
        """n responses per prompt into the engine (a new group each)."""
        groups = [self._new_group(prompt, first_step=self.step) for prompt in prompts]
        requests = [g.prompt.request(metadata={"group": g.key}) for g in groups]
        for request in requests:
            self._owe(
                request, num_samples=self.group_size, max_new_tokens=self.sampling.max_new_tokens
            )
        self._start(requests, self.sampling)

    def resume(self, partials: list[core.PartialGroup]) -> None:
        """Last step's cut groups: finished samples straight to the judge, cut ones continued
        where they stopped (one response each, within the budget left)."""
        requests = []
        self.num_resumed += len(partials)
        for partial in partials:
            g = self._new_group(partial.prompt, first_step=partial.step)
            for j, sample in enumerate(partial.samples):
                left = sample.num_tokens_left(self.sampling.max_new_tokens)
                if sample.is_finished or not left:  # no budget left: a response cut at length
                    reason = sample.finish_reason if sample.is_finished else "length"
                    g.completions[j] = self._completion(g.key, j, sample, reason)
                    continue
                g.parts[j] = sample
                request = g.prompt.request(
                    prompt_ids=sample.resume_prompt_ids(),
                    metadata={"group": g.key, "sample": j},
                    max_new_tokens=left,
                )
                self._owe(request, num_samples=1, max_new_tokens=left)
                requests.append(request)
            for j, completion in g.completions.items():
                self._judge(completion, g.key, j)
        if requests:
            self._start(requests, replace(self.sampling, n=1))

    def _new_group(self, prompt: Prompt, *, first_step: int) -> StreamGroup:
        key = len(self.groups)
        self.groups[key] = StreamGroup(key=key, prompt=prompt, first_step=first_step)
        self.num_in_flight += 1
        return self.groups[key]

    def _owe(self, request: rollout.Request, *, num_samples: int, max_new_tokens: int) -> None:
        # The KV a request may hold until it finishes: its prompt and the tokens it may write.
        key = request.metadata["group"]
        for j in range(num_samples):
            index = request.metadata.get("sample", j)
            tokens = len(request.prompt_ids) + max_new_tokens
            self._request_tokens[key, index] = tokens
            self._rollout_pending += tokens
        self._note()

    def _start(self, requests: list[rollout.Request], sampling: rollout.SamplingParams) -> None:
        self.num_calls += 1
        # Seeded per call: two calls never draw alike; the same run draws the same.
        seed = (sampling.seed + self.num_calls * 7_919) % 2**31
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
            g = self.groups[key]
            if j in g.parts:  # a continuation: last step's tokens and logprobs, then these
                if c.finish_reason == "abort":
                    self.num_aborted_tokens += len(c.response_ids)
                c = self._completion(key, j, g.parts[j].resumed(c), c.finish_reason)
            elif c.finish_reason == "abort":
                self.num_aborted_tokens += len(c.response_ids)
            self._judge(c, key, j)

    def _completion(
        self, key: int, j: int, sample: core.PartialSample, reason: str
    ) -> rollout.Completion:
        return rollout.Completion(
            request_index=key,
            sample_index=j,
            prompt_ids=list(sample.prompt_ids),
            response_ids=list(sample.response_ids),
            logprobs=list(sample.logprobs),
            finish_reason=reason,
            metadata={"group": key},
        )

    # -- score ---------------------------------------------------------------------------------

    def _judge(self, completion: rollout.Completion, key: int, j: int) -> None:
        if completion.finish_reason != "abort":
            # The judge reads the question and the response (its template's tokens aside).
            tokens = len(completion.prompt_ids) + len(completion.response_ids)
            self._judge_tokens[id(completion)] = tokens
            self._genrm_pending += tokens
            self._note()
        self.judging.add(completion, group=key, index=j)

    def _to_sample(self, completion: rollout.Completion) -> genrm.Sample:
        sample = self._make_sample(self.groups[completion.metadata["group"]].prompt, completion)
        self.samples[id(completion)] = sample
        return sample

    def _on_verdict(self, key: Any, completion: Any, verdict: genrm.Verdict) -> None:
        self._genrm_pending -= self._judge_tokens.pop(id(completion), 0)
        self._note()

    async def next_group(self, timeout_s: float = 0.01) -> genrm.JudgedGroup | None:
        """A group whose every response is judged, else None after `timeout_s`."""
        group = await self.judging.next_group(timeout_s=timeout_s)
        if group is not None:
            self.num_in_flight -= 1
        return group

    # -- the end of the step -------------------------------------------------------------------

    async def cut(self) -> None:
        """Abort the rollout's in-flight requests (their partial responses come back as
        "abort"), then the judge's work nobody needs any more."""
        if self._pumps:
            self.engine.abort()
            await asyncio.gather(*self._pumps)
        self._rollout_pending = 0
        self._note()
        judge = self.judge_engine
        await self.judging.drain(
            abort=judge.abort if isinstance(judge, rollout.Abortable) else None
        )
        self._genrm_pending = 0
        self._note()

    def cut_groups(self) -> list[core.PartialGroup]:
        """The groups the abort cut (a response of theirs unfinished), all samples each: the
        finished ones and what the cut ones had generated."""
        out = []
        for key, (judged, aborted) in self.judging.unfinished().items():
            g = self.groups[key]
            by_index = {j: c for j, (c, _) in judged.items()} | dict(aborted)
            if len(by_index) < self.group_size:  # a sample never came back: nothing to resume
                continue
            samples = [core.PartialSample.from_completion(by_index[j]) for j in sorted(by_index)]
            out.append(core.PartialGroup(samples=samples, step=g.first_step, prompt=g.prompt))
        return out

    def pending_tokens(self) -> dict[str, float]:
        """The step's time-weighted mean live queues: Plan.update_load's arguments."""
        return self.load.pending_tokens(time.perf_counter())

    def _note(self) -> None:
        self.load.record(
            time.perf_counter(),
            rollout_tokens=max(self._rollout_pending, 0),
            genrm_tokens=max(self._genrm_pending, 0),
        )


# -- checkpoints: a held cut group's prompt ------------------------------------------------------


def saved_prompt(prompt: Prompt) -> dict | None:
    """A cut group's prompt as a checkpoint keeps it (PartialRollouts.state_dict(save_prompt=)):
    its ids and its data row, JSON-able; a row JSON cannot hold as it is (its opened images)
    by its dataset index instead (`row_index`, read again on resume). None for such a row
    without an index (not the loader's): that group is not resumed (loaded_prompt drops it)."""
    ids = [int(t) for t in prompt.ids]
    try:
        row = json.loads(json.dumps(prompt.row, allow_nan=False))
    except (TypeError, ValueError):
        row = None
    if row is not None and row == prompt.row:
        return {"row": row, "ids": ids}
    index = prompt.row.get(core.ROW_INDEX_KEY)
    if isinstance(index, int) and not isinstance(index, bool):
        return {"row_index": index, "ids": ids}
    return None


def loaded_prompt(
    saved: dict | None,
    encoder: Any,
    *,
    read_rows: Callable[[list[int]], list[dict | None]] | None = None,
) -> Prompt | None:
    """The Prompt `saved_prompt` stored, rebuilt by the run's encoder (encoder.encode(rows,
    should_count=False)); a row kept by its index is read again by `read_rows` (the run's
    ShardedLoader.read_rows). None (the group dropped) when the row is unusable now, no
    read_rows is given for it, or it no longer gives a prompt or gives other ids (another
    tokenizer or chat template, other images): its responses continue those ids."""
    if saved is None:
        return None
    if "row_index" in saved:
        if read_rows is None:
            return None
        (row,) = read_rows([saved["row_index"]])
        if row is None:
            return None
    else:
        row = saved["row"]
    prompts = encoder.encode([row], should_count=False)
    if len(prompts) != 1 or list(prompts[0].ids) != list(saved["ids"]):
        return None
    return prompts[0]
