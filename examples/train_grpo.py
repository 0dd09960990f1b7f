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
                names (ROLLOUTS below). The kinds live beside this file: grpo_rollout.py
                (rounds, stream, and what every kind shares: RolloutContext, keep(),
                to_batch()), grpo_multiturn.py and grpo_offpolicy.py. Each is one function
                of one signature:

                    def my_rollout(step: int, ctx: RolloutContext, stats: StepStats
                                   ) -> tuple[core.Batch, dict[str, float]]

                It draws this rank's prompts (core.draw_prompts), generates and judges them, hands
                judged groups to keep() until ctx.sampler is done, and returns sampler.take():
                the step's batch of whole groups with reward variance and its sampling stats
                (dynamic_sampling/*). It adds its counts and phase times to `stats`. A new kind
                (multi-turn environments: grpo_multiturn.py) is one such function, one entry in
                ROLLOUTS and its own config section; the loop does not change.
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
                penalty added to the reward (grpo_rollout.keep)
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

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import transformers
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoTokenizer

from yatt import core, genrm, rollout
from yatt.ckpt import (
    Checkpointer,
    CheckpointSpaceError,
    ClosingStack,
    RunLock,
    acquire_run_lock,
    exit_code_for_signal,
)
from yatt.placement import Plan

sys.path.insert(0, str(Path(__file__).parent))
from grpo_config import TrainConfig, config_from_args, parse_args
from grpo_data import Scored  # noqa: F401  (train_grpo.Scored for tests and forks)
from grpo_metrics import (
    StepStats,
    VerdictWarnings,
    check_verdicts,
    eval_metrics,
    response_length_metrics,
    summarize,
)

# The rollout kinds and what they share live in grpo_rollout.py, grpo_offpolicy.py and
# grpo_multiturn.py. Every name they held here is imported back, also those the loop does not
# use (noqa), so `train_grpo.keep` and the like keep working for the tests, bench/ and forks.
from grpo_multiturn import (  # noqa: F401
    ENV_SEED_KEY,
    env_row,
    make_multiturn,
    messages_with_images,
    rollout_multiturn,
)
from grpo_offpolicy import (  # noqa: F401
    OFFPOLICY_MIN_FREE_FRACTION,
    TAKE_POLL_S,
    OffPolicyGroup,
    check_offpolicy,
    is_offpolicy_resident,
    offpolicy_generate,
    offpolicy_metrics,
    offpolicy_trajectories,
    rollout_offpolicy,
)
from grpo_preflight import preflight
from grpo_prompts import Prompt, PromptEncoder
from grpo_rollout import (  # noqa: F401
    TASK_REWARD,
    UNJUDGEABLE,
    RolloutContext,
    derived_seed,
    drop_unjudgeable,
    generate_and_score,
    judge_view,
    keep,
    rollout_in_rounds,
    rollout_streamed,
    take_batch,
    timed,
    to_batch,
    unjudgeable_groups,
    vision_inputs_of,
)
from grpo_setup import (
    WeightSync,
    engine_device,
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


# -- rollout kinds: (step, ctx, stats) -> (batch, sampling_stats), chosen by rollout.sampling_mode
ROLLOUTS: dict[str, Callable[[int, RolloutContext, StepStats], tuple[core.Batch, dict]]] = {
    "rounds": rollout_in_rounds,
    "stream": rollout_streamed,
    "multiturn": rollout_multiturn,  # rollout.environment or rollout.tools set
    "offpolicy": rollout_offpolicy,  # rollout.max_staleness >= 1
}


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
        # The engines' device: the trainer's, or under placement=separate a GPU of their own
        # (too few GPUs: a ValueError before any model loads).
        engines_device = engine_device(cfg.placement, runtime.device)
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
            make_engine(
                cfg.rollout, cfg.policy.model_dir, engines_device, policy_tp_size=runtime.tp_size
            )
        )
        if encoder.takes_images and not engine.accepts_images:
            raise ValueError(f"rollout.backend={cfg.rollout.backend!r} serves no images here")
        judge_engine = None
        if cfg.uses_judge_model:
            # its own engine, or the policy's with the adapter off (reward.judge_dir=policy)
            judge_engine = resources.close_later(
                make_judge_engine(cfg.reward, engine, engines_device)
            )
        # each step's sync: full weights, the adapter, or the adapter bound (beside mode)
        sync_weights = WeightSync(
            engine,
            policy,
            is_lora=is_lora,
            engine_device=engines_device,
            trainer_device=runtime.device,
        )
        owned: list[Any] = []  # what the scorer runs (reward workers, a client): closed too
        scorer, exact_match = make_scorer(cfg.reward, judge_engine, owned)
        for closeable in owned:
            resources.close_later(closeable)
        roles = {"rollout": engine, "genrm": judge_engine, "train": policy, "reference": reference}
        # Off-policy steps: every role resident (no phase puts an engine to sleep under the
        # worker threads) when they fit together; else today's phases, the workers paused.
        is_separate = cfg.placement == "separate"  # nothing shares the trainer's GPU
        is_resident = is_offpolicy and (is_separate or is_offpolicy_resident(device))
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
            sync_weights()
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
                        sync_weights()
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
                # 1: placement=separate, the engines on GPUs of their own (engine_device)
                metrics["placement/is_separate"] = float(is_separate)
                # due saves skipped so far because they would not fit on the disk (the cause
                # is in the log); a line late, as the save follows the line
                metrics["ckpt/skipped_no_space"] = float(ckpt.num_skipped_saves)
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
                if not decision.is_saved and not decision.is_skipped and step == last_step:
                    try:  # the final step, always, where the disk has room for it
                        ckpt.save(step, policy.state(), extra=extra)
                    except CheckpointSpaceError as e:  # the export below still runs
                        logger.warning("the final step is not saved: %s", e)
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
