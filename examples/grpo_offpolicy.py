"""The reference trainer's off-policy rollout kind (rollout.max_staleness >= 1).

    check_offpolicy(cfg)                  the staleness rules, before any model loads
    is_resident = is_offpolicy_resident(device)  every role resident, or the trainer's phases
    core.AsyncRollout(generate=offpolicy_generate(ctx), ...)   worker threads: row -> group
    batch, sampling_stats = rollout_offpolicy(step, ctx, stats)   ROLLOUTS["offpolicy"]
    metrics |= offpolicy_metrics(ctx.offpolicy, is_resident=is_resident, group=group)

Worker threads generate and judge the next prompts while the trainer trains, at most
max_staleness versions ahead; the step keeps groups as they finish (grpo_rollout.keep), each
token stamped with the version that sampled it. With rollout.environment or tools a row's group
is its multi-turn trajectories (offpolicy_trajectories, its rows from grpo_multiturn.env_row).
train_grpo.train() builds the driver and calls these; the update's weighting (pi_prox /
pi_behaviour) is train_grpo.train_on_batch's.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from grpo_config import TrainConfig
from grpo_data import Scored
from grpo_metrics import StepStats
from grpo_multiturn import env_row
from grpo_rollout import RolloutContext, judge_view, keep, take_batch

from yatt import core, genrm, rollout

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
