"""Reference GRPO trainer: every rank runs this same file (one controller per data-parallel rank).

    python examples/train_grpo.py                                   # embedded default, CPU
    torchrun --nproc_per_node 2 examples/train_grpo.py              # 2 ranks (gloo or NCCL)
    python examples/train_grpo.py --config examples/configs/tiny_partial.yaml num_steps=5
    python examples/train_grpo.py --resume                          # continue from out_dir
    torchrun --nproc_per_node 2 examples/train_grpo.py backend=megatron policy.tp_size=2  # GPU
    python examples/train_grpo.py --help                            # every config field

One step, as the loop reads:

    rows        this rank's next prompts (a draw of only unusable rows draws again)
    scored      n responses per prompt, each judged by the GenRM (placement=partial: judged as
                soon as it finishes, while the rollout's long tail still runs)
    batch       DAPO dynamic sampling: groups without reward variance dropped, then refilled
    train       advantages per group -> balance across ranks -> one optimizer step
    sync        the policy's weights into the rollout engine; metrics; checkpoint when due

The config (grpo_config.py) is built and checked whole before anything starts. Unusable data
rows are skipped and counted (data/skipped_rows/<cause>); failed judge verdicts are counted
(genrm/errors, genrm/unparsable) with the first cause logged, and a step whose every verdict
failed stops the run. Fork it and edit the loop; there are no hook flags.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import AutoTokenizer

from yatt import core, genrm, rollout
from yatt.balance import flops_cost
from yatt.ckpt import Checkpointer
from yatt.placement import Plan

sys.path.insert(0, str(Path(__file__).parent))
from grpo_config import ENGINE_CONFIGS, DataConfig, RewardConfig, RolloutConfig, read_config
from grpo_data import check_judge_prompts, judge_sample, prompt_ids, row_fields_read_by
from grpo_metrics import StepStats, check_verdicts, summarize

logger = logging.getLogger("train_grpo")
ENGINES = {"vllm": rollout.VLLMEngine, "sglang": rollout.SGLangEngine}
PLANS = {"full": Plan.full_colocation, "partial": Plan.partial_colocation}
JUDGE_MAX_NEW_TOKENS = 4  # "Yes"/"No" and an end token


# -- setup helpers ------------------------------------------------------------------------------
def make_engine(section: RolloutConfig | RewardConfig, model_dir: str, device: str):
    """The policy's or the judge's engine: built-in by default, vLLM or SGLang by config (its
    backend and options were checked when the config was built)."""
    if section.backend == "builtin":
        return rollout.BuiltinEngine(model_dir, config=replace(section.engine, device=device))
    config = ENGINE_CONFIGS[section.backend](**section.backend_options)
    return ENGINES[section.backend](model_dir, config=config)


def make_scorer(reward: RewardConfig, judge_engine) -> tuple[Any, genrm.ExactMatch]:
    """The reward: the judge's verdict (+1/-1), plus an exact-match rule when rule_weight > 0.
    The exact match is also the accuracy metric's ground truth."""
    judge = genrm.GenRM(
        judge_engine,
        template=genrm.JudgeTemplate(user=reward.judge_template),
        parser=genrm.YesNoParser(),
        votes=reward.votes,
        sampling=rollout.SamplingParams(
            temperature=float(reward.votes > 1), max_new_tokens=JUDGE_MAX_NEW_TOKENS
        ),
    )
    exact = genrm.ExactMatch()
    if reward.rule_weight:
        return genrm.CombinedRM(judge, [(exact, reward.rule_weight)]), exact
    return judge, exact


def check_start(ckpt: Checkpointer, should_resume: bool, out_dir: str) -> None:
    """Before any model loads: --resume needs a checkpoint; a fresh run never mixes with one."""
    if should_resume and ckpt.latest() is None:
        raise ValueError(
            f"--resume: {out_dir}/checkpoints holds no checkpoint; run without --resume to "
            "start fresh, or point out_dir at the run to continue"
        )
    if not should_resume and ckpt.latest() is not None:
        raise ValueError(f"out_dir={out_dir!r} has checkpoints: pass --resume or a new out_dir")


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


# -- one rollout round: generate and score, then training samples --------------------------------
@dataclass(frozen=True)
class Scored:
    """One response, what the judge read of it, and the judge's verdict."""

    completion: rollout.Completion
    sample: genrm.Sample  # what the judge read: prompt text, the response decoded once, reference
    verdict: genrm.Verdict


def draw_rows(loader: core.ShardedLoader, num_rows: int) -> list[dict]:
    """This rank's next rows. A draw of only unusable rows (skipped and counted) draws again;
    the loader stops the run once a whole epoch of the shard had no usable row."""
    rows = loader.next_batch(num_rows)
    while not rows:
        rows = loader.next_batch(num_rows)
    return rows


def generate_and_score(
    rows: list[dict],
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
    """n responses per row's prompt, each decoded once and judged. should_overlap (rollout and
    judge resident together): each response is judged as soon as it finishes."""
    requests = [
        rollout.Request(
            prompt_ids=prompt_ids(row[data.prompt_key], tokenizer, data.apply_chat_template)
        )
        for row in rows
    ]
    samples: dict[tuple[int, int], genrm.Sample] = {}

    def to_sample(completion: rollout.Completion) -> genrm.Sample:
        response = tokenizer.decode(completion.response_ids, skip_special_tokens=True)
        row = rows[completion.request_index]
        sample = judge_sample(row, response, prompt_key=data.prompt_key, answer_key=data.answer_key)
        samples[completion.request_index, completion.sample_index] = sample
        return sample

    if should_overlap:
        with timed(timings, "rollout+genrm"), plan.phase("rollout"):
            stream = engine.stream(requests, sampling)
            scored = asyncio.run(genrm.score_as_completed(stream, scorer, to_sample))
        completions, verdicts = scored
        # The next split of memory between the two follows this round's measured token loads.
        rollout_tokens = sum(
            len(completion.prompt_ids) + len(completion.response_ids) for completion in completions
        )
        judge_tokens = scored.stats.num_judge_prompt_tokens
        plan.update_load(rollout_pending_tokens=rollout_tokens, genrm_pending_tokens=judge_tokens)
    else:
        with timed(timings, "rollout"), plan.phase("rollout"):
            completions = engine.generate(requests, sampling)
        with timed(timings, "genrm"), plan.phase("genrm"):
            verdicts = scorer.score([to_sample(completion) for completion in completions])
    return [
        Scored(completion, samples[completion.request_index, completion.sample_index], verdict)
        for completion, verdict in zip(completions, verdicts, strict=True)
    ]


def to_batch(scored: Sequence[Scored], runtime: core.Runtime) -> core.Batch:
    """Training samples: prompt + response tokens, the loss on the response; a group per prompt."""
    samples = core.rollout_samples(
        [item.completion for item in scored],
        rewards=[item.verdict.reward for item in scored],
        group_ids=[item.completion.request_index for item in scored],
    )
    samples = core.broadcast_to_tp_peers(samples, runtime)  # TP peers: one batch (host sync)
    return core.rollout_batch(samples)


def close_all(closeables: Sequence[Any], *, should_raise: bool) -> None:
    """Close each; a failure is logged, and raised only when no earlier error is propagating."""
    errors = []
    for closeable in closeables:
        try:
            closeable.close()
        except Exception as exc:  # keep closing the rest
            logger.exception("closing %s failed", type(closeable).__name__)
            errors.append(exc)
    if errors and should_raise:
        raise errors[0]


# -- the run --------------------------------------------------------------------------------------
def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg, should_resume = read_config(argv)  # built and checked whole before anything starts
    runtime = core.init_runtime(seed=cfg.seed, tp_size=getattr(cfg.policy, "tp_size", 1))
    closeables: list[Any] = []  # closed in reverse, also after an error
    is_failed = True  # until the loop ends: a close() error must not hide the loop's own
    try:
        ckpt = Checkpointer.from_config(Path(cfg.out_dir) / "checkpoints", cfg.ckpt)
        closeables.append(ckpt)
        check_start(ckpt, should_resume, cfg.out_dir)

        # -- data, checked before any model loads (tokenizers only) ------------------------------
        tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_dir)
        judge_template = genrm.JudgeTemplate(user=cfg.reward.judge_template)
        loader = core.ShardedLoader(
            cfg.data.path,
            batch_size=cfg.data.prompts_per_rank,
            rank=runtime.dp_rank,
            world_size=runtime.dp_size,
            prompt_key=cfg.data.prompt_key,
            seed=cfg.seed,
            max_prompt_tokens=cfg.rollout.engine.max_seq_len - cfg.rollout.max_new_tokens,
            count_tokens=lambda prompt: len(
                prompt_ids(prompt, tokenizer, cfg.data.apply_chat_template)
            ),
            required_keys=row_fields_read_by(judge_template, cfg.data.answer_key),
        )
        is_judge_builtin = cfg.reward.backend == "builtin"
        check_judge_prompts(
            judge_template,
            loader.first_rows(),
            tokenizer=AutoTokenizer.from_pretrained(cfg.reward.judge_dir),
            # GenRM's own limit for the built-in engine; vLLM/SGLang read the model's context.
            max_prompt_tokens=cfg.reward.engine.max_seq_len - 1 if is_judge_builtin else None,
            max_response_tokens=min(cfg.rollout.max_new_tokens, judge_template.max_response_tokens),
            prompt_key=cfg.data.prompt_key,
            answer_key=cfg.data.answer_key,
            source=f"data.path={cfg.data.path!r}",
        )

        # -- models: policy, rollout engine, judge, placement -----------------------------------
        device = str(runtime.device)
        policy = core.build_policy(cfg.backend, cfg.policy, runtime)
        engine = make_engine(cfg.rollout, cfg.policy.model_dir, device)
        closeables.append(engine)
        judge_engine = make_engine(cfg.reward, cfg.reward.judge_dir, device)
        closeables.append(judge_engine)
        scorer, exact = make_scorer(cfg.reward, judge_engine)
        roles = {"rollout": engine, "genrm": judge_engine, "train": policy}
        plan = PLANS[cfg.placement](**roles, offload=cfg.offload)
        # Stream responses to the judge while the rollout runs when both stay resident.
        should_overlap = plan.is_resident_together("rollout", "genrm")
        ckpt.install_signal_handlers()  # SIGTERM/SIGUSR1: final save at the next boundary
        start_step = 0
        if should_resume:
            extra = ckpt.load(policy.state())
            loader.load_state_dict(extra["loader"])
            start_step = extra["step"] + 1
            engine.update_weights(policy.named_weights())  # the engine starts from the saved policy
            logger.info("resumed after step %d", extra["step"])
        run_log = core.RunLog(cfg.out_dir, is_writer=runtime.is_rank_zero, resume_step=start_step)
        closeables.append(run_log)

        def rollout_round(num_missing: int, *, step: int, stats: StepStats) -> core.Batch:
            """One DAPO round: `num_missing` more prompts, rolled out and judged."""
            if num_missing == 0:  # this rank is full; others may still be drawing
                return core.rollout_batch([])
            rows = draw_rows(loader, num_missing)
            stats.num_rounds += 1
            # Seeded by (seed, DP rank, step, round): a resumed run and TP peers draw alike.
            seed = cfg.seed * 1_000_003 + runtime.dp_rank * 10_007 + step * 101 + stats.num_rounds
            sampling = rollout.SamplingParams(
                n=cfg.rollout.samples_per_prompt,
                temperature=cfg.rollout.temperature,
                max_new_tokens=cfg.rollout.max_new_tokens,
                seed=seed % 2**31,
            )
            scored = generate_and_score(
                rows,
                sampling,
                engine=engine,
                scorer=scorer,
                plan=plan,
                tokenizer=tokenizer,
                data=cfg.data,
                should_overlap=should_overlap,
                timings=stats.timings,
            )
            stats.add(scored, exact)
            return to_batch(scored, runtime)

        # -- the GRPO loop ----------------------------------------------------------------------
        last_save_s = 0.0  # a save's time is logged with the next step (it ends after the log)
        bar = tqdm(range(start_step, cfg.num_steps), disable=not runtime.is_rank_zero, desc="grpo")
        for step in bar:
            stats = StepStats(timings={"ckpt": last_save_s})
            # rollout + GenRM; DAPO dynamic sampling drops zero-variance groups and refills
            batch, sampling_stats = core.sample_dynamically(
                functools.partial(rollout_round, step=step, stats=stats),
                num_groups=cfg.data.prompts_per_rank,
                max_rounds=cfg.rollout.max_sampling_rounds,
                group=runtime.dp_group,
            )
            advantages = core.compute_grpo_advantages(
                batch.samples["reward"], batch.samples["group_id"]
            )
            batch.samples["advantages"] = advantages  # local: a whole group lives on this rank
            with timed(stats.timings, "balance"):  # lengths cross ranks; moved samples go p2p
                costs = flops_cost(
                    batch.lengths.tolist(),
                    hidden_size=policy.model_config.hidden_size,
                    num_layers=policy.model_config.num_hidden_layers,
                )
                batch, _ = batch.rebalance(
                    group=runtime.dp_group, group_key="group_id", costs=costs
                )
            with timed(stats.timings, "train"), plan.phase("train"):
                batch = batch.to(runtime.device)
                if not cfg.loss.is_on_policy:  # else the loss reuses its forward's, detached
                    batch.tokens["old_logprobs"] = policy.logprobs(batch)
                train_metrics = policy.train_step(batch, cfg.loss)
            with timed(stats.timings, "sync"), plan.phase("sync"):  # bucketed, no second copy
                engine.update_weights(policy.named_weights())
            metrics = summarize(stats, sampling_stats, loader.skipped_by_cause(), runtime.dp_group)
            metrics |= {f"train/{key}": value for key, value in train_metrics.items()}
            metrics |= plan.metrics()
            run_log.log(step, metrics)
            check_verdicts(step, metrics, stats.first_failure)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            # Saved after the step's metrics line, so a committed step k implies lines 0..k.
            save_start = time.perf_counter()  # async: returns once tensors are staged
            extra = {"step": step, "loader": loader.state_dict()}
            decision = ckpt.maybe_save(step, policy.state(), phase="train", extra=extra)
            last_save_s = time.perf_counter() - save_start
            if decision.should_stop:
                logger.info("stop requested: step %d saved, exiting", step)
                break
        ckpt.wait()
        if runtime.is_rank_zero and (records := run_log.read()):
            first, last = records[0], records[-1]
            keys = ("reward/mean", "reward/accuracy")
            change = {key: f"{first[key]:.3f} -> {last[key]:.3f}" for key in keys}
            plot = run_log.plot([*keys, "response/length_mean"])
            logger.info("steps %d..%d: %s; plot %s", first["step"], last["step"], change, plot)
        is_failed = False
    finally:
        close_all(closeables[::-1], should_raise=not is_failed)
        runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
