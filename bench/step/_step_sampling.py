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
      partial  stream: the first draw enters the engine, each finished sample goes to the
               judge at once, a group is offered to the sampler once all its samples are
               judged, and every arrival tops the engine up (num_to_draw(in_flight=...)). Once
               every rank is full (should_abort), the rollout engine is aborted (in-flight
               requests end with their partial output) and so is the judge's leftover work.
               Cut groups are dropped, or with --keep-partial kept (core.PartialRollouts) and
               resumed first in the next step, their tokens' logprobs the old engine's.
               The memory split follows the live queues (placement.PendingLoad). Top-ups use
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
    through the trainer's own train_grpo.generate_and_judge, timed by the CUDA-syncing timer.

    Partial colocation: one "rollout+genrm" phase, the judge scoring each completion as it
    lands (genrm.score_as_completed) while the rollout's tail decodes, and the memory split
    moved toward the round's loads; the tail is the seconds from the rollout's last completion
    to the last verdict. Otherwise the rollout phase, then the genrm phase (none on a GPU whose
    judge is elsewhere, dedicated), and no tail (None)."""
    timings: dict[str, float] = {}
    completions, verdicts = trainer().generate_and_judge(
        requests,
        sampling,
        to_sample,
        engine=ctx.engine,
        scorer=ctx.judge,
        plan=ctx.plan,
        should_overlap=ctx.layout == "partial",
        timings=timings,
        timer=_step_profile.timed,
    )
    tail_s = timings.pop("genrm_tail", None)  # the callers put it in phases themselves
    for name, seconds in timings.items():
        phases[name] = phases.get(name, 0.0) + seconds
    return completions, verdicts, tail_s


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


# -- stream: partial colocation with the new sampler --------------------------------------------
class _Stream:
    """One step's stream (see the module docstring); run() is the whole rollout+GenRM."""

    def __init__(self, ctx: Any, step: int) -> None:
        from yatt import genrm
        from yatt.placement import PendingLoad

        self.ctx, self.step = ctx, step
        self.sampler = ctx.sampler
        self.sampling = _sampling(step)
        self.group_size = ctx.work.group_size
        self.tally = _Tally()
        self.load = PendingLoad()
        self.groups: dict[int, _Group] = {}  # every group fed this step, by key
        self.texts: dict[int, str] = {}  # id(completion) -> its prompt's text (for the judge)
        self.judging = genrm.GroupJudging(
            ctx.judge, self._to_sample, group_size=self.group_size, on_verdict=self._on_verdict
        )
        self.num_in_flight = 0  # groups fed and not yet handed back judged
        self.pumps: set[asyncio.Task] = set()
        # The live queues, in tokens a KV cache holds: the rollout's unfinished requests
        # (prompt + the response tokens they may still generate: counted whole until they
        # finish), the judge's samples without a verdict (its prompt: template + question +
        # response, and its verdict).
        self.request_tokens: dict[tuple[int, int], int] = {}
        self.rollout_pending = 0
        self.genrm_pending = 0
        self.rollout_end: float | None = None
        self.last_completion_t: float | None = None
        self.arrived: dict[tuple[int, int], float] = {}  # (group, sample) -> response's time
        self.num_judged = 0  # groups offered to the sampler
        self.start = time.perf_counter()
        self.marks: dict[str, float] = {}  # first_judged, last_kept_response, full

    def _note(self) -> None:
        self.load.record(
            time.perf_counter(),
            rollout_tokens=self.rollout_pending,
            genrm_tokens=self.genrm_pending,
        )

    def _judge_cost(self, completion: Any) -> int:
        work = self.ctx.work
        return (
            setup.JUDGE_TEMPLATE_TOKENS
            + work.prompt_tokens
            + len(completion.response_ids)
            + work.judge_tokens
        )

    def _to_sample(self, completion: Any) -> Any:
        from yatt import genrm

        text = self.texts[id(completion)]
        return genrm.Sample(prompt=text, response=setup.ids_to_text(completion.response_ids))

    def _on_verdict(self, key: int, completion: Any, verdict: Any) -> None:
        self.genrm_pending -= self._judge_cost(completion)
        self._note()
        _record_verdict(verdict, self.tally)

    def _add(self, g: _Group, j: int, completion: Any) -> None:
        """To the judge (an aborted one is set aside there)."""
        if completion.finish_reason != "abort":
            self.texts[id(completion)] = g.seed.text
            self.genrm_pending += self._judge_cost(completion)
            self._note()
        self.judging.add(completion, group=g.seed.key, index=j)

    def _feed(self, groups: list[_Group]) -> None:
        if not groups:
            return
        self.num_in_flight += len(groups)
        for g in groups:
            self.groups[g.seed.key] = g
        requests = _requests(self.ctx, groups, self.sampling.max_new_tokens)
        for r in requests:  # the KV it will hold: prompt (and part) + the tokens it owes
            key = (r.metadata["group"], r.metadata["sample"])
            self.request_tokens[key] = len(r.prompt_ids) + r.max_new_tokens
            self.rollout_pending += self.request_tokens[key]
        self._note()
        for g in groups:  # samples finished last step go straight to the judge
            for j, c in g.completions.items():
                self._add(g, j, c)
        if requests:
            stream = self.ctx.engine.stream(requests, self.sampling)
            task = asyncio.get_running_loop().create_task(self._pump(stream))
            self.pumps.add(task)
            task.add_done_callback(self.pumps.discard)

    async def _pump(self, stream) -> None:
        async for c in stream:
            g, j = self.groups[c.metadata["group"]], c.metadata["sample"]
            self.rollout_pending -= self.request_tokens.pop((g.seed.key, j))
            self.last_completion_t = time.perf_counter()
            self.arrived[(g.seed.key, j)] = self.last_completion_t
            if c.finish_reason == "abort":
                self.tally.response_tokens += len(c.response_ids)
                self.tally.aborted_tokens += len(c.response_ids)
                self._add(g, j, c)
            else:
                self._add(g, j, _finish(g, j, c, self.tally))

    def _top_up(self) -> None:
        more = self.sampler.num_to_draw(in_flight=self.num_in_flight)
        self._feed(_draw(self.ctx, self.step, more))

    def _offer(self, judged: Any) -> None:
        """A judged group to the sampler; a kept one's last response marks the timeline."""
        now = time.perf_counter()
        self.marks.setdefault("first_judged", now)
        self.num_in_flight -= 1
        self.num_judged += 1
        g = self.groups[judged.group]
        g.completions = dict(enumerate(judged.completions))
        if self.sampler.add(_group_batch([g], self.group_size)):
            arrivals = [self.arrived.get((g.seed.key, j)) for j in range(self.group_size)]
            last = max((t for t in arrivals if t is not None), default=None)
            if last is not None:  # (resumed samples arrived last step)
                self.marks["last_kept_response"] = max(
                    last, self.marks.get("last_kept_response", last)
                )

    async def run(self, resumed: list[_Group]) -> None:
        sampler, judging = self.sampler, self.judging
        self.start = time.perf_counter()  # in the phase: after the switch
        self._feed(resumed)
        self._top_up()
        while True:
            judged = await judging.next_group(timeout_s=POLL_S)
            if judged is not None:
                self._offer(judged)
            if sampler.should_abort():
                self.marks["full"] = time.perf_counter()
                break
            self._top_up()
            if not self.num_in_flight:
                break  # nothing in flight and nothing more to draw: take() waits for the rest
        await self._cut()

    def timeline(self, end: float) -> dict[str, float | None]:
        """The step's marks in seconds from the stream's start (see _Tally.timeline)."""
        marks = self.marks | {"rollout_end": self.rollout_end, "end": end}
        return {k: None if t is None else t - self.start for k, t in marks.items()}

    async def _cut(self) -> None:
        """Abort what is left: the rollout's in-flight requests (their partial outputs come
        back as "abort"), then the judge's work on samples nobody needs any more."""
        ctx = self.ctx
        if self.pumps:
            ctx.engine.abort()
            await asyncio.gather(*self.pumps)
            self.rollout_end = time.perf_counter()
        else:  # the rollout ended by itself, at its last completion
            self.rollout_end = self.last_completion_t
        self.rollout_pending = 0
        self._note()
        abort = ctx.judge_engine.abort if ctx.judge_engine is not None else None
        await self.judging.drain(abort=abort)  # a judge batch started late is cut too
        self.genrm_pending = 0
        self._note()

    def cut_groups(self) -> list[_Group]:
        """The groups the abort cut: their finished samples and their cut ones."""
        out = []
        for key, (judged, aborted) in self.judging.unfinished().items():
            g = self.groups[key]
            g.completions = {j: c for j, (c, _) in judged.items()}
            g.aborted = dict(aborted)
            out.append(g)
        return out


def stream_step(ctx: Any, step: int, phases: dict[str, float]) -> tuple[Any, dict, _Tally]:
    sampler, plan = ctx.sampler, ctx.plan
    ctx.num_drawn = 0
    resumed = _resume(ctx, step)
    run = _Stream(ctx, step)
    run.tally.num_resumed_groups = len(resumed)
    with _step_profile.timed(phases, "rollout+genrm"), plan.phase("rollout"):
        asyncio.run(run.run(resumed))
        _step_profile._sync()
        end = time.perf_counter()
    run.tally.genrm_tail_s = end - (run.rollout_end or end)
    run.tally.timeline = run.timeline(end)
    # Cut groups: counted, and with --keep-partial held for the next step.
    cut = run.cut_groups()
    sampler.record_aborted(len(cut), num_tokens=run.tally.aborted_tokens)
    if ctx.partials is not None:
        for g in cut:
            ctx.partials.put(_partial_group(g, step))
        run.tally.num_kept_partial = len(cut)
    pending = run.load.pending_tokens(end)
    fraction = plan.update_load(**pending)
    batch, stats = sampler.take()
    stats |= {f"split_{k}": v for k, v in pending.items()}
    stats["split_rollout_fraction"] = fraction
    stats |= stream_stats(run.tally.timeline)
    return batch, stats, run.tally


def stream_stats(timeline: dict[str, float | None]) -> dict[str, float]:
    """The timeline as stats (stream_<mark>_s), and the judge's time after the last kept
    group's last response (stream_judge_after_last_kept_s): on one GPU the floor of the
    stream's tail, as that response's verdict alone takes the judge's whole decode."""
    out = {f"stream_{k}_s": float(v) for k, v in timeline.items() if v is not None}
    last, full = timeline.get("last_kept_response"), timeline.get("full")
    if last is not None and full is not None:
        out["stream_judge_after_last_kept_s"] = float(full - last)
    return out


def _partial_group(g: _Group, step: int) -> Any:
    from yatt import core

    samples = []
    for j in range(len(g.seed.lengths)):
        if j in g.completions:  # finished (a resumed one already joined to its part)
            samples.append(core.PartialSample.from_completion(g.completions[j]))
        elif j in g.parts:  # cut again: what it has now, joined to what it had before
            samples.append(g.parts[j].resumed(g.aborted[j]))
        else:
            samples.append(core.PartialSample.from_completion(g.aborted[j]))
    first = step if g.first_step is None else g.first_step
    return core.PartialGroup(samples=samples, step=first, prompt=g.seed)


def _resume(ctx: Any, step: int) -> list[_Group]:
    """Last step's cut groups (--keep-partial), as groups in flight: finished samples judged
    at once, cut ones continued from where they stopped."""
    if ctx.partials is None:
        return []
    out = []
    for pg in ctx.partials.take(step):
        g = _Group(seed=pg.prompt, prompt_ids=list(pg.samples[0].prompt_ids), first_step=pg.step)
        for j, s in enumerate(pg.samples):
            if s.is_finished or not s.num_tokens_left(pg.prompt.lengths[j]):
                g.completions[j] = s
            else:
                g.parts[j] = s
        out.append(g)
    return out
