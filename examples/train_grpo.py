"""Reference GRPO trainer: every rank runs this same file (one controller per data-parallel rank).

    python examples/train_grpo.py                                   # embedded default, CPU
    torchrun --nproc_per_node 2 examples/train_grpo.py              # 2 ranks (gloo or NCCL)
    python examples/train_grpo.py --config examples/configs/tiny_partial.yaml num_steps=5
    python examples/train_grpo.py --resume                          # continue from out_dir
    torchrun --nproc_per_node 2 examples/train_grpo.py backend=megatron policy.tp_size=2  # GPU

One step: rollout -> GenRM scoring -> advantages (+ DAPO dynamic sampling) -> balance -> train
-> weight sync -> checkpoint. Fork it and edit the loop; there are no hook flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import yaml
from tqdm import tqdm

from yatt import core, genrm, rollout
from yatt.balance import flops_cost
from yatt.ckpt import Checkpointer, CkptConfig
from yatt.placement import Plan

sys.path.insert(0, str(Path(__file__).parent))
import tiny_task  # the embedded default's setup step

logger = logging.getLogger("train_grpo")
ENGINES = {
    "vllm": (rollout.VLLMEngine, rollout.VLLMConfig),
    "sglang": (rollout.SGLangEngine, rollout.SGLangConfig),
}


# -- config -----------------------------------------------------------------------------------
@dataclass(kw_only=True)
class DataConfig:
    path: str = ""  # JSONL/Parquet prompts; "" = the embedded task's prompts
    prompt_key: str = "prompt"  # row field holding the prompt text
    answer_key: str = "answer"  # row field holding the reference answer ("" = none)
    prompts_per_rank: int = 8  # GRPO groups per rank per step
    # Message lists ([{role, content}, ...]) always go through the policy's chat template;
    # True sends plain-text prompts through it too (instruct models).
    apply_chat_template: bool = False

    def __post_init__(self) -> None:
        check_at_least("data.prompts_per_rank", self.prompts_per_rank, 1)


@dataclass(kw_only=True)
class RolloutConfig:
    samples_per_prompt: int = 8  # GRPO group size n
    temperature: float = 1.0
    max_new_tokens: int = 4
    max_sampling_rounds: int = 3  # DAPO dynamic sampling: rollout rounds to fill the batch
    backend: str = "builtin"  # "builtin", or "vllm"/"sglang" (GPU; yatt-rollout[vllm|sglang])
    engine: rollout.EngineConfig = field(
        default_factory=lambda: rollout.EngineConfig(max_seq_len=64)
    )
    backend_options: dict = field(default_factory=dict)  # VLLMConfig/SGLangConfig fields

    def __post_init__(self) -> None:
        # GRPO's advantage is a sample's reward against its group's: one sample has none.
        check_at_least("rollout.samples_per_prompt", self.samples_per_prompt, 2)
        check_at_least("rollout.max_new_tokens", self.max_new_tokens, 1)
        check_at_least("rollout.max_sampling_rounds", self.max_sampling_rounds, 1)
        check_at_least("rollout.temperature", self.temperature, 0.0)


@dataclass(kw_only=True)
class RewardConfig:
    judge_dir: str = ""  # the judge's model directory; "" = the embedded task's judge
    judge_template: str = "{prompt}{response} ref {reference}"  # JudgeTemplate.user
    votes: int = 1  # judge samples per response, averaged
    rule_weight: float = 0.0  # weight of an exact-match rule reward added to the judge's
    backend: str = "builtin"  # the judge's engine: "builtin", or "vllm"/"sglang" (GPU)
    engine: rollout.EngineConfig = field(
        default_factory=lambda: rollout.EngineConfig(max_seq_len=96, region_prefix="genrm")
    )
    backend_options: dict = field(default_factory=dict)  # VLLMConfig/SGLangConfig fields

    def __post_init__(self) -> None:
        check_at_least("reward.votes", self.votes, 1)


@dataclass(kw_only=True)
class TrainConfig:
    seed: int = 0
    num_steps: int = 120
    out_dir: str = "runs/grpo"  # metrics, plot and checkpoints
    placement: str = "full"  # "full": phases in turn; "partial": rollout + GenRM resident
    offload: str = "always"  # "auto": a role sleeps only when the next phase would not fit
    backend: str = "torch"  # policy backend: "torch" or "megatron" (CUDA; yatt-core[megatron])
    policy: core.TorchPolicyConfig | core.MegatronPolicyConfig  # model_dir "" = embedded policy
    # One optimizer step per batch: the loss takes old logprobs from its own forward pass.
    loss: core.PolicyLoss = field(
        default_factory=lambda: core.PolicyLoss(clip_high=0.28, is_on_policy=True)
    )
    ckpt: CkptConfig = field(default_factory=lambda: CkptConfig(every_steps=20, phases=("train",)))
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def __post_init__(self) -> None:
        check_at_least("num_steps", self.num_steps, 0)  # 0: build the embedded task and stop
        for key, allowed in (("placement", ("full", "partial")), ("offload", ("always", "auto"))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r}: use one of {allowed}")
        for name, engine in (("rollout", self.rollout), ("reward", self.reward)):
            check_engine_backend(f"{name}.backend", engine.backend, engine.backend_options)
        check_judge_template(self.reward.judge_template, self.data.answer_key)
        if isinstance(self.policy, dict):  # unknown keys fail here, naming the backend's class
            self.policy = core.policy_config_from_dict(self.backend, self.policy)


def check_judge_template(template: str, answer_key: str) -> None:
    """Before any model loads: the judge template reads only what a sample has (the trainer
    fills prompt, response, and reference from data.answer_key when one is set)."""
    fields = genrm.JudgeTemplate(user=template).fields
    known = {"prompt", "response"} | ({"reference"} if answer_key else set())
    if fields - known:
        raise ValueError(
            f"reward.judge_template={template!r} reads {sorted(fields - known)}; a sample has "
            f"{sorted(known)}" + ("" if answer_key else " (set data.answer_key for {reference})")
        )


def check_at_least(name: str, value, minimum) -> None:
    if value < minimum:
        raise ValueError(f"{name}={value!r}: must be >= {minimum}")


def check_engine_backend(field_name: str, backend: str, options: dict) -> None:
    """Before anything loads: a known engine, installed, with options its config knows."""
    if backend == "builtin":
        return
    if backend not in ENGINES:
        raise ValueError(f"{field_name}={backend!r}: use 'builtin', 'vllm' or 'sglang'")
    if importlib.util.find_spec(backend) is None:
        raise ValueError(
            f"{field_name}={backend!r} needs {backend}: pip install 'yatt-rollout[{backend}]'"
        )
    ENGINES[backend][1](**options)  # unknown or bad option: TypeError/ValueError naming it


DEFAULT_POLICY = {"lr": 2e-3, "dtype": "float32", "max_tokens_per_microbatch": 512}  # tiny model


def config_fields_help() -> str:
    """Every config field, its default and its doc line (policy: the torch backend's)."""
    lines = [line for line in core.describe_config(TrainConfig) if not line.startswith("policy ")]
    for line in core.describe_config(core.TorchPolicyConfig, prefix="policy."):
        name, _, rest = line.partition(" = ")
        key = name.removeprefix("policy.")
        if key in DEFAULT_POLICY:  # the embedded task's tiny-model defaults
            doc = rest.partition("  # ")[2]
            line = f"{name} = {DEFAULT_POLICY[key]!r}" + (f"  # {doc}" if doc else "")
        lines.append(line)
    return "config fields (YAML keys, or key.sub=value overrides):\n  " + "\n  ".join(lines)


def load_config(argv: list[str]) -> tuple[dict, bool]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=config_fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of TrainConfig fields")
    parser.add_argument("--resume", action="store_true", help="continue from out_dir's checkpoint")
    parser.add_argument("overrides", nargs="*", help="e.g. rollout.temperature=0.7")
    args = parser.parse_intermixed_args(argv)
    raw: dict = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    raw["policy"] = {**DEFAULT_POLICY, **raw.get("policy", {})}
    for item in args.overrides:
        dotted, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        *parents, leaf = dotted.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return raw, args.resume


def make_engine(backend: str, engine_config, options: dict, model_dir: str, device: str):
    """An engine (the policy's or the judge's): built-in by default, vLLM or SGLang by config."""
    if backend == "builtin":
        return rollout.BuiltinEngine(model_dir, config=replace(engine_config, device=device))
    engine_cls, config_cls = ENGINES[backend]  # checked when the config was built
    return engine_cls(model_dir, config=config_cls(**options))


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str):
    t0 = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0


TOKEN_KEYS = ("input_ids", "loss_mask", "rollout_logprobs")


def empty_batch() -> core.Batch:
    """A batch of no samples with the fields rollout_round's batches have."""
    placeholder = {
        "input_ids": [0],
        "loss_mask": [0],
        "rollout_logprobs": [0.0],
        "group_id": 0,
        "reward": 0.0,
    }
    return core.Batch.from_samples([placeholder], token_keys=TOKEN_KEYS).select([])


def count_verdicts(verdicts, seen: dict, ctx) -> None:
    """Verdict statuses into this step's counts; the step's first failure is kept for the log."""
    for verdict in verdicts:
        seen["verdicts"] += 1
        if verdict.status == "ok":
            continue
        seen["genrm_errors" if verdict.status == "error" else "genrm_unparsable"] += 1
        if ctx.first_failure is None:
            cause = verdict.error or f"no verdict in the judge's text {verdict.text[:200]!r}"
            ctx.first_failure = f"{verdict.status}: {cause}"


def prompt_ids_of(prompt, tok, should_apply_template: bool) -> list[int]:
    """Token ids of a row's prompt: a message list (or, when asked, plain text as one user
    message) through the tokenizer's chat template, with the assistant turn opened."""
    if not isinstance(prompt, list) and not should_apply_template:
        return tok(prompt, add_special_tokens=False)["input_ids"]
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def prompt_text_of(prompt) -> str:
    """What the judge reads as the prompt: a message list as "role: content" lines."""
    if isinstance(prompt, list):
        return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
    return prompt


def rollout_round(step, rows, ctx) -> core.Batch:
    """Generate n samples per prompt and score them; one scored Batch (groups stay here)."""
    cfg, tok, timings, seen = ctx.cfg, ctx.tokenizer, ctx.timings, ctx.seen
    if not rows:  # every row drawn was unusable (the loader counts why): the next round draws
        return empty_batch()
    should_template = cfg.data.apply_chat_template
    prompt_ids = [prompt_ids_of(r[cfg.data.prompt_key], tok, should_template) for r in rows]
    requests = [rollout.Request(prompt_ids=ids) for ids in prompt_ids]
    ctx.round += 1  # seeded by (seed, DP rank, step, round): resume and TP peers draw alike
    seed = cfg.seed * 1_000_003 + ctx.runtime.dp_rank * 10_007 + step * 101 + ctx.round
    sampling = rollout.SamplingParams(
        n=cfg.rollout.samples_per_prompt,
        temperature=cfg.rollout.temperature,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=seed % 2**31,
    )

    def to_sample(c, i=0):
        row = rows[c.request_index]
        reference = row.get(cfg.data.answer_key) if cfg.data.answer_key else None
        reference = None if reference is None else str(reference)  # e.g. an integer answer
        response = tok.decode(c.response_ids, skip_special_tokens=True)
        return genrm.Sample(
            prompt=prompt_text_of(row[cfg.data.prompt_key]),
            response=response,
            reference=reference,
            id=str(i),
        )

    if cfg.placement == "full":
        with timed(timings, "rollout"), ctx.plan.phase("rollout"):
            completions = ctx.engine.generate(requests, sampling)
        with timed(timings, "genrm"), ctx.plan.phase("genrm"):
            verdicts = ctx.scorer.score([to_sample(c, i) for i, c in enumerate(completions)])
    else:  # engine and judge both resident: the judge scores while the rollout's tail runs
        with timed(timings, "rollout+genrm"), ctx.plan.phase("rollout"):
            s = ctx.engine.stream(requests, sampling)
            scored = asyncio.run(genrm.score_as_completed(s, ctx.scorer, to_sample))
        completions, verdicts = scored
        # The next split of memory between the two follows this round's measured token loads.
        rollout_tokens = sum(len(c.prompt_ids) + len(c.response_ids) for c in completions)
        ctx.plan.update_load(
            rollout_pending_tokens=rollout_tokens,
            genrm_pending_tokens=scored.stats.num_judge_prompt_tokens,
        )
    count_verdicts(verdicts, seen, ctx)
    samples = []
    for i, (c, v) in enumerate(zip(completions, verdicts, strict=True)):
        seen["reward"] += v.reward
        seen["correct"] += ctx.exact.verify(to_sample(c, i)) or 0.0
        seen["length"] += len(c.response_ids)
        seen["count"] += 1
        samples.append(
            {
                "input_ids": c.prompt_ids + c.response_ids,
                "loss_mask": [0] * len(c.prompt_ids) + [1] * len(c.response_ids),
                "rollout_logprobs": [0.0] * len(c.prompt_ids) + list(c.logprobs),
                "group_id": c.request_index,
                "reward": float(v.reward),
            }
        )
    samples = core.broadcast_to_tp_peers(samples, ctx.runtime)  # TP peers: one batch (host sync)
    return core.Batch.from_samples(samples, token_keys=TOKEN_KEYS, like=empty_batch())


def summarize(local: dict[str, float], group) -> dict[str, float]:
    """One collective: sums for counts, max for phase times (the slowest rank sets the pace)."""
    ops = {k: "sum" if k.startswith("sum/") else "max" for k in local if k[:4] in ("sum/", "time")}
    g = core.reduce_metrics(local, group=group, ops=ops)
    count = max(g.pop("sum/count"), 1.0)
    return {
        "reward/mean": g.pop("sum/reward") / count,
        "reward/accuracy": g.pop("sum/correct") / count,
        "response/length_mean": g.pop("sum/length") / count,
        "genrm/verdicts": g.pop("sum/verdicts"),
        "genrm/errors": g.pop("sum/genrm_errors"),
        "genrm/unparsable": g.pop("sum/genrm_unparsable"),
        "data/skipped_rows": g.pop("sum/skipped_rows"),  # since the start, all ranks
        **g,
    }


def check_verdicts(step: int, metrics: dict, first_failure: str | None) -> None:
    """A step whose every verdict failed cannot learn: stop and say why, never train on zeros."""
    failed = metrics["genrm/errors"] + metrics["genrm/unparsable"]
    if failed and first_failure is not None:
        logger.warning(
            "step %d: %d of %d verdicts failed; first: %s",
            step,
            failed,
            metrics["genrm/verdicts"],
            first_failure,
        )
    if metrics["genrm/verdicts"] and failed == metrics["genrm/verdicts"]:
        raise RuntimeError(
            f"step {step}: every one of {failed:.0f} judge verdicts failed "
            f"({metrics['genrm/errors']:.0f} errors, {metrics['genrm/unparsable']:.0f} "
            f"unparsable); first on this rank: {first_failure or 'see the other ranks'}. Check "
            "reward.judge_template's fields, data.answer_key, and the judge's context length"
        )


def close_all(closeables, *, should_raise: bool) -> None:
    """Close each; a failure is logged and raised only when no earlier error is propagating."""
    errors = []
    for closeable in closeables:
        if closeable is None:
            continue
        try:
            closeable.close()
        except Exception as exc:  # keep closing the rest
            logger.exception("closing %s failed", type(closeable).__name__)
            errors.append(exc)
    if errors and should_raise:
        raise errors[0]


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    raw, should_resume = load_config(argv)
    # Every field but the policy's (its model_dir may be the embedded task's, not built yet) is
    # typed and range-checked here, before the runtime starts or any model loads.
    core.config_from_dict(TrainConfig, {**raw, "policy": "checked once its model_dir exists"})
    runtime = core.init_runtime(seed=raw.get("seed", 0), tp_size=raw["policy"].get("tp_size", 1))
    engine = judge_engine = ckpt = run_log = None
    is_failed = True  # until the loop ends: a close() error must not hide the loop's own
    try:
        workdir = Path(raw.get("out_dir", TrainConfig.out_dir)) / "embedded"
        tiny_task.fill_missing_paths(raw, workdir, RewardConfig.judge_template, runtime)
        raw["policy"].setdefault("temperature", raw.get("rollout", {}).get("temperature", 1.0))
        cfg = core.config_from_dict(TrainConfig, raw)
        device = str(runtime.device)
        ckpt = Checkpointer.from_config(Path(cfg.out_dir) / "checkpoints", cfg.ckpt)
        if should_resume and ckpt.latest() is None:  # said before any model loads
            raise ValueError(
                f"--resume: {cfg.out_dir}/checkpoints holds no checkpoint; run without --resume "
                "to start fresh, or point out_dir at the run to continue"
            )

        # -- setup: policy, rollout engine, judge, data shard, placement, checkpoints, logs ----
        policy = core.build_policy(cfg.backend, cfg.policy, runtime)
        rc, reward = cfg.rollout, cfg.reward
        engine = make_engine(
            rc.backend, rc.engine, rc.backend_options, cfg.policy.model_dir, device
        )
        judge_engine = make_engine(
            reward.backend, reward.engine, reward.backend_options, reward.judge_dir, device
        )
        tok = engine.tokenizer
        judge = genrm.GenRM(
            judge_engine,
            template=genrm.JudgeTemplate(user=cfg.reward.judge_template),
            parser=genrm.YesNoParser(),
            votes=cfg.reward.votes,
            sampling=rollout.SamplingParams(
                temperature=float(cfg.reward.votes > 1), max_new_tokens=4
            ),
        )
        exact = genrm.ExactMatch()  # ground truth for the accuracy metric (optional rule reward)
        rules = [(exact, cfg.reward.rule_weight)]
        scorer = genrm.CombinedRM(judge, rules) if cfg.reward.rule_weight else judge
        loader = core.ShardedLoader(
            cfg.data.path,
            batch_size=cfg.data.prompts_per_rank,
            rank=runtime.dp_rank,
            world_size=runtime.dp_size,
            prompt_key=cfg.data.prompt_key,
            seed=cfg.seed,
            max_prompt_tokens=cfg.rollout.engine.max_seq_len - cfg.rollout.max_new_tokens,
            count_tokens=lambda prompt: len(
                prompt_ids_of(prompt, tok, cfg.data.apply_chat_template)
            ),
        )
        roles = dict(rollout=engine, genrm=judge_engine, train=policy, offload=cfg.offload)
        make_plan = Plan.full_colocation if cfg.placement == "full" else Plan.partial_colocation
        plan = make_plan(**roles)
        ckpt.install_signal_handlers()  # SIGTERM/SIGUSR1: final save at the next boundary
        start_step = 0
        if not should_resume and ckpt.latest() is not None:  # never mix two runs' checkpoints
            raise ValueError(f"{cfg.out_dir} has checkpoints: pass --resume or a new out_dir")
        if should_resume:
            extra = ckpt.load(policy.state())
            loader.load_state_dict(extra["loader"])
            start_step = extra["step"] + 1
            engine.update_weights(policy.named_weights())  # the engine starts from the saved policy
            logger.info("resumed after step %d", extra["step"])
        run_log = core.RunLog(cfg.out_dir, is_writer=runtime.is_rank_zero, resume_step=start_step)
        ctx = SimpleNamespace(cfg=cfg, runtime=runtime, tokenizer=tok, plan=plan, engine=engine)
        ctx.__dict__.update(scorer=scorer, exact=exact, timings={}, judge=judge)

        # -- the GRPO loop ------------------------------------------------------------------
        bar = tqdm(range(start_step, cfg.num_steps), disable=not runtime.is_rank_zero, desc="grpo")
        for step in bar:
            counted = ("reward", "correct", "length", "count", "verdicts")
            ctx.seen = dict.fromkeys((*counted, "genrm_errors", "genrm_unparsable"), 0.0)
            ctx.first_failure = None
            ctx.timings, ctx.round = {"ckpt": ctx.timings.get("ckpt", 0.0)}, 0  # last save: late
            # rollout + GenRM; DAPO dynamic sampling drops zero-variance groups and refills
            batch, sampling_stats = core.sample_dynamically(
                lambda n, step=step: rollout_round(step, loader.next_batch(max(n, 1)), ctx),
                num_groups=cfg.data.prompts_per_rank,
                max_rounds=cfg.rollout.max_sampling_rounds,
                group=runtime.dp_group,
            )
            adv = core.compute_grpo_advantages(batch.samples["reward"], batch.samples["group_id"])
            batch.samples["advantages"] = adv  # local: a whole group lives on this rank
            with timed(ctx.timings, "balance"):  # lengths cross ranks; moved samples go p2p
                costs = flops_cost(
                    batch.lengths.tolist(),
                    hidden_size=policy.model_config.hidden_size,
                    num_layers=policy.model_config.num_hidden_layers,
                )
                batch, _ = batch.rebalance(
                    group=runtime.dp_group, group_key="group_id", costs=costs
                )
            with timed(ctx.timings, "train"), plan.phase("train"):
                batch = batch.to(runtime.device)
                if not cfg.loss.is_on_policy:  # else the loss reuses its forward's, detached
                    batch.tokens["old_logprobs"] = policy.logprobs(batch)
                train_metrics = policy.train_step(batch, cfg.loss)
            with timed(ctx.timings, "sync"), plan.phase("sync"):  # bucketed, no second copy
                engine.update_weights(policy.named_weights())
            local = {f"sum/{k}": v for k, v in ctx.seen.items()}
            local |= {f"time/{k}_s": v for k, v in ctx.timings.items()}
            local |= {f"dynamic_sampling/{k}": v for k, v in sampling_stats.items()}
            local["sum/skipped_rows"] = float(loader.num_skipped)
            metrics = summarize(local, runtime.dp_group)  # host sync: one small collective
            metrics |= {f"train/{k}": v for k, v in train_metrics.items()} | plan.metrics()
            run_log.log(step, metrics)
            check_verdicts(step, metrics, ctx.first_failure)
            postfix = {k: f"{v:.2f}s" for k, v in ctx.timings.items()}
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", **postfix)
            # Saved after the step's metrics line, so a committed step k implies lines 0..k.
            with timed(ctx.timings, "ckpt"):  # async: returns once tensors are staged
                extra = {"step": step, "loader": loader.state_dict()}
                decision = ckpt.maybe_save(step, policy.state(), phase="train", extra=extra)
            if decision.should_stop:
                logger.info("stop requested: step %d saved, exiting", step)
                break
        ckpt.wait()
        if runtime.is_rank_zero and (records := run_log.read()):
            first, last, keys = records[0], records[-1], ("reward/mean", "reward/accuracy")
            change = {k: f"{first[k]:.3f} -> {last[k]:.3f}" for k in keys}
            plot = run_log.plot([*keys, "response/length_mean"])
            logger.info("steps %d..%d: %s; plot %s", first["step"], last["step"], change, plot)
        is_failed = False
    finally:
        close_all((ckpt, run_log, judge_engine, engine), should_raise=not is_failed)
        runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
