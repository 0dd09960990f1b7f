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

    rows        this rank's next prompts (a draw of only unusable rows draws again)
    scored      n responses per prompt, each judged by the GenRM (placement=partial: judged as
                soon as it finishes, while the rollout's long tail still runs)
    batch       DAPO dynamic sampling (core.DynamicSampler): each round's rewards get the
                overlong penalty, groups without reward variance are dropped, rounds refill.
                rollout.sampling_mode=stream (placement=partial, grpo_stream.py): no rounds;
                prompts keep entering the engine, each judged group goes to the sampler as it
                arrives, and once every rank is full the long tail is aborted (counted; with
                rollout.keep_partial finished first next step)
    train       advantages per group -> balance across ranks -> old logprobs once (the
                trainer's forward, or the engine's with loss.old_logprobs_from=engine) -> for
                each epoch, for each mini-batch of whole groups (reshuffled each epoch): one
                optimizer step (loss.*)
    sync        the policy's weights into the rollout engine; metrics; checkpoint when due
    eval        every eval.every_steps: held-out prompts through the same reward (eval/*)

At the end the last step is always checkpointed and the policy written as a Hugging Face
folder (out_dir/export) that transformers and vLLM load as it is. One run per out_dir (a lock
rank 0 holds); SIGTERM or Ctrl-C saves the step in progress and exits with 128 + the signal.

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
import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import transformers
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoTokenizer

from yatt import core, genrm, rollout
from yatt.ckpt import Checkpointer, RunLock, acquire_run_lock, exit_code_for_signal
from yatt.placement import Plan

sys.path.insert(0, str(Path(__file__).parent))
from grpo_config import DataConfig, TrainConfig, config_from_args, parse_args
from grpo_data import Scored, judge_sample
from grpo_metrics import StepStats, VerdictWarnings, check_verdicts, eval_metrics, summarize
from grpo_preflight import preflight
from grpo_prompts import Prompt, PromptEncoder
from grpo_setup import (
    close_all,
    export_checkpoint,
    export_dir,
    load_eval_rows,
    make_engine,
    make_scorer,
    required_row_fields,
    row_limits,
    save_config,
)
from grpo_stream import RolloutStream, loaded_prompt, saved_prompt

logger = logging.getLogger("train_grpo")
PLANS = {"full": Plan.full_colocation, "partial": Plan.partial_colocation}


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


# -- one rollout round: generate and score, then training samples --------------------------------
def draw_prompts(loader: core.ShardedLoader, encoder: PromptEncoder, num_rows: int) -> list[Prompt]:
    """This rank's next prompts. A draw of only unusable rows (skipped and counted) draws
    again; once a whole epoch of the shard gave no usable prompt (the loader's skips or the
    encoder's) no number of draws could, and the run stops naming the counts."""
    num_drawn = 0
    prompts: list[Prompt] = []
    while not prompts:
        if num_drawn >= 2 * loader.num_local_rows:  # twice the shard: a whole epoch in it
            raise ValueError(
                f"data.path: the last {num_drawn} rows rank {loader.rank} drew (a whole epoch "
                f"of its {loader.num_local_rows} rows) gave no usable prompt; skipped rows by "
                f"cause: {encoder.skipped_by_cause(loader)}"
            )
        rows = loader.next_batch(num_rows)
        num_drawn += max(len(rows), 1)
        prompts = encoder.encode(rows)
    return prompts


def judge_view(
    prompt: Prompt, completion: rollout.Completion, tokenizer, data: DataConfig
) -> genrm.Sample:
    """What the judge reads of a response: its row's question and reference, the response
    decoded once (a vision token ends a response, see grpo_prompts.py; decoding skips it)."""
    response = tokenizer.decode(completion.response_ids, skip_special_tokens=True)
    return judge_sample(
        prompt.row, response, prompt_key=data.prompt_key, answer_key=data.answer_key
    )


def generate_and_judge(
    requests: list[rollout.Request],
    sampling: rollout.SamplingParams,
    to_sample: Callable[[rollout.Completion], genrm.Sample],
    *,
    engine,
    scorer,
    plan: Plan,
    should_overlap: bool,
    timings: dict[str, float],
    timer: Callable[[dict[str, float], str], contextlib.AbstractContextManager] = timed,
) -> tuple[list[rollout.Completion], list[genrm.Verdict]]:
    """One rollout of `requests` and each response's verdict: (completions, verdicts), paired
    by position. should_overlap (rollout and judge resident together): one "rollout+genrm"
    phase, each response judged as soon as it finishes; timings["genrm_tail"] adds the
    seconds from the rollout's last response to the last verdict, and a plan with a memory
    split moves it toward this round's token loads. Otherwise the "rollout" phase, then the
    "genrm" one (outside any phase for a plan without one: its judge lives elsewhere).
    `timer(timings, name)` times each phase (bench/step passes its CUDA-syncing one)."""
    if should_overlap:
        rollout_end: list[float] = []

        async def noting_its_end(stream):  # the rollout's last response: the tail starts
            async for completion in stream:
                yield completion
            rollout_end.append(time.perf_counter())

        with timer(timings, "rollout+genrm"), plan.phase("rollout"):
            stream = noting_its_end(engine.stream(requests, sampling))
            scored = asyncio.run(genrm.score_as_completed(stream, scorer, to_sample))
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
    with timer(timings, "rollout"), plan.phase("rollout"):
        completions = engine.generate(requests, sampling)
    judge_phase = plan.phase("genrm") if "genrm" in plan.phases else contextlib.nullcontext()
    with timer(timings, "genrm"), judge_phase:
        verdicts = scorer.score([to_sample(completion) for completion in completions])
    return completions, verdicts


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
) -> list[Scored]:
    """n responses per prompt (with its images), each decoded once and judged. should_overlap
    (rollout and judge resident together): each response is judged as soon as it finishes."""
    requests = [p.request() for p in prompts]  # images processed once, by the encoder
    samples: dict[tuple[int, int], genrm.Sample] = {}

    def to_sample(completion: rollout.Completion) -> genrm.Sample:
        sample = judge_view(prompts[completion.request_index], completion, tokenizer, data)
        samples[completion.request_index, completion.sample_index] = sample
        return sample

    completions, verdicts = generate_and_judge(
        requests,
        sampling,
        to_sample,
        engine=engine,
        scorer=scorer,
        plan=plan,
        should_overlap=should_overlap,
        timings=timings,
    )
    return [
        Scored(
            completion,
            samples[completion.request_index, completion.sample_index],
            verdict,
            prompts[completion.request_index],
        )
        for completion, verdict in zip(completions, verdicts, strict=True)
    ]


# -- one streamed step (rollout.sampling_mode=stream, placement=partial) -------------------------
def scored_group(group: genrm.JudgedGroup, stream: RolloutStream) -> list[Scored]:
    """A judged group's responses, each with what the judge read and its verdict."""
    prompt = stream.groups[group.group].prompt
    return [
        Scored(completion, stream.samples[id(completion)], verdict, prompt)
        for completion, verdict in zip(group.completions, group.verdicts, strict=True)
    ]


async def stream_generate_score_keep(
    step: int,
    stream: RolloutStream,
    sampler: core.DynamicSampler,
    *,
    draw: Callable[[int], list[Prompt]],
    keep: Callable[[list[Scored]], None],
    partials: core.PartialRollouts | None,
) -> None:
    """Prompts keep entering the engine while verdicts come back; each group whose responses
    are all judged goes to the sampler at once; once every rank has its groups (should_abort:
    polls, never blocks) the rollout's long tail and the judge's leftover work are cut."""
    if partials is not None:  # last step's cut groups first, their old tokens kept
        stream.resume(partials.take(step))
    if first := sampler.num_to_draw(in_flight=stream.num_in_flight):
        stream.feed(draw(first))  # generate
    while True:
        group = await stream.next_group()  # score: a group whose every response is judged
        if group is not None:
            keep(scored_group(group, stream))  # keep: sampler.add
        if sampler.should_abort():  # every rank is full
            break
        if more := sampler.num_to_draw(in_flight=stream.num_in_flight):
            stream.feed(draw(more))  # keep the engine fed
        if not stream.num_in_flight:  # nothing in flight, nothing to draw: take() decides
            break
    await stream.cut()


def to_batch(scored: Sequence[Scored], runtime: core.Runtime, encoder: PromptEncoder) -> core.Batch:
    """Training samples: prompt + response tokens, the loss on the response; a group per
    prompt; a prompt's images (VisionInputs) with each of its samples; a response cut before
    a vision token (a policy refuses an image token without its image)."""
    samples = core.rollout_samples(
        [item.completion for item in scored],
        rewards=[item.verdict.reward for item in scored],
        group_ids=[item.completion.request_index for item in scored],
        vision_inputs=[item.prompt.vision for item in scored] if encoder.takes_images else None,
        cut_at_token_ids=encoder.cut_token_ids,
    )
    samples = core.broadcast_to_tp_peers(samples, runtime)  # TP peers: one batch (host sync)
    return core.rollout_batch(samples)


def evaluate(
    prompts: list[Prompt],
    *,
    step: int,
    cfg: TrainConfig,
    runtime: core.Runtime,
    exact,
    stop_token_ids: tuple[int, ...],
    **generate,
) -> dict[str, float]:
    """The held-out prompts through the rollout engine and the same reward: eval/* metrics over
    all ranks (collective; a rank without rows still joins). Same seeds every time, so a change
    between evaluations is the policy's."""
    stats = StepStats()
    if prompts:
        sampling = rollout.SamplingParams(
            n=cfg.eval.samples_per_prompt,
            temperature=cfg.eval.temperature,
            max_new_tokens=cfg.rollout.max_new_tokens,
            seed=(cfg.seed * 1_000_003 + runtime.dp_rank * 10_007 + 7) % 2**31,
            stop_token_ids=stop_token_ids,
        )
        with timed(stats.timings, "eval"):
            scored = generate_and_score(prompts, sampling, timings={}, **generate)
        stats.add(scored, exact)
    return eval_metrics(stats, runtime.dp_group)


def mini_batch_seed(seed: int, step: int, epoch: int, loss: core.PolicyLoss) -> int | None:
    """The seed of an epoch's split into mini-batches: None (the best-balanced split, the
    same each time) for a single epoch or loss.should_reshuffle_epochs=False; else one per
    (seed, step, epoch), so each pass over a batch groups its GRPO groups differently."""
    if loss.num_epochs == 1 or not loss.should_reshuffle_epochs:
        return None
    return (seed * 1_000_003 + step * 1_009 + epoch) % 2**31


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
) -> dict[str, float]:
    """The step's updates on this rank's balanced batch, inside the train phase; the merged
    train metrics. costs: the policy's per-sample estimate for the mini-batch split (None:
    estimated here when there is more than one mini-batch)."""
    batch = batch.to(device)
    # pi_old, once, before the first update: the engine's own logprobs (no forward), or the
    # trainer's forward (is_on_policy: one update, and the loss reuses its own forward's
    # logprobs, detached)
    if loss.old_logprobs_from == "engine":
        batch.tokens["old_logprobs"] = core.engine_old_logprobs(batch)
    elif not loss.is_on_policy:
        batch.tokens["old_logprobs"] = policy.logprobs(batch)
    if reference is not None:
        batch.tokens["ref_logprobs"] = reference.logprobs(batch)
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
    return core.merge_step_metrics(steps)


# -- what a checkpoint keeps beside the tensors ---------------------------------------------------
def checkpoint_extra(
    step: int,
    loader: core.ShardedLoader,
    sampler: core.DynamicSampler,
    partials: core.PartialRollouts | None,
) -> dict[str, Any]:
    """This rank's `extra` (JSON): the step, the loader's position, the sampler's keep rate
    (the next step's prior) and, with keep_partial, the cut groups held for the next step."""
    extra = {"step": step, "loader": loader.state_dict(), "sampler": sampler.state_dict()}
    if partials is not None:
        extra["partials"] = partials.state_dict(save_prompt=saved_prompt)
    return extra


# the checkpoint's cut groups not resumed, in the first step's metrics after a resume
RESUME_DROPPED_METRIC = "dynamic_sampling/num_partial_groups_dropped_on_resume"


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What resume_from_extra restored: the step to start at, and the checkpoint's cut groups
    this rank could not resume (their prompts not rebuilt, or keep_partial off now)."""

    start_step: int
    num_partial_groups_dropped: int = 0

    def metrics(self, group) -> dict[str, float]:
        """The first step's metrics after the resume, summed over the ranks (collective)."""
        dropped = {RESUME_DROPPED_METRIC: float(self.num_partial_groups_dropped)}
        return core.reduce_metrics(dropped, group=group, default_op="sum")


def resume_from_extra(
    extra: dict[str, Any],
    *,
    loader: core.ShardedLoader,
    sampler: core.DynamicSampler,
    partials: core.PartialRollouts | None,
    encoder: PromptEncoder,
) -> Resumed:
    """Restore what checkpoint_extra kept. A checkpoint written before the sampler and the
    cut groups were kept resumes with the prior keep rate and no cut groups; cut groups not
    resumed (keep_partial off now, or a prompt not rebuilt) are logged and counted."""
    loader.load_state_dict(extra["loader"])
    if "sampler" in extra:
        sampler.load_state_dict(extra["sampler"])
    held = extra.get("partials")
    num_dropped = 0
    if held is not None and partials is None:
        num_dropped = len(held.get("groups", ())) if isinstance(held, dict) else 0
        logger.warning(
            "the checkpoint holds %d cut groups; rollout.keep_partial is off: not resumed",
            num_dropped,
        )
    elif held is not None:
        num_dropped = partials.load_state_dict(
            held,
            load_prompt=lambda saved: loaded_prompt(saved, encoder, read_rows=loader.read_rows),
        )
        if num_dropped:  # their rows are unusable now, or no longer give the same prompt ids
            logger.warning(
                "%d of the checkpoint's cut groups are not resumed: their prompts cannot be "
                "rebuilt from the saved rows (unusable now, or other prompt ids)",
                num_dropped,
            )
    return Resumed(start_step=extra["step"] + 1, num_partial_groups_dropped=num_dropped)


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
    a stop signal ended it after its final save. Everything it opens is closed on return."""
    closeables: list[Any] = []  # closed in reverse, also after an error
    is_failed = True  # until the loop ends: a close() error must not hide the loop's own
    stop_signal: int | None = None
    try:
        ckpt = Checkpointer.from_config(Path(cfg.out_dir) / "checkpoints", cfg.ckpt)
        closeables.append(ckpt)

        # -- data, checked before any model loads (tokenizers only) ------------------------------
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
        # A frozen copy of the starting policy, only when the loss reads it (kl_coef > 0).
        reference = None
        if cfg.loss.kl_coef > 0:
            reference_config = replace(cfg.policy, is_reference=True)
            reference = core.build_policy(cfg.backend, reference_config, runtime)
        engine = make_engine(
            cfg.rollout, cfg.policy.model_dir, device, policy_tp_size=runtime.tp_size
        )
        closeables.append(engine)
        if encoder.takes_images and not engine.accepts_images:
            raise ValueError(f"rollout.backend={cfg.rollout.backend!r} serves no images here")
        judge_engine = None
        if cfg.uses_judge_model:
            judge_engine = make_engine(cfg.reward, cfg.reward.judge_dir, device)
            closeables.append(judge_engine)
        scorer, exact = make_scorer(cfg.reward, judge_engine, closeables)
        roles = {"rollout": engine, "genrm": judge_engine, "train": policy, "reference": reference}
        plan = PLANS[cfg.placement](**roles, offload=cfg.offload)
        # Stream responses to the judge while the rollout runs when both stay resident (a
        # judge without an engine of its own is always there).
        should_overlap = judge_engine is None or plan.is_resident_together("rollout", "genrm")
        # SIGTERM/SIGINT/SIGUSR1: a final save at the next step boundary, then a non-zero exit
        # (a second Ctrl-C stops at once, unsaved).
        ckpt.install_signal_handlers()
        # DAPO dynamic sampling, rounds (partial colocation overlaps the judge with the
        # rollout inside each round), or a stream (rollout.sampling_mode=stream). One sampler
        # for the run: its keep rate carries over (checkpointed, as the held cut groups are).
        is_stream = cfg.rollout.sampling_mode == "stream"
        sampler = core.DynamicSampler(
            target_groups=cfg.data.prompts_per_rank,
            oversample=cfg.rollout.oversample,
            max_oversample=cfg.rollout.max_oversample,
            fill_probability=cfg.rollout.fill_probability,
            max_rounds=cfg.rollout.max_sampling_rounds,
            tolerance=cfg.loss.zero_variance_tolerance,
            on_unfilled=cfg.rollout.on_unfilled,
            mode=cfg.rollout.sampling_mode,
            # a stream draws as it goes: a target larger than this rank's rows is refused now
            num_prompts=loader.num_local_rows if is_stream else None,
            group=runtime.dp_group,
        )
        # rollout.keep_partial: the groups a stream's abort cut, finished first next step
        partials = (
            core.PartialRollouts(rollout_correction=cfg.loss.rollout_correction)
            if cfg.rollout.keep_partial
            else None
        )
        start_step = 0
        resumed: Resumed | None = None  # its counts go into the first step's metrics
        if should_resume:  # the tensors, then the loader, the keep rate and the cut groups
            extra = ckpt.load(policy.state())
            resumed = resume_from_extra(
                extra, loader=loader, sampler=sampler, partials=partials, encoder=encoder
            )
            start_step = resumed.start_step
            engine.update_weights(policy.named_weights())  # the engine starts from the saved policy
            logger.info("resumed after step %d", extra["step"])
        run_log = core.RunLog(
            cfg.out_dir,
            is_writer=runtime.is_rank_zero,
            resume_step=start_step,
            wandb_project=cfg.log.wandb_project or None,
            wandb_config=dataclasses.asdict(cfg) if cfg.log.wandb_project else None,
        )
        closeables.append(run_log)
        generate = dict(
            engine=engine,
            scorer=scorer,
            plan=plan,
            tokenizer=tokenizer,
            data=cfg.data,
            should_overlap=should_overlap,
        )

        def round_sampling(step: int, num_round: int) -> rollout.SamplingParams:
            # Seeded by (seed, DP rank, step, round): a resumed run and TP peers draw alike.
            seed = cfg.seed * 1_000_003 + runtime.dp_rank * 10_007 + step * 101 + num_round
            return rollout.SamplingParams(
                n=cfg.rollout.samples_per_prompt,
                temperature=cfg.rollout.temperature,
                **cfg.rollout.sampling_knobs(),  # top_p, top_k
                max_new_tokens=cfg.rollout.max_new_tokens,
                seed=seed % 2**31,
                stop_token_ids=encoder.cut_token_ids,  # a vision-language policy's (else none)
            )

        max_new_tokens = cfg.rollout.max_new_tokens

        def keep(scored: list[Scored], stats: StepStats) -> None:
            """A round's or a group's judged responses to the sampler (keep), counted."""
            stats.add(scored, exact, cut_token_ids=encoder.cut_token_ids)
            groups = to_batch(scored, runtime, encoder)
            # DAPO's soft overlong punishment (0 when off), before the variance test
            groups.samples["reward"] += cfg.overlong.compute_penalties(
                groups, max_new_tokens=max_new_tokens
            )
            sampler.add(groups)  # keep: whole groups with reward variance

        def stream_step(step: int, stats: StepStats) -> tuple[core.Batch, dict[str, float]]:
            """generate -> score -> keep as one stream; the cut groups counted (kept with
            keep_partial); the memory split moved by the step's live queues."""
            stream = RolloutStream(
                engine=engine,
                judge_engine=judge_engine,
                scorer=scorer,
                to_sample=lambda prompt, c: judge_view(prompt, c, tokenizer, cfg.data),
                sampling=round_sampling(step, 0),
                step=step,
            )
            with timed(stats.timings, "rollout+genrm"), plan.phase("rollout"):
                asyncio.run(
                    stream_generate_score_keep(
                        step,
                        stream,
                        sampler,
                        draw=lambda count: draw_prompts(loader, encoder, count),
                        keep=lambda scored: keep(scored, stats),
                        partials=partials,
                    )
                )
            cut = stream.cut_groups()
            sampler.record_aborted(len(cut), num_tokens=stream.num_aborted_tokens)
            for group in cut if partials is not None else ():
                partials.put(group)
            pending = stream.pending_tokens()
            if plan.has_memory_split:  # the next split follows the step's live queues
                plan.update_load(**pending)
            batch, sampling_stats = sampler.take()  # waits for every rank's stream
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

        # -- the GRPO loop ----------------------------------------------------------------------
        last_save_s = 0.0  # a save's time is logged with the next step (it ends after the log)
        last_step = cfg.num_steps - 1
        is_stopped = False  # by a signal, after its final save
        is_eval_on = bool(cfg.eval.every_steps and cfg.eval.path)  # every rank, rows or not
        verdict_warnings = VerdictWarnings(every_steps=cfg.log.warn_every_steps)
        idle_guard = core.LearningGuard(max_idle_steps=cfg.max_idle_steps)  # cannot learn: stop
        bar = tqdm(range(start_step, cfg.num_steps), disable=not runtime.is_rank_zero, desc="grpo")
        with logging_redirect_tqdm():  # log lines print above the bar, never through it
            for step in bar:
                stats = StepStats(timings={"ckpt": last_save_s})
                if is_stream:  # generate -> score -> keep, streamed; the long tail cut
                    batch, sampling_stats = stream_step(step, stats)
                else:
                    # rollout + GenRM in rounds until every rank has its groups with reward
                    # variance (collective: a full rank draws 0 and still joins each round)
                    while not sampler.is_done():
                        num_prompts = sampler.num_to_draw()
                        if num_prompts:
                            prompts = draw_prompts(loader, encoder, num_prompts)
                            stats.num_rounds += 1
                            sampling = round_sampling(step, stats.num_rounds)
                            scored = generate_and_score(  # generate -> score
                                prompts, sampling, timings=stats.timings, **generate
                            )
                            keep(scored, stats)  # keep: whole groups with reward variance
                        else:
                            sampler.add(core.rollout_batch([]))  # a full rank joins the round
                    batch, sampling_stats = sampler.take()
                # Over all ranks (collective): the trained responses cut at max_new_tokens.
                truncation = core.compute_truncation_metrics(batch, group=runtime.dp_group)
                if cfg.overlong.should_filter_truncated:  # their tokens out of the loss
                    num_masked = core.mask_truncated_responses(batch)
                    truncation |= core.reduce_metrics(
                        {"response/num_truncated_masked": num_masked},
                        group=runtime.dp_group,
                        default_op="sum",
                    )
                # local: a whole group lives on this rank
                batch.samples["advantages"] = cfg.loss.compute_advantages(
                    batch.samples["reward"], batch.samples["group_id"]
                )
                with timed(stats.timings, "balance"):  # lengths cross ranks; moves go p2p
                    # The policy's cost model, its images included: the weights its micro-batch
                    # packing uses.
                    costs = policy.estimate_batch_costs(batch)
                    batch, _ = batch.rebalance(
                        group=runtime.dp_group, group_key="group_id", costs=costs
                    )
                    if cfg.loss.num_mini_batches > 1:  # the rebalanced batch's own costs
                        costs = policy.estimate_batch_costs(batch)
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
                    )
                with timed(stats.timings, "sync"), plan.phase("sync"):  # bucketed, no 2nd copy
                    engine.update_weights(policy.named_weights())
                metrics = summarize(
                    stats,
                    sampling_stats,
                    encoder.skipped_by_cause(loader),
                    runtime.dp_group,
                    has_images=encoder.takes_images,
                )
                metrics |= truncation
                if resumed is not None:  # every rank resumed: the first step after it
                    metrics |= resumed.metrics(runtime.dp_group)
                    resumed = None
                metrics |= {f"train/{key}": value for key, value in train_metrics.items()}
                # Same on every rank. Every sample right: solved, not stuck (a rule's accuracy).
                is_solved = metrics["reward/accuracy"] >= 1.0
                idle_guard.update(step, train_metrics, sampling_stats, is_solved=is_solved)
                metrics |= idle_guard.metrics()
                if is_eval_on and ((step + 1) % cfg.eval.every_steps == 0 or step == last_step):
                    metrics |= evaluate(
                        eval_prompts,
                        step=step,
                        cfg=cfg,
                        runtime=runtime,
                        exact=exact,
                        stop_token_ids=encoder.cut_token_ids,
                        **generate,
                    )
                metrics |= plan.metrics()
                run_log.log(step, metrics)
                check_verdicts(step, metrics, stats.first_failure, verdict_warnings)
                idle_guard.check(step)  # after the log: the stuck steps' metrics are kept
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
                # Saved after the step's metrics line, so a committed step k implies lines 0..k.
                save_start = time.perf_counter()  # async: returns once tensors are staged
                # built only when a save happens: the cut groups' ids and logprobs are large
                extra = functools.partial(checkpoint_extra, step, loader, sampler, partials)
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
            out = core.export_hf(
                policy, export_dir(cfg), dtype=cfg.export.dtype or None, should_overwrite=True
            )
            logger.info("the final policy, as a Hugging Face folder: %s", out)
        if runtime.is_rank_zero and (records := run_log.read()):
            first, last = records[0], records[-1]
            keys = ("reward/mean", "reward/accuracy")
            change = {key: f"{first[key]:.3f} -> {last[key]:.3f}" for key in keys}
            plot = run_log.plot([*keys, "response/length_mean"])
            logger.info("steps %d..%d: %s; plot %s", first["step"], last["step"], change, plot)
        is_failed = False
    finally:
        close_all(closeables[::-1], should_raise=not is_failed)
    return 0 if stop_signal is None else exit_code_for_signal(stop_signal)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
