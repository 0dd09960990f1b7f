"""Reference GRPO trainer: every rank runs this same file (one controller per data-parallel rank).

    python examples/train_grpo.py                                   # embedded default, CPU
    python examples/train_grpo.py task=vision                       # embedded image task, CPU
    torchrun --nproc_per_node 2 examples/train_grpo.py              # 2 ranks (gloo or NCCL)
    python examples/train_grpo.py --config examples/configs/tiny_partial.yaml num_steps=5
    python examples/train_grpo.py --resume                          # continue from out_dir
    python examples/train_grpo.py --export                          # newest checkpoint -> HF
    torchrun --nproc_per_node 2 examples/train_grpo.py backend=megatron policy.tp_size=2  # GPU
    python examples/train_grpo.py --help                            # every config field

One step, as the loop reads:

    rollout     draw -> generate and judge -> keep, by the rollout kind rollout.sampling_mode
                names (ROLLOUTS below). Each is one function of one signature:

                    def my_rollout(step: int, ctx: RolloutContext, stats: StepStats
                                   ) -> tuple[core.Batch, dict[str, float]]

                It draws this rank's prompts (core.draw_prompts), generates and judges them, hands
                judged groups to keep() until ctx.sampler is done, and returns sampler.take():
                the step's batch of whole groups with reward variance and its sampling stats
                (dynamic_sampling/*). It adds its counts and phase times to `stats`. A new kind
                (multi-turn environments) is one such function, one entry in ROLLOUTS and its
                own config section; the loop does not change.
                  rounds  DAPO dynamic sampling in rounds (core.DynamicSampler): each round
                          draws, generates and judges (placement=partial: each response judged
                          as soon as it finishes), keeps; rounds refill until every rank is full
                  stream  (placement=partial) genrm.JudgedStream: prompts keep entering the
                          engine, each judged group is kept as it arrives, and once every rank
                          is full the long tail is aborted (counted; with rollout.keep_partial
                          finished first next step)
                  multiturn  (rollout.environment or rollout.tools set) each row a
                          multi-turn trajectory (yatt.rollout.MultiTurnRollout: tools in worker
                          processes, the engine's KV kept between turns), its loss only on the
                          sampled tokens; reward = reward.* over the trajectory + the
                          environment's get_reward(); in rounds (each trajectory judged as it
                          ends under placement=partial) or, with sampling_mode=stream,
                          genrm.TrajectoryStream (the tail cut once every rank is full)
                  offpolicy  (rollout.max_staleness >= 1) worker threads generate and judge
                          the next prompts while the trainer trains (core.AsyncRollout), at
                          most max_staleness versions ahead; the step keeps groups as they
                          finish; the update weighs each token by pi_prox / pi_behaviour. With
                          rollout.environment or tools each row's group is its multi-turn
                          trajectories, each turn's tokens stamped with the version it ran under
    keep        whole groups whose task reward varies (DAPO eq. 11), then DAPO's overlong
                penalty added to the reward (keep())
    train       advantages per group -> balance across ranks -> old logprobs once (the
                trainer's forward, or the engine's with loss.old_logprobs_from=engine) -> for
                each epoch, for each mini-batch of whole groups (reshuffled each epoch): one
                optimizer step (loss.*)
    sync        the policy's weights into the rollout engine; metrics; checkpoint when due
    eval        every eval.every_steps: held-out prompts through the same reward (eval/*)

At the end the last step is always checkpointed and the policy written as a Hugging Face
folder (out_dir/export) that transformers and vLLM load as it is. One run per out_dir (a lock
rank 0 holds); SIGTERM, SIGHUP or Ctrl-C saves the step in progress and exits with 128 + the
signal. A checkpoint keeps, beside the tensors, the loader's position, the sampler's keep rate,
the held cut groups (named objects the Checkpointer saves and restores) and the resolved config;
a resume that changes loss.objective, the policy or the data warns and says so in its metrics.

The config (grpo_config.py) is built and checked whole before anything starts, then what it
points at (grpo_preflight.py: folders, reward code, keys, checkpoints, the embedded task built
when empty paths ask for it) before any model loads. Unusable data
rows are skipped and counted (data/skipped_rows/<cause>); failed judge verdicts are counted
(genrm/errors, genrm/unparsable) with the first cause logged, and a step whose every verdict
failed stops the run. Fork it and edit the loop; there are no hook flags.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoTokenizer

from yatt import core, genrm, rollout
from yatt.ckpt import (
    Checkpointer,
    ClosingStack,
    RunLock,
    acquire_run_lock,
    exit_code_for_signal,
)
from yatt.placement import PendingLoad, Plan

sys.path.insert(0, str(Path(__file__).parent))
from grpo_config import DataConfig, TrainConfig, config_from_args, parse_args, policy_field
from grpo_data import Scored, judge_sample
from grpo_metrics import (
    StepStats,
    VerdictWarnings,
    check_verdicts,
    eval_metrics,
    response_length_metrics,
    summarize,
)
from grpo_preflight import preflight
from grpo_prompts import Prompt, PromptEncoder
from grpo_setup import (
    export_checkpoint,
    export_dir,
    export_policy,
    judges_while_generating,
    load_eval_rows,
    make_engine,
    make_judge_engine,
    make_plan,
    make_scorer,
    required_row_fields,
    row_limits,
    save_config,
)

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


# -- off-policy steps (rollout.max_staleness >= 1) ------------------------------------------------
# How long the trainer waits for one finished group before it looks at the stop flag again.
TAKE_POLL_S = 0.5


def check_offpolicy(cfg: TrainConfig) -> None:
    """rollout.max_staleness against the rest of the config, before any model loads: a
    ValueError naming the fields (core.check_staleness's rules)."""
    core.check_staleness(
        max_staleness=cfg.rollout.max_staleness,
        rollout_correction=cfg.loss.rollout_correction,
        old_logprobs_from=cfg.loss.old_logprobs_from,
        placement=cfg.placement,
        policy_backend=cfg.backend,
        should_keep_partial=cfg.rollout.keep_partial,
        sampling_mode=cfg.rollout.sampling_mode,
        has_judge_engine=cfg.uses_judge_model,
    )


@dataclass
class OffPolicyGroup:
    """One prompt's judged group from a worker thread, and the version of the weights the
    engine held when it started. An engine runs a weight push alone (between generate calls)
    and the version moves only after the push, so the call ran under this version or a newer
    one pushed just before it started: its age can read one too high, never too low. A
    multi-turn group's turns may run under later versions: token_versions has each response's
    versions per token (each turn's read as its engine call started), turn_stats its counts."""

    scored: list[Scored]
    version: int
    token_versions: list[list[int]] | None = None  # None: every token at `version`
    turn_stats: rollout.MultiTurnStats | None = None  # multi-turn groups only


def offpolicy_generate(ctx: RolloutContext) -> Callable[[dict, Callable[[], int]], OffPolicyGroup]:
    """What a worker thread runs per row (core.AsyncRollout's generate): the row encoded,
    samples_per_prompt responses (multi-turn trajectories with rollout.environment or tools:
    offpolicy_trajectories), each judged; outside any placement phase (the engines stay
    resident, or the trainer pauses the workers while its phases put them to sleep). Seeded by
    (seed, DP rank, version, row)."""
    cfg = ctx.cfg
    if ctx.multiturn is not None:
        return lambda row, version: offpolicy_trajectories(row, version, ctx)

    def generate(row: dict, version: Callable[[], int]) -> OffPolicyGroup:
        prompts = ctx.encoder.encode([row])  # an unusable row: skipped, counted
        policy_version = version()
        if not prompts:
            return OffPolicyGroup([], policy_version)
        (prompt,) = prompts
        sampling = ctx.sampling(policy_version, int(row[core.ROW_INDEX_KEY]))
        completions = ctx.engine.generate([prompt.request()], sampling)
        samples = [judge_view(prompt, c, ctx.tokenizer, cfg.data) for c in completions]
        verdicts = ctx.scorer.score(samples)
        scored = [
            Scored(completion, sample, verdict, prompt)
            for completion, sample, verdict in zip(completions, samples, verdicts, strict=True)
        ]
        return OffPolicyGroup(scored, policy_version)

    return generate


def offpolicy_trajectories(
    row: dict, version: Callable[[], int], ctx: RolloutContext
) -> OffPolicyGroup:
    """One row's samples_per_prompt multi-turn trajectories in a worker thread, judged as
    rollout_multiturn judges them (reward.* over each trajectory + env_reward_weight x the
    environment's get_reward()), each response token stamped with the version its turn ran
    under (core.VersionRecordingEngine); the group's version (admission's) is the start's,
    the oldest. A row whose reset failed for some trajectory gives no group (its slot freed).

    Several workers run this at once, each in an asyncio loop of its own (asyncio.run). What
    they share is safe so: the built-in engine joins calls from any thread into its loop and
    hands each call's completions to the caller's own loop (its stream's thread); the tool
    runner's UserCodePool is called from any thread, each call on the calling loop's
    executor; the scorer is called from the workers as the single-turn path does; the
    MultiTurnRollout is read-only after it is built (each run() keeps its trajectories and
    counts to itself), so each call takes a shallow copy whose engine is its own version
    recorder (the one piece with per-call state)."""
    cfg = ctx.cfg
    prompts = ctx.encoder.encode([row])  # an unusable row: skipped, counted
    start_version = version()
    if not prompts:
        return OffPolicyGroup([], start_version)
    (prompt,) = prompts
    sampling = ctx.sampling(start_version, int(row[core.ROW_INDEX_KEY]))
    recorder = core.VersionRecordingEngine(ctx.engine, version)
    multiturn = copy.copy(ctx.multiturn)
    multiturn.engine = recorder
    trajectories, turn_stats = asyncio.run(
        multiturn.run([env_row(prompt, cfg, step=None)], sampling)
    )
    if len(trajectories) < sampling.n:  # a reset failed (counted): a GRPO group must be whole
        return OffPolicyGroup([], start_version, turn_stats=turn_stats)
    judged = genrm.score_trajectories(
        trajectories,
        [prompt],
        ctx.scorer,
        answer_key=cfg.data.answer_key,
        env_reward_weight=cfg.rollout.env_reward_weight,
    )
    token_versions = [recorder.token_versions(item.completion.trajectory) for item in judged]
    return OffPolicyGroup(judged, start_version, token_versions, turn_stats)


def rollout_offpolicy(
    step: int, ctx: RolloutContext, stats: StepStats
) -> tuple[core.Batch, dict[str, float]]:
    """rollout.max_staleness >= 1: worker threads (ctx.offpolicy, core.AsyncRollout) generate
    and judge the next prompts while the trainer trains, started as admission control allows
    (none more than max_staleness versions before the step that trains it). The step takes
    judged groups in the order they finish and keeps them (dynamic sampling) until this rank
    is full; a group without reward variance gives its slot back (so it never slows
    generation), a slow one stays in flight and is trained in a later step (never dropped).
    Each token keeps the version that sampled it. A stop signal ends the step (StepStopped).
    Multi-turn groups add the counts of every group the step took (MultiTurnStats: tool calls,
    errors by cause, turns, end causes), summed over ranks, as rollout_multiturn does
    (dynamic_sampling/multiturn/*)."""
    driver, sampler = ctx.offpolicy, ctx.sampler
    num_taken = num_released = 0
    turn_stats = rollout.MultiTurnStats()
    kept: list[core.InFlightPrompt] = []  # put back if a stop signal ends the step
    while not sampler.is_full and num_taken < sampler.max_groups_per_step and not ctx.should_stop():
        wait_start_s = time.perf_counter()
        try:
            (taken,) = driver.take(1, timeout_s=TAKE_POLL_S)
        except TimeoutError:  # nothing finished yet: look at the stop flag, wait again
            if driver.is_stalled:  # the step is not full and nothing can come: a lost slot
                raise RuntimeError(
                    f"step {step}: {sampler.num_kept} of {sampler.target_groups} groups kept, "
                    "no prompt in flight and admission starts none (prompts were lost)"
                ) from None
            continue
        finally:  # the step's only wait for rollout (time/rollout_wait_s): small once ahead
            waited_s = time.perf_counter() - wait_start_s
            stats.timings["rollout_wait"] = stats.timings.get("rollout_wait", 0.0) + waited_s
        num_taken += 1
        group: OffPolicyGroup = taken.result
        if group.turn_stats is not None:
            turn_stats.merge(group.turn_stats)
        num_kept = sampler.num_kept
        keep(
            group.scored,
            ctx,
            stats,
            policy_version=group.version,
            policy_versions=group.token_versions,
        )
        if sampler.num_kept == num_kept:  # no reward variance, or unjudgeable: slot freed
            driver.release(1)
            num_released += 1
        else:
            kept.append(taken)
    turn_metrics = {}
    if ctx.multiturn is not None:  # collective, on every rank before take_batch's
        turn_metrics = core.reduce_turn_metrics(
            turn_stats.as_metrics(prefix="multiturn/"),
            num_turns=sum(turn_stats.turns),
            group=ctx.runtime.dp_group,
        )
    # waits for every rank to be full (or out of budget); StepStopped on a stop signal: the
    # kept groups go back in flight, so the checkpoint saved next holds them (trained later)
    try:
        batch, sampling_stats = take_batch(sampler, should_stop=ctx.should_stop())
    except core.StepStopped:
        driver.put_back(kept)
        driver.finish_step(0)  # its version moves with nothing trained
        raise
    driver.finish_step(len(kept))  # fewer than prompts_per_rank: an unfilled batch
    sampling_stats |= {
        "num_groups_taken": float(num_taken),
        "num_groups_released": float(num_released),
    }
    return batch, sampling_stats | turn_metrics


def offpolicy_metrics(driver: core.AsyncRollout, *, is_resident: bool, group) -> dict[str, float]:
    """The driver's per-step scalars over the ranks (the slowest rank's wait; counts summed)
    and which placement ran: 1 = rollout, judge and trainer resident together, 0 = the
    trainer's phases with the workers paused (collective)."""
    local = driver.metrics()
    ops = {key: "max" if key.endswith("_s") else "sum" for key in local}
    return core.reduce_metrics(local, group=group, ops=ops) | {
        "offpolicy/is_resident": float(is_resident)
    }


def is_offpolicy_resident(device) -> bool:
    """Whether rollout, judge and trainer stay resident together for off-policy steps: always
    on the host; on a GPU when, with every role built and awake, at least
    OFFPOLICY_MIN_FREE_FRACTION of its memory is free (room for the trainer's activations and
    optimizer state). Otherwise the trainer's phases run as today, the workers paused."""
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        return True
    free_bytes, total_bytes = torch.cuda.mem_get_info(torch.device(device))
    return free_bytes >= OFFPOLICY_MIN_FREE_FRACTION * total_bytes


OFFPOLICY_MIN_FREE_FRACTION = 0.25


# The row field a multi-turn environment's reset(**row) reads its seed from: derived from
# (seed, step, row), or (seed, row) off-policy, so a resumed run gives its environments the same
# seeds.
ENV_SEED_KEY = "env_seed"


def env_row(prompt: Prompt, cfg: TrainConfig, *, step: int | None) -> dict:
    """What reset(**row) gets: the prompt's row fields (its prompt as "prompt", or "messages"
    for a message list; with the row's images (data.image_key), "messages" whose first user
    turn starts with one image part per image, as the single-turn prompt shows them) and
    ENV_SEED_KEY from (seed, step, the row's index in the data set). step
    None (off-policy steps): from (seed, the row's index) alone, since neither the step that
    trains a row nor the version it starts under is known again on resume (a re-queued
    prompt restarts under the resumed version); a row's environment then has the same seed
    in every epoch, as it has the same fields, while its sampling seed moves with the
    version."""
    row = prompt.row
    fields = {key: value for key, value in row.items() if key != core.ROW_INDEX_KEY}
    question = row[cfg.data.prompt_key]
    if prompt.images:
        fields["messages"] = messages_with_images(question, prompt.images)
    else:
        fields["messages" if isinstance(question, list) else "prompt"] = question
    index = int(row.get(core.ROW_INDEX_KEY, 0))
    if step is None:
        fields[ENV_SEED_KEY] = derived_seed(cfg.seed, index * 101, 11)
    else:
        fields[ENV_SEED_KEY] = derived_seed(cfg.seed, step * 1_000_033, index * 101, 7)
    return fields


def messages_with_images(question: str | list[dict], images: Sequence[Any]) -> list[dict]:
    """The question as messages whose first user turn starts with one image part per image
    (the picture itself: the multi-turn driver expands its placeholder), then its text."""
    messages = question if isinstance(question, list) else [{"role": "user", "content": question}]
    messages = [dict(message) for message in messages]
    first_user = next((m for m in messages if m["role"] == "user"), messages[0])
    text = first_user["content"]
    parts = text if isinstance(text, list) else [{"type": "text", "text": text}]
    first_user["content"] = [{"type": "image", "image": image} for image in images] + parts
    return messages


def rollout_multiturn(
    step: int, ctx: RolloutContext, stats: StepStats
) -> tuple[core.Batch, dict[str, float]]:
    """rollout.environment or rollout.tools set: each row run as samples_per_prompt multi-turn
    trajectories (ctx.multiturn, yatt.rollout.MultiTurnRollout: tools in worker processes, the
    engine keeping each conversation's KV between turns), reward.* over each trajectory + the
    environment's get_reward(), kept as whole groups with reward variance.
      rounds  as rollout_in_rounds: every trajectory ends inside its round (nothing in flight at
              a checkpoint); the rollout and judge resident together (placement=partial, or a
              judge without an engine): each trajectory judged as soon as it ends while the
              others are in their tool loops; else the judge after the round's rollout
      stream  (placement=partial) genrm.TrajectoryStream: rows keep entering as the sampler
              asks, each trajectory judged as it ends, each whole group kept at once, and once
              every rank is full the trajectories still running are cut (dropped, counted)
    Each row's environment gets row["env_seed"] from (seed, DP rank, step, row), the same on
    a resumed run. Adds the multi-turn counts (MultiTurnStats.as_metrics: tool calls, errors by
    cause, turns, end causes), summed over ranks, to the sampling stats
    (dynamic_sampling/multiturn/*)."""
    cfg = ctx.cfg
    turn_stats = rollout.MultiTurnStats()
    stream_stats: dict[str, float] = {}
    if cfg.rollout.sampling_mode == "stream":
        stream = genrm.TrajectoryStream(
            multiturn=ctx.multiturn,
            scorer=ctx.scorer,
            sampling=ctx.sampling(step, 0),
            to_row=lambda prompt: env_row(prompt, cfg, step=step),
            answer_key=cfg.data.answer_key,
            env_reward_weight=cfg.rollout.env_reward_weight,
            judge_engine=ctx.judge_engine,
            load=PendingLoad(),
        )
        with timed(stats.timings, "rollout+genrm"), ctx.plan.phase("rollout"):
            asyncio.run(
                stream.run(
                    ctx.sampler,  # polls should_abort (every rank full), never blocks
                    draw=ctx.draw,
                    keep=lambda judged: keep(judged, ctx, stats),
                    should_stop=ctx.should_stop,  # between judged groups: the tail cut
                )
            )
        ctx.sampler.record_aborted(stream.num_groups_cut, num_tokens=stream.num_cut_tokens)
        stream_stats = stream.stats()
        if ctx.plan.has_memory_split:  # the next split follows the step's live queues
            ctx.plan.update_load(**stream.pending_tokens())
        turn_stats = stream.turn_stats
    else:

        def judge_round(prompts: list[Prompt], num_round: int) -> list[Scored]:
            sampling = ctx.sampling(step, stats.num_rounds + num_round)
            # a row whose reset failed has fewer than n trajectories: its group is dropped
            judged, round_stats = genrm.judge_trajectories(
                ctx.multiturn,
                [env_row(prompt, cfg, step=step) for prompt in prompts],
                prompts,
                sampling,
                scorer=ctx.scorer,
                plan=ctx.plan,
                timings=stats.timings,
                answer_key=cfg.data.answer_key,
                env_reward_weight=cfg.rollout.env_reward_weight,
                should_stop=ctx.should_stop,
                should_overlap=ctx.should_overlap,  # judged as each ends (partial)
                judge_engine=ctx.judge_engine,
            )
            turn_stats.merge(round_stats)
            return judged

        stats.num_rounds += genrm.judge_in_rounds(
            ctx.sampler,
            draw=ctx.draw,
            judge_round=judge_round,
            keep=lambda judged: keep(judged, ctx, stats),
            should_stop=ctx.should_stop,
        )
    # summed over ranks, turns_mean from the summed turns (the mean summarize then takes of
    # these equal values is the sum)
    total = core.reduce_turn_metrics(
        turn_stats.as_metrics(prefix="multiturn/"),
        num_turns=sum(turn_stats.turns),
        group=ctx.runtime.dp_group,
    )
    # waits for every rank; core.StepStopped on every rank if a stop signal ended one
    batch, sampling_stats = take_batch(ctx.sampler, should_stop=ctx.should_stop())
    if stream_stats:
        stats.num_rounds = int(sampling_stats["num_rounds"])
    return batch, sampling_stats | total | stream_stats


ROLLOUTS: dict[str, Callable[[int, RolloutContext, StepStats], tuple[core.Batch, dict]]] = {
    "rounds": rollout_in_rounds,
    "stream": rollout_streamed,
    "multiturn": rollout_multiturn,  # rollout.environment or rollout.tools set
    "offpolicy": rollout_offpolicy,  # rollout.max_staleness >= 1
}


def make_multiturn(cfg: TrainConfig, engine, tokenizer, resources: ClosingStack):
    """The run's MultiTurnRollout: tools in worker processes (a killable pool, closed at the
    end), the chat template of the policy's tokenizer. A vision-language policy: the policy's
    image processor and vision tokens, so a tool may return pictures whatever the engine (the
    built-in one has them itself; vLLM and SGLang do not hand theirs out)."""
    runner = rollout.env.PoolToolRunner.from_timeout(cfg.rollout.tool_timeout_s)
    resources.close_later(runner.pool)
    model_dir = policy_field(cfg.policy, "model_dir")
    vision = core.VisionModel.from_pretrained(model_dir)
    images: dict[str, Any] = {}
    if vision.image_token_id is not None and vision.has_image_processor:
        images = {
            "image_processor": core.load_image_processor(model_dir),
            "image_token_id": vision.image_token_id,
            "vision_token_ids": vision.stop_token_ids,
        }
    return rollout.MultiTurnRollout(
        engine,
        cfg.rollout.env_config(dict(cfg.data.chat_template_kwargs)),
        tokenizer=tokenizer,
        runner=runner,
        **images,
    )


# -- train: advantages, balance, updates -------------------------------------------------------
def filter_truncated(batch: core.Batch, cfg: TrainConfig, group) -> dict[str, float]:
    """Over all ranks (collective): the trained responses cut at max_new_tokens, their tokens
    out of the loss with overlong.should_filter_truncated; their length quantiles (before)."""
    truncation = core.compute_truncation_metrics(batch, group=group)
    truncation |= response_length_metrics(batch, group)
    if cfg.overlong.should_filter_truncated:
        num_masked = core.mask_truncated_responses(batch)
        truncation |= core.reduce_metrics(
            {"response/num_truncated_masked": num_masked}, group=group, default_op="sum"
        )
    return truncation


def balance(
    batch: core.Batch, policy, loss: core.PolicyLoss, group
) -> tuple[core.Batch, list[float]]:
    """Whole groups moved across ranks by the policy's cost model, its images included (the
    weights its micro-batch packing uses): lengths cross ranks, moves go p2p. Returns the
    rebalanced batch and its costs for the mini-batch split."""
    costs = policy.estimate_batch_costs(batch)
    batch, _ = batch.rebalance(group=group, group_key="group_id", costs=costs)
    if loss.num_mini_batches > 1:  # the rebalanced batch's own costs
        costs = policy.estimate_batch_costs(batch)
    return batch, costs


def step_weights(policy, *, is_lora: bool):
    """What a step's sync sends: the LoRA adapter (its A, B and scaling per target; the
    built-in engine merges it into its own copy of the base) or the full weights."""
    return policy.named_adapter_weights() if is_lora else policy.named_weights()


def mini_batch_seed(seed: int, step: int, epoch: int, loss: core.PolicyLoss) -> int | None:
    """The seed of an epoch's split into mini-batches: None (the best-balanced split, the
    same each time) for a single epoch or loss.should_reshuffle_epochs=False; else one per
    (seed, step, epoch), so each pass over a batch groups its GRPO groups differently."""
    if loss.num_epochs == 1 or not loss.should_reshuffle_epochs:
        return None
    return derived_seed(seed, step * 1_009, epoch)


def train_on_batch(
    batch: core.Batch,
    *,
    policy,
    reference,
    loss: core.PolicyLoss,
    costs: Sequence[float] | None,
    device,
    seed: int,
    step: int,
    max_staleness: int = 0,
    group=None,
) -> dict[str, float]:
    """The step's updates on this rank's balanced batch, inside the train phase; the merged
    train metrics. costs: the policy's per-sample estimate for the mini-batch split (None:
    estimated here when there is more than one mini-batch). max_staleness >= 1 (off-policy
    steps, the policy at version `step`): pi_prox is the trainer's logprobs before the update
    (AReaL's decoupled PPO: the clip on pi / pi_prox, the rollout correction's weight
    pi_prox / pi_behaviour), and the offpolicy/* metrics by age join the result (collective
    over `group`)."""
    batch = batch.to(device)
    # pi_old, once, before the first update: the engine's own logprobs (no forward), or the
    # trainer's forward (is_on_policy: one update, and the loss reuses its own forward's
    # logprobs, detached)
    if loss.old_logprobs_from == "engine":
        batch.tokens["old_logprobs"] = core.engine_old_logprobs(batch)
    elif not loss.is_on_policy or max_staleness:
        # off-policy with is_on_policy: the loss still takes its own forward's (the same
        # weights); this forward gives the metrics the weight the loss applies
        batch.tokens["old_logprobs"] = policy.logprobs(batch)
    offpolicy = {}
    if max_staleness:  # tokens and importance weights by age
        offpolicy = core.compute_staleness_metrics(
            batch,
            current_version=step,
            max_staleness=max_staleness,
            rollout_correction=loss.rollout_correction,
            rollout_correction_cap=loss.rollout_correction_cap,
            group=group,
        )
    if reference is not None:
        batch.tokens["ref_logprobs"] = reference.logprobs(batch)
    elif loss.kl_coef > 0:  # LoRA: the base model is the reference (the adapter disabled)
        batch.tokens["ref_logprobs"] = policy.reference_logprobs(batch)
    if costs is None and loss.num_mini_batches > 1:
        costs = policy.estimate_batch_costs(batch)
    # num_epochs passes, each num_mini_batches optimizer steps of whole groups (every rank the
    # same count: the steps' collectives pair up); with several epochs each pass reshuffles the
    # groups (seeded by seed, step and epoch, the same rule on every rank, so a resumed run
    # splits alike)
    steps = []
    for epoch in range(loss.num_epochs):
        mini_batches = core.split_mini_batches(
            batch,
            loss.num_mini_batches,
            costs=costs,
            seed=mini_batch_seed(seed, step, epoch, loss),
        )
        for mini_batch in mini_batches:
            steps.append(policy.train_step(mini_batch, loss))
    return core.merge_step_metrics(steps) | offpolicy


def evaluate(
    prompts: list[Prompt],
    *,
    step: int,
    cfg: TrainConfig,
    ctx: RolloutContext,
) -> dict[str, float]:
    """The held-out prompts through the rollout engine and the same reward: eval/* metrics over
    all ranks (collective; a rank without rows still joins). Same seeds every time, so a change
    between evaluations is the policy's."""
    stats = StepStats()
    if prompts:
        sampling = rollout.SamplingParams(
            n=cfg.eval.samples_per_prompt,
            temperature=cfg.eval.temperature,
            # greedy (temperature 0) takes the top token: the knobs would change nothing
            **(cfg.rollout.sampling_knobs() if cfg.eval.temperature > 0 else {}),
            max_new_tokens=cfg.rollout.max_new_tokens,
            seed=derived_seed(cfg.seed, ctx.runtime.dp_rank * 10_007, 7),
            stop_token_ids=ctx.encoder.cut_token_ids,
        )
        try:
            with timed(stats.timings, "eval"):
                scored = ctx.generate_and_score(prompts, sampling, {})
            stats.add(drop_unjudgeable(scored, ctx), ctx.accuracy)
        except genrm.ScoringStopped:  # a stop signal while the judge waited: the step is saved
            # next; this rank joins the reduction below as a rank without eval rows does
            logger.warning("a stop signal ended step %d's evaluation on this rank", step)
    return eval_metrics(stats, ctx.runtime.dp_group, has_accuracy=ctx.accuracy is not None)


# -- what a checkpoint keeps beside the tensors ---------------------------------------------------
# The loader, the sampler, the held cut groups and the resolved config (core.track_run_state);
# settings that change what a run means: a resume that changes one warns and logs it.
RESUME_CHECKED_FIELDS = ("loss.objective", "policy.model_dir", "data.path")


# -- the run --------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """Train (or --export); the process's exit code: 0, or 128 + signum when a stop signal
    (SIGTERM, SIGINT, SIGUSR1) ended the run after its final save."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    transformers.utils.logging.disable_progress_bar()  # one bar: the run's
    args = parse_args(argv)
    # A config or preflight error is one line naming the field and the fix, exit code 2
    # (--traceback shows where it was raised).
    with core.exit_on_config_error(should_show_traceback=args.traceback):
        cfg = config_from_args(args)  # the values, typed and checked
        if args.export:  # the policy's folder checked (built, for the embedded task), then export
            export_checkpoint(preflight(cfg, should_check_data=False), args.step)
            return 0
    # One run per out_dir: global rank 0 (RANK, set by torchrun) holds the lock until the
    # process exits; a second run fails here, naming this one, before anything loads.
    run_lock: RunLock | None = None
    if int(os.environ.get("RANK", "0")) == 0:
        run_lock = acquire_run_lock(cfg.out_dir, purpose="train")
    # torch's CPU threads sized now (the CPUs idle at start, shared by the node's ranks), not
    # at init_runtime: building the embedded task fits its models on the CPU, and with torch's
    # default of every core, two such builds beside a test job on a 16-core GPU host ran ~40x
    # slower than alone (session 20)
    core.size_torch_threads()
    try:
        # What the values point at, before any model loads: paths filled (the embedded task
        # built when asked for), reward code and keys, checkpoints against --resume, the data
        # against the judge's context.
        with core.exit_on_config_error(should_show_traceback=args.traceback):
            cfg = preflight(cfg, should_resume=args.resume)
        if run_lock is not None:  # rank 0: what ran, and what --resume / --export read
            save_config(cfg)
    except BaseException:
        if run_lock is not None:
            run_lock.release()
        raise
    # A megatron policy's model-parallel replica (tp x pp x cp) shares one rollout batch.
    tp_size = cfg.model_parallel_size
    runtime = core.init_runtime(seed=cfg.seed, tp_size=tp_size)
    try:
        # The run's objects (policy, engines) live in train()'s frame and are gone when it
        # returns, so shutdown() stops the process groups' threads now; a live policy would
        # hold a group, and its threads would run into interpreter exit.
        return train(cfg, runtime, should_resume=args.resume)
    finally:
        runtime.shutdown()
        if run_lock is not None:
            run_lock.release()


def train(cfg: TrainConfig, runtime: core.Runtime, *, should_resume: bool) -> int:
    """The run on this rank, from the checked config; the exit code: 0, or 128 + signum when
    a stop signal ended it after its final save. Everything it opens is closed on return
    (last opened first; a close error is logged and never hides the run's own)."""
    stop_signal: int | None = None
    with core.exit_on_config_error():  # rollout.max_staleness against the rest: exit code 2
        check_offpolicy(cfg)
    is_offpolicy = cfg.rollout.max_staleness >= 1
    with ClosingStack() as resources:
        ckpt = resources.close_later(
            Checkpointer.from_config(Path(cfg.out_dir) / "checkpoints", cfg.ckpt)
        )

        # -- data, checked before any model loads (tokenizers only) ------------------------------
        cfg.rollout.check_environment()  # environments/tools import, their tools usable
        tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_dir)
        # Rows -> prompts (images through the policy's image processor); checks the policy.
        # The loader's length check tokenizes through it, so each prompt is tokenized once.
        encoder = PromptEncoder(cfg, tokenizer)
        loader = core.ShardedLoader(
            cfg.data.path,
            batch_size=cfg.data.prompts_per_rank,
            rank=runtime.dp_rank,
            world_size=runtime.dp_size,
            prompt_key=cfg.data.prompt_key,
            seed=cfg.seed,
            max_prompt_tokens=cfg.rollout.max_prompt_tokens,
            count_tokens=encoder.count_tokens,
            required_keys=required_row_fields(cfg),
            **row_limits(cfg),  # sizes checked before reading; data.image_key: images opened here
        )
        encoder.check(loader.first_rows(), source=f"data.path={cfg.data.path!r}")
        eval_prompts = encoder.encode(
            load_eval_rows(cfg, runtime, encoder.count_tokens), should_count=False
        )

        # -- models: policy, KL reference, rollout engine, judge, placement ----------------------
        device = str(runtime.device)
        logger.info(
            "loading the policy, its rollout engine and the reward (%s)", cfg.reward.backend
        )
        policy = core.build_policy(cfg.backend, cfg.policy, runtime)
        # A frozen copy of the starting policy, only when the loss reads it (kl_coef > 0);
        # with LoRA none: the base model under the adapter is the reference.
        is_lora = getattr(cfg.policy, "lora", None) is not None
        reference = None
        if cfg.loss.kl_coef > 0 and not is_lora:
            reference_config = replace(cfg.policy, is_reference=True)
            reference = core.build_policy(cfg.backend, reference_config, runtime)
        engine = resources.close_later(
            make_engine(cfg.rollout, cfg.policy.model_dir, device, policy_tp_size=runtime.tp_size)
        )
        if encoder.takes_images and not engine.accepts_images:
            raise ValueError(f"rollout.backend={cfg.rollout.backend!r} serves no images here")
        judge_engine = None
        if cfg.uses_judge_model:
            # its own engine, or the policy's with the adapter off (reward.judge_dir=policy)
            judge_engine = resources.close_later(make_judge_engine(cfg.reward, engine, device))
        owned: list[Any] = []  # what the scorer runs (reward workers, a client): closed too
        scorer, exact_match = make_scorer(cfg.reward, judge_engine, owned)
        for closeable in owned:
            resources.close_later(closeable)
        roles = {"rollout": engine, "genrm": judge_engine, "train": policy, "reference": reference}
        # Off-policy steps: every role resident (no phase puts an engine to sleep under the
        # worker threads) when they fit together; else today's phases, the workers paused.
        is_resident = is_offpolicy and is_offpolicy_resident(device)
        if is_resident:
            plan = Plan.separate(**roles)
        else:
            plan = make_plan(cfg.placement, **roles, offload=cfg.offload)
        # SIGTERM/SIGINT/SIGUSR1/SIGHUP: a final save at the next step boundary, then a
        # non-zero exit (a second Ctrl-C stops at once, unsaved).
        ckpt.install_signal_handlers()

        # -- the rollout kind, its sampler and the state a checkpoint keeps ----------------------
        # DAPO dynamic sampling: one sampler for the run, its keep rate carried over.
        # off-policy: groups kept as they finish, as a stream's are
        is_stream = cfg.rollout.sampling_mode == "stream" or is_offpolicy
        sampler = core.DynamicSampler(
            target_groups=cfg.data.prompts_per_rank,
            oversample=cfg.rollout.oversample,
            max_oversample=cfg.rollout.max_oversample,
            fill_probability=cfg.rollout.fill_probability,
            max_rounds=cfg.rollout.max_sampling_rounds,
            tolerance=cfg.loss.zero_variance_tolerance,
            on_unfilled=cfg.rollout.on_unfilled,
            mode="stream" if is_stream else cfg.rollout.sampling_mode,
            # a stream draws as it goes: a target larger than this rank's rows is refused now
            num_prompts=loader.num_local_rows if is_stream else None,
            reward_key=TASK_REWARD,  # the keep rule's signal: before the overlong penalty
            group=runtime.dp_group,
        )
        # rollout.keep_partial: the groups a stream's abort cut, finished first next step; a
        # checkpoint keeps each one's prompt as its row (read again on resume)
        partials = None
        if cfg.rollout.keep_partial:
            partials = core.held_cut_groups(cfg.loss.rollout_correction, encoder, loader)
        core.track_run_state(
            ckpt,
            loader=loader,
            sampler=sampler,
            partials=partials,
            config=dataclasses.asdict(cfg),
            watched=RESUME_CHECKED_FIELDS,
        )
        ctx = RolloutContext(
            cfg=cfg,
            runtime=runtime,
            loader=loader,
            encoder=encoder,
            tokenizer=tokenizer,
            engine=engine,
            judge_engine=judge_engine,
            scorer=scorer,
            # reward/accuracy from the signal reward.accuracy declares (none: no metric)
            accuracy=genrm.AccuracySignal.from_spec(cfg.reward, exact_match),
            plan=plan,
            sampler=sampler,
            partials=partials,
            # Stream responses to the judge while the rollout runs when both stay resident (a
            # judge without an engine of its own is always there).
            should_overlap=judges_while_generating(plan, judge_engine),
            should_stop=lambda: ckpt.stop_signal is not None,
        )
        if cfg.rollout.is_multiturn:  # environments/tools: the multi-turn rollout kind
            ctx.multiturn = make_multiturn(cfg, engine, tokenizer, resources)
        if is_offpolicy:  # worker threads, started after a resume restored their prompts
            ctx.offpolicy = resources.close_later(
                core.AsyncRollout(
                    loader=loader,
                    generate=offpolicy_generate(ctx),
                    admission=core.AdmissionControl(
                        max_staleness=cfg.rollout.max_staleness,
                        prompts_per_step=cfg.data.prompts_per_rank,
                    ),
                    # every admissible prompt generating at once: the engine joins the calls
                    num_workers=cfg.data.prompts_per_rank * (cfg.rollout.max_staleness + 1),
                    # judged groups are objects: a resume generates the finished ones again
                    should_save_results=False,
                    abort=engine.abort,  # close(): the tails end
                )
            )
            # the in-flight prompts and the loader's position as one cut (restored after the
            # loader's own entry, so this cut wins)
            ckpt.track("offpolicy", ctx.offpolicy)
        rollout_step = ROLLOUTS[
            "offpolicy"  # its worker threads run multi-turn trajectories too
            if is_offpolicy
            else "multiturn"
            if cfg.rollout.is_multiturn
            else cfg.rollout.sampling_mode
        ]
        start_step = 0
        resumed: core.Resumed | None = None  # its counts go into the first step's metrics
        if should_resume:  # the tensors, the loader, the keep rate, the cut groups
            resumed = core.resume_run(ckpt, policy.state(), partials=partials)
            start_step = resumed.start_step
            # the engine starts from the saved policy; under LoRA only the adapter (the
            # merged weights as a base would apply the adapter twice)
            engine.update_weights(step_weights(policy, is_lora=is_lora))
        if ctx.offpolicy is not None:  # version = steps pushed; re-queued prompts start first
            ctx.offpolicy.set_version(start_step)
            ctx.offpolicy.start()
        run_log = resources.close_later(
            core.RunLog(
                cfg.out_dir,
                is_writer=runtime.is_rank_zero,
                resume_step=start_step,
                wandb_project=cfg.log.wandb_project or None,
                wandb_config=dataclasses.asdict(cfg) if cfg.log.wandb_project else None,
            )
        )

        # -- the GRPO loop ----------------------------------------------------------------------
        last_save_s = 0.0  # a save's time is logged with the next step (it ends after the log)
        last_step = cfg.num_steps - 1
        is_stopped = False  # by a signal, after its final save
        is_eval_on = bool(cfg.eval.every_steps and cfg.eval.path)  # every rank, rows or not
        verdict_warnings = VerdictWarnings(
            every_steps=cfg.log.warn_every_steps, accuracy=cfg.reward.accuracy
        )
        idle_guard = core.LearningGuard(max_idle_steps=cfg.max_idle_steps)  # cannot learn: stop
        bar = tqdm(range(start_step, cfg.num_steps), disable=not runtime.is_rank_zero, desc="grpo")
        with logging_redirect_tqdm():  # log lines print above the bar, never through it
            for step in bar:
                stats = StepStats(timings={"ckpt": last_save_s})
                # draw -> generate and judge -> keep, until every rank has its groups
                try:
                    batch, sampling_stats = rollout_step(step, ctx, stats)
                except core.StepStopped as stopped:  # a step that could not end: no update
                    sampled = summarize(
                        stats, stopped.sampling_stats, ctx.skipped_by_cause(), runtime.dp_group
                    )
                    run_log.log(step, sampled)  # a committed step k has its line k
                    stop_signal = core.save_stopped(ckpt, step, policy.state())
                    is_stopped = True
                    break
                truncation = filter_truncated(batch, cfg, runtime.dp_group)
                # local: a whole group lives on this rank
                batch.samples["advantages"] = cfg.loss.compute_advantages(
                    batch.samples["reward"], batch.samples["group_id"]
                )
                with timed(stats.timings, "balance"):
                    batch, costs = balance(batch, policy, cfg.loss, runtime.dp_group)
                # off-policy in phases: the workers paused while the engines sleep (resident:
                # they keep generating, overlapping this step's update)
                paused = (
                    ctx.offpolicy.paused()
                    if is_offpolicy and not is_resident
                    else contextlib.nullcontext()
                )
                with paused:
                    with timed(stats.timings, "train"), plan.phase("train"):
                        train_metrics = train_on_batch(
                            batch,
                            policy=policy,
                            reference=reference,
                            loss=cfg.loss,
                            costs=costs,
                            device=runtime.device,
                            seed=cfg.seed,
                            step=step,
                            max_staleness=cfg.rollout.max_staleness,
                            group=runtime.dp_group,
                        )
                    with timed(stats.timings, "sync"), plan.phase("sync"):  # bucketed, no copy
                        # LoRA: the adapter alone (the engine adds scaling B A to its base)
                        engine.update_weights(step_weights(policy, is_lora=is_lora))
                    if is_offpolicy and not is_resident:
                        plan.switch_to("rollout")  # the engines awake for the workers again
                if ctx.offpolicy is not None:  # new prompts start under the pushed weights
                    ctx.offpolicy.set_version(step + 1)

                # -- log and save ---------------------------------------------------------------
                metrics = summarize(
                    stats,
                    sampling_stats,
                    ctx.skipped_by_cause(),
                    runtime.dp_group,
                    has_images=encoder.takes_images,
                    has_accuracy=ctx.accuracy is not None,
                )
                metrics |= truncation
                if resumed is not None:  # every rank resumed: the first step after it
                    metrics |= resumed.metrics(runtime.dp_group)
                    resumed = None
                metrics |= {
                    key if key.startswith("offpolicy/") else f"train/{key}": value
                    for key, value in train_metrics.items()
                }
                if ctx.offpolicy is not None:
                    metrics |= offpolicy_metrics(
                        ctx.offpolicy, is_resident=is_resident, group=runtime.dp_group
                    )
                # Same on every rank. Every sample right: solved, not stuck (the declared
                # accuracy; without one a run is never called solved).
                is_solved = metrics.get("reward/accuracy", 0.0) >= 1.0
                idle_guard.update(step, train_metrics, sampling_stats, is_solved=is_solved)
                metrics |= idle_guard.metrics()
                if is_eval_on and ((step + 1) % cfg.eval.every_steps == 0 or step == last_step):
                    metrics |= evaluate(eval_prompts, step=step, cfg=cfg, ctx=ctx)
                metrics |= plan.metrics()
                run_log.log(step, metrics)
                run_log.log_samples(step, stats.samples)  # a few responses, with their rewards
                check_verdicts(step, metrics, stats.first_failure, verdict_warnings)
                idle_guard.check(step)  # after the log: the stuck steps' metrics are kept
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
                # Saved after the step's metrics line, so a committed step k implies lines 0..k.
                # The tracked loader, sampler, cut groups and config go with it.
                save_start = time.perf_counter()  # async: returns once tensors are staged
                extra = {"step": step}
                decision = ckpt.maybe_save(step, policy.state(), phase="train", extra=extra)
                if not decision.is_saved and step == last_step:  # the final step, always
                    ckpt.save(step, policy.state(), extra=extra)
                last_save_s = time.perf_counter() - save_start
                if decision.should_stop:
                    stop_signal = decision.stop_signal
                    logger.warning(
                        "stopped by signal %s: step %d saved (--resume continues), exiting "
                        "with code %d",
                        stop_signal,
                        step,
                        decision.exit_code,
                    )
                    is_stopped = True
                    break
        ckpt.wait()
        if cfg.export.dir and start_step <= last_step and not is_stopped:
            out = export_policy(policy, export_dir(cfg), cfg.export.dtype or None)
            logger.info("the final policy, as a Hugging Face folder: %s", out)
        if runtime.is_rank_zero and (records := run_log.read()):
            first, last = records[0], records[-1]
            # reward/accuracy only where the run declared its signal (reward.accuracy)
            keys = [key for key in ("reward/mean", "reward/accuracy") if key in last]
            change = {key: f"{first[key]:.3f} -> {last[key]:.3f}" for key in keys}
            plot = run_log.plot([*keys, "response/length_mean"])
            logger.info("steps %d..%d: %s; plot %s", first["step"], last["step"], change, plot)
    return 0 if stop_signal is None else exit_code_for_signal(stop_signal)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
