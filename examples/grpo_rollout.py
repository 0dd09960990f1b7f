"""The reference trainer's rollout: what every rollout kind shares, and the on-policy kinds.

    ctx = RolloutContext(cfg=cfg, runtime=runtime, ...)  built once by train_grpo.train()
    batch, sampling_stats = rollout_in_rounds(step, ctx, stats)   rollout.sampling_mode=rounds
    batch, sampling_stats = rollout_streamed(step, ctx, stats)    rollout.sampling_mode=stream
    scored = generate_and_score(prompts, sampling, ...)  n responses per prompt, each judged
    keep(scored, ctx, stats)                             DAPO's keep rule, into ctx.sampler
    batch, sampling_stats = take_batch(ctx.sampler, should_stop=...)  the step's groups

A rollout kind is one function (step, ctx, stats) -> (batch, sampling_stats): it draws this
rank's prompts (ctx.draw), generates and judges them, hands judged groups to keep() until
ctx.sampler is full and returns take_batch()'s batch. train_grpo.py picks one from its ROLLOUTS
table by the config and its loop calls it once a step. The off-policy kind is in
grpo_offpolicy.py, the multi-turn one in grpo_multiturn.py; both build on this module. The two
on-policy kinds stay here: short functions made only of this module's pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_config import DataConfig, TrainConfig
from grpo_data import Scored, judge_sample
from grpo_metrics import StepStats
from grpo_prompts import Prompt, PromptEncoder

from yatt import core, genrm, rollout
from yatt.placement import PendingLoad, Plan

logger = logging.getLogger("train_grpo")


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def derived_seed(seed: int, *offsets: int) -> int:
    """The seed rule, written once: every seed of the run is the config's seed mixed with the
    offsets that tell its uses apart (DP rank, step, round, epoch), so a resumed run and TP
    peers draw alike and no two uses share a seed."""
    return (seed * 1_000_003 + sum(offsets)) % 2**31


# -- prompts -> responses -> verdicts ------------------------------------------------------------
def judge_view(
    prompt: Prompt, completion: rollout.Completion, tokenizer, data: DataConfig
) -> genrm.Sample:
    """What the judge reads of a response: its row's question and reference, the response
    decoded once (a vision token ends a response, see grpo_prompts.py; decoding skips it)."""
    response = tokenizer.decode(completion.response_ids, skip_special_tokens=True)
    return judge_sample(
        prompt.row, response, prompt_key=data.prompt_key, answer_key=data.answer_key
    )


def generate_and_score(
    prompts: list[Prompt],
    sampling: rollout.SamplingParams,
    *,
    engine,
    scorer,
    plan: Plan,
    tokenizer,
    data: DataConfig,
    should_overlap: bool,
    timings: dict[str, float],
    should_stop: Callable[[], bool] | None = None,
) -> list[Scored]:
    """n responses per prompt (with its images, processed once by the encoder), each decoded
    once and judged (judge_view). should_overlap (rollout and judge resident together): each
    response is judged as soon as it finishes. should_stop (a stop signal's flag): polled while
    the judge works, genrm.ScoringStopped once it turns true."""
    return genrm.judge_prompts(
        prompts,
        sampling,
        to_request=lambda prompt: prompt.request(),
        to_sample=lambda prompt, completion: judge_view(prompt, completion, tokenizer, data),
        engine=engine,
        scorer=scorer,
        plan=plan,
        should_overlap=should_overlap,
        timings=timings,
        should_stop=should_stop,
    )


def to_batch(
    scored: Sequence[Scored],
    runtime: core.Runtime,
    encoder: PromptEncoder,
    *,
    policy_version: int = 0,
    policy_versions: Sequence[int | Sequence[int]] | None = None,
) -> core.Batch:
    """Training samples: prompt + response tokens, the loss on the response; a group per
    prompt; a prompt's images (VisionInputs) with each of its samples; a response cut before
    a vision token (a policy refuses an image token without its image); every token stamped
    with the policy version that sampled it (off-policy steps): `policy_version` for all, or
    per response its own (`policy_versions`: an int, or one per response token)."""
    samples = core.rollout_samples(
        [item.completion for item in scored],
        rewards=[item.verdict.reward for item in scored],
        group_ids=[item.completion.request_index for item in scored],
        vision_inputs=vision_inputs_of(scored, encoder),
        cut_at_token_ids=encoder.cut_token_ids,
        policy_version=policy_version,
        policy_versions=policy_versions,
    )
    samples = core.broadcast_to_tp_peers(samples, runtime)  # TP peers: one batch (host sync)
    return core.rollout_batch(samples)


def vision_inputs_of(scored: Sequence[Scored], encoder: PromptEncoder) -> list | None:
    """Each sample's images (None: no sample has any): a multi-turn trajectory's own (its
    tools' pictures, Trajectory.image_inputs), else its prompt's (data.image_key)."""
    visions = []
    for item in scored:
        trajectory = getattr(item.completion, "trajectory", None)
        if trajectory is not None:
            inputs = getattr(trajectory, "image_inputs", None)
            visions.append(None if inputs is None else core.VisionInputs(*inputs))
        else:
            visions.append(item.prompt.vision if encoder.takes_images else None)
    return visions if encoder.takes_images or any(v is not None for v in visions) else None


# -- the keep rule -----------------------------------------------------------------------------
TASK_REWARD = "task_reward"  # the judge's reward before the overlong penalty: the keep signal
# data/skipped_rows/<cause> of rows the reward could not judge at all (Verdict.skip_cause)
UNJUDGEABLE = "unjudgeable"


def keep(
    scored: Sequence[Scored],
    ctx: RolloutContext,
    stats: StepStats,
    *,
    policy_version: int = 0,
    policy_versions: Sequence[Sequence[int]] | None = None,
) -> None:
    """A round's or a group's judged responses to the sampler, counted. DAPO's keep rule:
    whole groups whose task reward varies (eq. 11), tested BEFORE the soft overlong penalty
    (eq. 13, 0 when off) joins the reward, as DAPO and verl filter on the accuracy signal: an
    all-right group with one overlong response has nothing to teach, and its penalty alone
    would make std normalisation push the wrong way. A group with a response the reward could
    not judge is dropped first, as a bad row (unjudgeable_groups). Every token is stamped with
    `policy_version`, or with its own from `policy_versions` (one list per response of
    `scored`, one version per response token: off-policy multi-turn trajectories)."""
    bad = unjudgeable_groups(scored, ctx)
    is_kept = [item.completion.request_index not in bad for item in scored]
    if policy_versions is not None:  # filtered in step with the responses
        policy_versions = [v for v, ok in zip(policy_versions, is_kept, strict=True) if ok]
    scored = [item for item, ok in zip(scored, is_kept, strict=True) if ok]
    if not scored:  # every group unjudgeable: the round still offers its (empty) share
        ctx.sampler.add(core.rollout_batch([]))
        return
    stats.add(scored, ctx.accuracy, cut_token_ids=ctx.encoder.cut_token_ids)
    groups = to_batch(
        scored,
        ctx.runtime,
        ctx.encoder,
        policy_version=policy_version,
        policy_versions=policy_versions,
    )
    groups.samples[TASK_REWARD] = groups.samples["reward"].clone()  # what the sampler tests
    groups.samples["reward"] += ctx.cfg.overlong.compute_penalties(
        groups, max_new_tokens=ctx.cfg.rollout.max_new_tokens
    )
    ctx.sampler.add(groups)  # keep: whole groups with task-reward variance


def drop_unjudgeable(scored: Sequence[Scored], ctx: RolloutContext) -> list[Scored]:
    """`scored` without the groups whose row the reward could not judge (unjudgeable_groups)."""
    bad = unjudgeable_groups(scored, ctx)
    return [item for item in scored if item.completion.request_index not in bad]


def unjudgeable_groups(scored: Sequence[Scored], ctx: RolloutContext) -> set[int]:
    """The groups (request indices) of `scored` whose row the reward could not judge (a
    verdict with a skip_cause: the row cannot be sent to a reward worker, its text is not valid
    Unicode): a data problem, skipped and counted as a bad row is
    (data/skipped_rows/unjudgeable, its first cause logged), never trained with the default
    reward."""
    bad = {item.completion.request_index for item in scored if item.verdict.skip_cause}
    if not bad:
        return bad
    if not ctx.num_unjudgeable_rows:
        cause = next(item.verdict.skip_cause for item in scored if item.verdict.skip_cause)
        logger.warning(
            "a row the reward cannot judge is skipped (counted in data/skipped_rows/%s; "
            "logged once): %s",
            UNJUDGEABLE,
            cause,
        )
    ctx.num_unjudgeable_rows += len(bad)
    return bad


def take_batch(sampler: core.DynamicSampler, *, should_stop: bool) -> tuple[core.Batch, dict]:
    """The step's kept groups (collective: waits for every rank) and the sampling stats, the
    penalised reward the one that trains; core.StepStopped on every rank when a stop signal
    reached any (should_stop: this rank's)."""
    return core.take_step_batch(sampler, should_stop=should_stop, drop_keys=(TASK_REWARD,))


# -- rollout kinds: (step, ctx, stats) -> (batch, sampling_stats), chosen by rollout.sampling_mode
@dataclass
class RolloutContext:
    """What every rollout kind reads: the run's data, engines, judge, plan and sampler."""

    cfg: TrainConfig
    runtime: core.Runtime
    loader: core.ShardedLoader
    encoder: PromptEncoder
    tokenizer: Any
    engine: Any
    judge_engine: Any  # None: the judge has no engine of its own (functions, an endpoint)
    scorer: genrm.Scorer
    accuracy: genrm.AccuracySignal | None  # reward.accuracy's signal; None: no such metric
    plan: Plan
    sampler: core.DynamicSampler
    partials: core.PartialRollouts | None  # rollout.keep_partial: cut groups held a step
    should_overlap: bool  # rollout and judge resident together: judge as responses finish
    multiturn: Any = None  # rollout.MultiTurnRollout when rollout.environment/tools are set
    offpolicy: Any = None  # core.AsyncRollout when rollout.max_staleness >= 1
    # a stop signal arrived: a safe point (between rounds, between judged groups, or inside a
    # judge that waits: genrm.ScoringStopped) ends the step
    should_stop: Callable[[], bool] = lambda: False
    num_unjudgeable_rows: int = 0  # since the start: rows the reward could not judge

    def draw(self, num_prompts: int) -> list[Prompt]:
        return core.draw_prompts(self.loader, self.encoder, num_prompts)

    def skipped_by_cause(self) -> dict[str, int]:
        """Rows skipped since the start by cause: the loader's, the encoder's, the reward's."""
        skipped = self.encoder.skipped_by_cause(self.loader)
        return skipped | {UNJUDGEABLE: self.num_unjudgeable_rows}

    def sampling(self, step: int, num_round: int) -> rollout.SamplingParams:
        """A round's sampling, seeded by (seed, DP rank, step, round)."""
        cfg = self.cfg
        return rollout.SamplingParams(
            n=cfg.rollout.samples_per_prompt,
            temperature=cfg.rollout.temperature,
            **cfg.rollout.sampling_knobs(),  # top_p, top_k, min_p, repetition_penalty
            max_new_tokens=cfg.rollout.max_new_tokens,
            seed=derived_seed(cfg.seed, self.runtime.dp_rank * 10_007, step * 101, num_round),
            stop_token_ids=self.encoder.cut_token_ids,  # a vision-language policy's (else none)
        )

    def generate_and_score(
        self, prompts: list[Prompt], sampling: rollout.SamplingParams, timings: dict[str, float]
    ) -> list[Scored]:
        return generate_and_score(
            prompts,
            sampling,
            engine=self.engine,
            scorer=self.scorer,
            plan=self.plan,
            tokenizer=self.tokenizer,
            data=self.cfg.data,
            should_overlap=self.should_overlap,
            timings=timings,
            should_stop=self.should_stop,  # a judge that never ends cannot hold a stop signal
        )


def rollout_in_rounds(
    step: int, ctx: RolloutContext, stats: StepStats
) -> tuple[core.Batch, dict[str, float]]:
    """rollout.sampling_mode=rounds: generate -> judge -> keep in rounds
    (genrm.judge_in_rounds) until every rank has its groups with reward variance (collective:
    a full rank draws 0 and still joins each round). A stop signal ends the rounds, also one
    that arrives while the judge works (core.StepStopped)."""

    def judge_round(prompts: list[Prompt], num_round: int) -> list[Scored]:
        sampling = ctx.sampling(step, stats.num_rounds + num_round)
        return ctx.generate_and_score(prompts, sampling, stats.timings)

    stats.num_rounds += genrm.judge_in_rounds(
        ctx.sampler,
        draw=ctx.draw,
        judge_round=judge_round,
        keep=lambda judged: keep(judged, ctx, stats),
        should_stop=ctx.should_stop,
    )
    return take_batch(ctx.sampler, should_stop=ctx.should_stop())


def rollout_streamed(
    step: int, ctx: RolloutContext, stats: StepStats
) -> tuple[core.Batch, dict[str, float]]:
    """rollout.sampling_mode=stream: generate -> judge -> keep as one stream
    (genrm.JudgedStream): last step's cut groups first (keep_partial), prompts fed as the
    sampler asks, each judged group kept at once, the long tail cut once every rank is full;
    the cut groups counted (held with keep_partial); the memory split moved by the step's live
    queues."""
    cfg, sampler, partials = ctx.cfg, ctx.sampler, ctx.partials
    stream = genrm.JudgedStream(
        engine=ctx.engine,
        judge_engine=ctx.judge_engine,
        scorer=ctx.scorer,
        sampling=ctx.sampling(step, 0),
        to_request=lambda prompt: prompt.request(),  # its images processed once
        to_sample=lambda prompt, c: judge_view(prompt, c, ctx.tokenizer, cfg.data),
        step=step,
        carry=partials,  # rollout.keep_partial: resumed first, the cut ones held
        load=PendingLoad(),
    )
    with timed(stats.timings, "rollout+genrm"), ctx.plan.phase("rollout"):
        asyncio.run(
            stream.run(
                sampler,  # polls should_abort (every rank full), never blocks
                draw=ctx.draw,
                keep=lambda group: keep(genrm.judged_samples(group), ctx, stats),
                should_stop=ctx.should_stop,  # between judged groups: the tail cut, then saved
            )
        )
    cut = stream.cut_groups()
    sampler.record_aborted(len(cut), num_tokens=stream.num_aborted_tokens)
    pending = stream.pending_tokens()
    if ctx.plan.has_memory_split:  # the next split follows the step's live queues
        ctx.plan.update_load(**pending)
    # waits for every rank's stream; core.StepStopped on every rank if a stop signal ended one
    batch, sampling_stats = take_batch(sampler, should_stop=ctx.should_stop())
    stats.num_rounds = int(sampling_stats["num_rounds"])
    sampling_stats |= {
        "num_groups_resumed": float(stream.num_resumed),
        "num_groups_kept_partial": float(len(cut) if partials is not None else 0),
        # since the start: cut again when resumed, so too old to resume once more
        "num_partial_groups_dropped_stale": float(
            partials.num_dropped_stale if partials is not None else 0
        ),
        "num_engine_calls": float(stream.num_calls),
        **{key: float(value) for key, value in pending.items()},
    }
    return batch, sampling_stats
