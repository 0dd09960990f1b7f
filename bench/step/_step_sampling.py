"""bench/step/step.py's seed mix: DAPO dynamic sampling driven by yatt.core.DynamicSampler.

Every draw takes the next groups of this rank's endless sequence (_step_setup.seed_group: a
prompt, long-tail forced lengths, hidden labels with a controlled share of groups without
reward variance), so every layout and sampler sees the same groups in the same order. The
judge (random weights) judges every sample for real, writing its forced --judge-tokens; the
reward is the sample's hidden label, so what is kept does not depend on the judge's text.

    --sampler new (default)
      full     rounds: rollout phase, GenRM phase, keep decision; each round draws
               ceil(missing x factor), the factor adapted from the keep rate (one sampler per
               run: the previous step's rate starts the next).
      partial  stream: the trainer's own genrm.JudgedStream (the first draw enters the
               engine, each finished sample goes to the judge at once, a group is offered to
               the sampler once all its samples are judged, and every arrival tops the engine
               up; once every rank is full (should_abort), the rollout engine is aborted and so
               is the judge's leftover work). Cut groups are dropped, or with --keep-partial
               kept (core.PartialRollouts as the stream's carry) and resumed first in the next
               step, their tokens' logprobs the old engine's. The memory split follows the
               live queues (placement.PendingLoad). Each sample's forced length is set by
               _ForcedLengths, an engine wrapper that also notes each response's arrival. Top-ups use
               core's stream keep rate, steadied by last step's (before, the step's own rate
               after one dropped group was 0, which drew 4x the missing groups at once). The step's
               timeline goes into the stats (stream_*_s: seconds from the stream's start).
    --fill-probability q (new sampler): each draw aims for the fewest groups that fill the batch
               with probability q instead of the expected number (rounds: the round's draw;
               stream: the groups kept in flight, so the abort has a tail to cut); the run is
               named "-fill<q>" (_step_setup.variant_key).
    --sampler old   the round-based sampler before over-sampling (core.sample_dynamically: each
               round draws only the missing groups, no over-sampling); partial overlaps the
               judge with the rollout inside each round (score_as_completed), nothing aborted.
"""

from __future__ import annotations

import asyncio
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _step_profile
import _step_setup as setup

SAMPLERS = ("new", "old")
MAX_ROUNDS = 3  # DAPO's and the trainer's default
MAX_OVERSAMPLE = 4.0
POLL_S = 0.01  # the stream's wait for the next judged group, between abort checks


def make_sampler(ctx: Any) -> Any:
    """One sampler for the run (its keep rate carries from step to step)."""
    from yatt import core

    target = len(ctx.prompts)  # this rank's groups per step
    if ctx.args.sampler == "old":  # sample_dynamically's sampler, exactly
        return core.DynamicSampler(
            target_groups=target,
            max_rounds=MAX_ROUNDS,
            should_adapt=False,
            group=ctx.runtime.dp_group,
        )
    is_stream = ctx.layout == "partial"
    return core.DynamicSampler(
        target_groups=target,
        max_oversample=MAX_OVERSAMPLE,
        max_rounds=MAX_ROUNDS,
        mode="stream" if is_stream else "rounds",
        fill_probability=getattr(ctx.args, "fill_probability", None),
        group=ctx.runtime.dp_group,
    )


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def trainer() -> Any:
    """examples/train_grpo.py as a module: the bench's rounds and updates are the trainer's own."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_grpo

    return train_grpo


def generate_and_score(
    ctx: Any, phases: dict, requests: list, sampling: Any, to_sample: Any
) -> tuple[list, list, float | None]:
    """One rollout of `requests` and its verdicts: (completions, verdicts, the judge's tail),
    through yatt.genrm.generate_and_judge (the trainer's own round) and the phase times it measures
    (its responses and verdicts are host lists: the device's work is in them), inside one
    profiler range.

    Partial colocation: one "rollout+genrm" phase, the judge scoring each completion as it
    lands (genrm.score_as_completed) while the rollout's tail decodes, and the memory split
    moved toward the round's loads; the tail is the seconds from the rollout's last completion
    to the last verdict. Otherwise the rollout phase, then the genrm phase (none on a GPU whose
    judge is elsewhere, dedicated), and no tail (None)."""
    from yatt import genrm

    timings: dict[str, float] = {}
    should_overlap = ctx.layout == "partial"
    # The profiler's ranges are the phases': around the whole call when overlapped, else
    # around the engine's generate() and the judge's score() (the library calls it makes).
    engine, judge = ctx.engine, ctx.judge
    if not should_overlap:
        engine, judge = _InRange(engine, "generate", "rollout"), _InRange(judge, "score", "genrm")
    overlapped = _step_profile.phase_range("rollout+genrm") if should_overlap else nullcontext()
    with overlapped:
        completions, verdicts = genrm.generate_and_judge(
            requests,
            sampling,
            to_sample,
            engine=engine,
            scorer=judge,
            plan=ctx.plan,
            should_overlap=should_overlap,
            timings=timings,
        )
    tail_s = timings.pop("genrm_tail", None)  # the callers put it in phases themselves
    for name, seconds in timings.items():
        phases[name] = phases.get(name, 0.0) + seconds
    return completions, verdicts, tail_s


class _InRange:
    """`target` with its method `method` run inside the profiler range `name`."""

    def __init__(self, target: Any, method: str, name: str) -> None:
        self.target, self.method, self.name = target, method, name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.target, attr)
        if attr != self.method:
            return value

        def in_range(*args: Any, **kwargs: Any) -> Any:
            with _step_profile.phase_range(self.name):
                return value(*args, **kwargs)

        return in_range


def make_partials(ctx: Any) -> Any:
    """--keep-partial: cut groups held for the next step (refused without rollout correction)."""
    from yatt import core

    if not ctx.args.keep_partial:
        return None
    return core.PartialRollouts(rollout_correction=ctx.loss.rollout_correction)


@dataclass
class _Group:
    """A drawn group in flight: its samples' completions and verdicts as they come."""

    seed: setup.SeedGroup
    prompt_ids: list[int]
    # sample index -> what the engine gave back (a Completion, or a core.PartialSample joined
    # from last step's part and this step's continuation)
    completions: dict[int, Any] = field(default_factory=dict)
    aborted: dict[int, Any] = field(default_factory=dict)  # cut samples (partial outputs)
    parts: dict[int, Any] = field(default_factory=dict)  # resumed: last step's PartialSample
    first_step: int | None = None  # resumed: the step its oldest tokens come from

    def budget(self, j: int) -> int:
        """Response tokens sample j still has to generate (its forced length, less its part)."""
        length = self.seed.lengths[j]
        return self.parts[j].num_tokens_left(length) if j in self.parts else length


@dataclass
class _Tally:
    """This rank's counts over the step."""

    num_completions: int = 0  # finished samples
    response_tokens: int = 0  # every token generated this step, cut outputs included
    aborted_tokens: int = 0
    judge_prompt_tokens: int = 0
    num_unparsable: int = 0
    bad_lengths: int = 0  # finished responses not of their forced length
    num_resumed_groups: int = 0
    num_kept_partial: int = 0
    genrm_tail_s: float = 0.0
    # The stream's timeline, seconds from its start (None: did not happen): the first group
    # judged, the last response of a kept group, the target reached (abort), the rollout's
    # end (its last response, or the abort's), and the end (the judge drained).
    timeline: dict[str, float | None] = field(default_factory=dict)


def _requests(ctx: Any, groups: list[_Group], sampling_max: int) -> list[Any]:
    from yatt import rollout

    out = []
    for g in groups:
        for j in range(len(g.seed.lengths)):
            if j in g.completions:  # finished last step (a resumed group)
                continue
            prompt_ids = g.prompt_ids
            if j in g.parts:  # continue the cut response where it stopped
                prompt_ids = g.parts[j].resume_prompt_ids()
            out.append(
                rollout.Request(
                    prompt_ids=prompt_ids,
                    max_new_tokens=min(g.budget(j), sampling_max),
                    metadata={"group": g.seed.key, "sample": j},
                )
            )
    return out


def _sampling(step: int) -> Any:
    from yatt import rollout

    return rollout.SamplingParams(
        temperature=1.0,
        max_new_tokens=setup.MAX_RESPONSE_TOKENS,
        ignore_eos=True,
        seed=1000 + step,
    )


def _draw(ctx: Any, step: int, count: int) -> list[_Group]:
    work, tok = ctx.work, ctx.engine.tokenizer
    out = []
    for _ in range(count):
        seed = setup.seed_group(work, step, ctx.runtime.dp_rank, ctx.num_drawn)
        ctx.num_drawn += 1
        ids = tok(seed.text, add_special_tokens=False)["input_ids"]
        out.append(_Group(seed=seed, prompt_ids=ids))
    return out


def _to_sample(group: _Group, completion: Any) -> Any:
    from yatt import genrm

    return genrm.Sample(prompt=group.seed.text, response=setup.ids_to_text(completion.response_ids))


def _group_batch(groups: list[_Group], group_size: int) -> Any:
    """The judged groups as a training batch: rewards are the hidden labels."""
    from yatt import core

    completions, rewards, ids = [], [], []
    for g in groups:
        for j in range(group_size):
            completions.append(g.completions[j])
            rewards.append(float(g.seed.labels[j]))  # the hidden label decides
            ids.append(g.seed.key)
    return core.rollout_batch(core.rollout_samples(completions, rewards=rewards, group_ids=ids))


def _finish(group: _Group, j: int, completion: Any, tally: _Tally) -> Any:
    """A finished sample: joined to its part from last step (if resumed), its length checked."""
    tally.num_completions += 1
    tally.response_tokens += len(completion.response_ids)
    if j in group.parts:
        completion = group.parts[j].resumed(completion)
    tally.bad_lengths += len(completion.response_ids) != group.seed.lengths[j]
    group.completions[j] = completion
    return completion


def _record_verdict(verdict: Any, tally: _Tally) -> None:
    tally.judge_prompt_tokens += verdict.num_judge_prompt_tokens
    tally.num_unparsable += verdict.status != "ok"


# -- rounds: full colocation (new and old) and today's partial ------------------------------------
def rounds_step(ctx: Any, step: int, phases: dict[str, float]) -> tuple[Any, dict, _Tally]:
    from yatt import core

    sampler = ctx.sampler
    work, tally, sampling = ctx.work, _Tally(), _sampling(step)
    ctx.num_drawn = 0
    while not sampler.is_done():
        groups = _draw(ctx, step, sampler.num_to_draw())
        batch = core.rollout_batch([])
        if groups:
            requests = _requests(ctx, groups, sampling.max_new_tokens)
            by_key = {g.seed.key: g for g in groups}

            def to_sample(c, by_key=by_key):
                return _to_sample(by_key[c.metadata["group"]], c)

            completions, verdicts, tail_s = generate_and_score(
                ctx, phases, requests, sampling, to_sample
            )
            if tail_s is not None:  # today's partial: the judge overlaps inside the round
                tally.genrm_tail_s += tail_s
            for c, v in zip(completions, verdicts, strict=True):
                g, j = by_key[c.metadata["group"]], c.metadata["sample"]
                _finish(g, j, c, tally)
                _record_verdict(v, tally)
            batch = _group_batch(groups, work.group_size)
        sampler.add(batch)
    batch, stats = sampler.take()
    return batch, stats, tally


# -- stream: partial colocation with the new sampler: the trainer's genrm.JudgedStream ------------
class _ForcedLengths:
    """The rollout engine, each sample forced to its seed group's length: a request of n
    samples becomes n one-sample requests (max_new_tokens: the sample's forced length, less
    what a resumed part already has), their completions renumbered back. Notes each response's
    arrival and the rollout's end for the timeline, and the tokens generated."""

    def __init__(self, engine: Any, tally: _Tally) -> None:
        self.engine, self.tally = engine, tally
        self.arrived: dict[tuple[int, int], float] = {}  # (group, sample) -> response's time
        self.last_completion_t: float | None = None
        self.is_aborted = False
        self.abort_end: float | None = None

    def stream(self, requests: list, sampling: Any):
        from dataclasses import replace

        singles, origin = [], []
        for i, request in enumerate(requests):
            seed = request.metadata["seed"]
            done = len(request.prompt_ids) - request.metadata["prompt_len"]  # a resumed part
            indices = [request.metadata["sample"]] if "sample" in request.metadata else []
            for j in indices or range(sampling.n):
                budget = max(seed.lengths[j] - done, 1)
                metadata = request.metadata | {"sample": j}
                singles.append(replace(request, max_new_tokens=budget, metadata=metadata))
                origin.append(i)
        inner = self.engine.stream(singles, replace(sampling, n=1))

        async def renumbered():
            async for c in inner:
                c.request_index = origin[c.request_index]
                c.sample_index = c.metadata["sample"]
                self.last_completion_t = time.perf_counter()
                self.arrived[(c.metadata["group"], c.sample_index)] = self.last_completion_t
                self.tally.response_tokens += len(c.response_ids)
                if c.finish_reason == "abort":
                    self.tally.aborted_tokens += len(c.response_ids)
                else:
                    self.tally.num_completions += 1
                yield c
            if self.is_aborted:
                self.abort_end = time.perf_counter()

        return renumbered()

    def abort(self) -> None:
        self.is_aborted = True
        self.engine.abort()


class _CountingJudge:
    """The judge, its verdicts counted as they come (cut groups' included)."""

    def __init__(self, judge: Any, tally: _Tally) -> None:
        self.judge, self.tally = judge, tally

    async def ascore(self, samples: list) -> list:
        verdicts = await self.judge.ascore(samples)
        for verdict in verdicts:
            _record_verdict(verdict, self.tally)
        return verdicts

    def score(self, samples: list, *, should_stop=None) -> list:
        return self.judge.score(samples)


class _TimedSampler:
    """The sampler, the moment it first says every rank is full noted (the timeline's full)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.full_t: float | None = None

    def num_to_draw(self, *, in_flight: int) -> int:
        return self.sampler.num_to_draw(in_flight=in_flight)

    def should_abort(self) -> bool:
        is_full = self.sampler.should_abort()
        if is_full and self.full_t is None:
            self.full_t = time.perf_counter()
        return is_full


def stream_step(ctx: Any, step: int, phases: dict[str, float]) -> tuple[Any, dict, _Tally]:
    """One step through genrm.JudgedStream, as the trainer's rollout_streamed runs it, with the
    seed mix's groups as its payloads and their hidden labels as rewards."""
    from yatt import genrm, rollout
    from yatt.placement import PendingLoad

    sampler, plan, tally = ctx.sampler, ctx.plan, _Tally()
    ctx.num_drawn = 0
    engine = _ForcedLengths(ctx.engine, tally)
    timed_sampler = _TimedSampler(sampler)
    tok = ctx.engine.tokenizer
    ids = {}  # seed key -> its prompt's ids (tokenized once)

    def to_request(seed: setup.SeedGroup) -> Any:
        prompt_ids = ids.setdefault(seed.key, tok(seed.text, add_special_tokens=False)["input_ids"])
        metadata = {"seed": seed, "prompt_len": len(prompt_ids)}
        return rollout.Request(prompt_ids=list(prompt_ids), metadata=metadata)

    def to_sample(seed: setup.SeedGroup, completion: Any) -> Any:
        return genrm.Sample(prompt=seed.text, response=setup.ids_to_text(completion.response_ids))

    marks: dict[str, float] = {}

    def keep(group: genrm.StreamedGroup) -> None:
        marks.setdefault("first_judged", time.perf_counter())
        seed = group.payload
        for j, completion in enumerate(group.completions):
            tally.bad_lengths += len(completion.response_ids) != seed.lengths[j]
        groups = _Group(seed=seed, prompt_ids=[], completions=dict(enumerate(group.completions)))
        if sampler.add(_group_batch([groups], ctx.work.group_size)):
            arrivals = [engine.arrived.get((group.key, j)) for j in range(ctx.work.group_size)]
            last = max((t for t in arrivals if t is not None), default=None)
            if last is not None:  # (resumed samples arrived last step)
                marks["last_kept_response"] = max(last, marks.get("last_kept_response", last))

    sampling = replace_n(_sampling(step), ctx.work.group_size)
    stream = genrm.JudgedStream(
        engine=engine,
        judge_engine=ctx.judge_engine,
        scorer=_CountingJudge(ctx.judge, tally),
        sampling=sampling,
        to_request=to_request,
        to_sample=to_sample,
        step=step,
        carry=ctx.partials,
        load=PendingLoad(),
    )
    with _step_profile.timed(phases, "rollout+genrm"), plan.phase("rollout"):
        start = time.perf_counter()  # in the phase: after the switch
        asyncio.run(
            stream.run(
                timed_sampler,
                draw=lambda count: [g.seed for g in _draw(ctx, step, count)],
                keep=keep,
            )
        )
        _step_profile._sync()
        end = time.perf_counter()
    rollout_end = engine.abort_end if engine.is_aborted else engine.last_completion_t
    tally.genrm_tail_s = end - (rollout_end or end)
    marks |= {"full": timed_sampler.full_t, "rollout_end": rollout_end, "end": end}
    tally.timeline = {k: None if t is None else t - start for k, t in marks.items()}
    tally.num_resumed_groups = stream.num_resumed
    # Cut groups: counted, and with --keep-partial held for the next step (the stream's carry).
    cut = stream.cut_groups()
    sampler.record_aborted(len(cut), num_tokens=tally.aborted_tokens)
    tally.num_kept_partial = len(cut) if ctx.partials is not None else 0
    pending = stream.pending_tokens()
    fraction = plan.update_load(**pending)
    batch, stats = sampler.take()
    stats |= {f"split_{k}": v for k, v in pending.items()}
    stats["split_rollout_fraction"] = fraction
    stats |= stream_stats(tally.timeline)
    return batch, stats, tally


def replace_n(sampling: Any, n: int) -> Any:
    """The step's sampling with n responses per group (the stream's group size)."""
    from dataclasses import replace

    return replace(sampling, n=n)


def stream_stats(timeline: dict[str, float | None]) -> dict[str, float]:
    """The timeline as stats (stream_<mark>_s), and the judge's time after the last kept
    group's last response (stream_judge_after_last_kept_s): on one GPU the floor of the
    stream's tail, as that response's verdict alone takes the judge's whole decode."""
    out = {f"stream_{k}_s": float(v) for k, v in timeline.items() if v is not None}
    last, full = timeline.get("last_kept_response"), timeline.get("full")
    if last is not None and full is not None:
        out["stream_judge_after_last_kept_s"] = float(full - last)
    return out
