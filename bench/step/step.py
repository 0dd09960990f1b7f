"""GRPO step time by GPU placement: full colocation, partial colocation, dedicated GenRM GPUs.

    python bench/step/step.py --layout full --tiny --steps 2                  # CPU smoke run
    python3 bench/step/step.py --layout full --out-dir OUT                    # 1 GPU
    python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
        bench/step/step.py --layout partial --out-dir OUT                     # 2 GPUs, one rank each
    python3 bench/step/step.py --layout dedicated --judge-gpu 1 --out-dir OUT # judge alone on GPU 1
    python3 -m torch.distributed.run --standalone --nproc_per_node 6 \
        bench/step/step.py --layout dedicated --judge-gpus 6,7 --shape 1.5b \
        --prompts-per-rank 64 --out-dir OUT                              # 6 policy + 2 judge GPUs
    python3 bench/step/step.py --report --results-dir OUT                     # tables, ratios, plot
    bash bench/step/step_gpu.sh                                               # all of it, on 2 GPUs
    bash bench/step/step_gpu8.sh                                              # the placements on 8 GPUs

Every layout runs the same work (_step_setup.py): a Qwen2.5-0.5B-shaped policy and a
same-shaped generative judge (random weights; --shape 1.5b, 3b or 7b for Qwen2.5-1.5B's, -3B's
or -7B's shape, and --judge-shape for a judge of another one), 16 prompts x 8 completions per step over all GPUs
(--prompts N over all; --prompts-per-rank N: N per GPU of the run, judge GPUs included, so
every layout on as many GPUs does the same work), prompts of 128 tokens, response lengths forced per sample (Request.max_new_tokens with
ignore_eos): `fixed` = 256 each, `longtail` = 90% in [64, 192] and 10% in [512, 1024]. The judge
reads prompt + response (about 300-1300 tokens) and writes an 8-token verdict.

The seed mix (`--mix seed`; _step_sampling.py): DAPO dynamic sampling by
core.DynamicSampler over an endless sequence of groups, half of them without reward variance
(--no-variance-share; each sample's verdict fixed by a hidden label, so every layout keeps the
same groups), longtail lengths, and by default a 1.5B-shaped judge writing a 384-token chain of
thought. full: rounds with adaptive over-sampling; partial: a stream (engine fed while verdicts
come back, groups judged as their samples finish, engine.abort() once every rank is full;
--keep-partial resumes the cut groups next step; --fill-probability 0.9 keeps in flight the
groups that fill the batch with that probability, not the expected number: a run "-fill0.9");
--sampler old: the round-based sampler drawing only the missing groups, the baseline of the
seed mix's bars (per kept group):

    python3 bench/step/step.py --layout partial --mix seed --offload auto --out-dir OUT
    ONLY=seed bash bench/step/step_gpu.sh                                     # the bars, 1 GPU

Layouts (one process per GPU; each step = rollout, GenRM, train, weight sync, checkpoint):
  full       Plan.full_colocation: every rank holds trainer (DDP), rollout engine and judge;
             phases in turn, each sleeping the others (--offload auto: only when short).
  partial    Plan.partial_colocation: rollout engine and judge resident together, the judge
             scoring each completion as it finishes (score_as_completed over engine.stream);
             the memory split follows the measured token loads.
  dedicated  --judge-gpus 6,7 (or --judge-gpu N, a pool of one): the judge runs alone on
             those GPUs for the whole step, one server process per listed GPU (yatt.genrm's
             HTTP app), data-parallel: every policy rank spreads its verdict requests over all
             of them (GenRMClient with the pool's URLs). The policy (rollout, train, sync: full
             colocation of those) runs data-parallel on the torchrun ranks, rank r on CUDA
             device LOCAL_RANK (so: --nproc_per_node 6 on GPUs 0-5 and --judge-gpus 6,7; the
             judge GPUs must not be policy GPUs) and waits for the verdicts, as a framework
             whose reward model owns its GPUs does. The node's local rank 0 starts the node's
             servers once, on ports --judge-port, +1, ...; every rank of the node waits for
             all of them (127.0.0.1: one node; more nodes would each start their own pool,
             untested). A GPU listed twice gets two servers (a smoke test of the pool on 2
             GPUs). Without --judge-gpu(s) (one GPU: nothing to dedicate) both stay resident
             with fixed memory shares (Plan.separate), labelled so.
Per step (after --warmup steps, 2 by default: see below): step time, phase times (max over
ranks), GPU busy fraction and peak memory per GPU, judge GPUs included (NVML sampled every 20
ms; n/a on CPU), checkpoint blocked time
(yatt.ckpt async save of the policy every step). One JSON per run, with the run's wall-clock
interval and host; --report combines them (medians with min and max, the ratios and their bars; a
ratio between runs that overlapped on one host is refused: run them one after another).

Warm-up: the first step creates AdamW's state (lazily, in its optimizer step); the second is the
first to offload that state, into pinned host memory allocated and touched then (about 4 GB:
+5 s in the switch into the rollout, measured on an H200 when one warm-up step was the
default). Two warm-up steps per mix put that first touch before the timed steps; the report's
"1st/median" column shows whether the first timed step is still an outlier.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _step_judge  # bench/ is not a package: these are its helper modules
import _step_memory
import _step_profile
import _step_report
import _step_sampling
import _step_setup as setup
from compile_scope import add_compile_scope_argument  # bench/_common, on the path by _step_setup

logger = logging.getLogger("bench.step")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=("full", "partial", "dedicated"))
    p.add_argument("--mix", default="fixed,longtail", help="comma list of " + str(setup.MIXES))
    p.add_argument("--steps", type=int, default=5, help="timed steps per mix")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps per mix first (2: the second offloads AdamW's state for the first "
        "time, into new pinned host memory, which made the first timed step an outlier)",
    )
    p.add_argument("--tiny", action="store_true", help="2-layer model (CPU smoke runs)")
    add_compile_scope_argument(p, named="the run is named -clayers")
    p.add_argument(
        "--judge-tokens",
        type=int,
        default=None,
        help=f"forced verdict length (8; with the seed mix {setup.SEED_JUDGE_TOKENS})",
    )
    p.add_argument(
        "--sampler",
        choices=_step_sampling.SAMPLERS,
        default="new",
        help="seed mix: core.DynamicSampler over-sampling (full: rounds, partial: stream with "
        "abort) or 'old', the round-based sampler drawing only the missing groups",
    )
    p.add_argument(
        "--keep-partial",
        action="store_true",
        help="seed mix, partial: keep the groups the abort cut and resume them next step",
    )
    p.add_argument(
        "--fill-probability",
        type=float,
        default=None,
        help="seed mix, --sampler new: draw (full: each round) or keep in flight (partial) the "
        "fewest groups that fill the batch with this probability, e.g. 0.9 (DynamicSampler's "
        "fill_probability; default: the expected number); the run is named -fill<q>",
    )
    p.add_argument(
        "--judge-batch-window-ms",
        type=float,
        default=None,
        help="colocated judge: after a streamed batch's first response, wait at most this long "
        "for more (genrm.BatchingConfig.batch_window_millis, default 20): fewer, larger judge "
        "calls and decode steps; the run is named -jw<ms>",
    )
    p.add_argument(
        "--no-variance-share",
        type=float,
        default=None,
        help=f"seed mix: share of groups without reward variance ({setup.SEED_NO_VARIANCE_SHARE})",
    )
    p.add_argument("--judge-gpu", type=int, default=None, help="dedicated: the judge's GPU")
    p.add_argument(
        "--judge-gpus",
        type=_gpu_list,
        default=None,
        help="dedicated: the judge pool's GPUs, one server each (e.g. 6,7; a GPU twice: two "
        "servers on it)",
    )
    p.add_argument("--shape", choices=tuple(setup.SHAPES), default="0.5b", help="policy's shape")
    p.add_argument(
        "--judge-shape",
        choices=tuple(setup.SHAPES),
        default=None,
        help=f"(default: --shape; with the seed mix {setup.SEED_JUDGE_SHAPE})",
    )
    p.add_argument("--profile", action="store_true", help="one more step under torch.profiler")
    p.add_argument("--profile-phase", default=None, help="--profile only this phase (e.g. train)")
    p.add_argument(
        "--offload", choices=("always", "auto"), default="always", help="Plan(offload=...)"
    )
    p.add_argument("--prompts", type=int, default=None, help="GRPO groups per step (16)")
    p.add_argument(
        "--prompts-per-rank",
        type=int,
        default=None,
        help="GRPO groups per step per GPU of the run, judge GPUs included (instead of --prompts)",
    )
    p.add_argument(
        "--no-keep-graphs",
        dest="keep_graphs",
        action="store_false",
        help="EngineConfig(keep_graphs_asleep=False): recapture the graphs after each wake",
    )
    p.add_argument(
        "--rollout-backend",
        choices=("builtin", "vllm", "sglang"),
        default="builtin",
        help="the rollout engine (vLLM/SGLang: full and partial layouts, yatt-rollout[vllm|sglang])",
    )
    p.add_argument(
        "--engine-memory",
        type=float,
        default=0.3,
        help="vLLM/SGLang: the GPU share the rollout engine takes at start-up",
    )
    p.add_argument(
        "--engine-kwargs",
        type=json.loads,
        default={},
        help='vLLM/SGLang: more engine arguments as JSON, e.g. \'{"attention_backend": "triton"}\'',
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=_tokens_or_auto,
        default=16384,
        help="trainer's cap; 'auto': chosen from free memory at the first train step",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="TorchPolicyConfig(gradient_checkpointing=True)",
    )
    p.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="TorchPolicyConfig(should_offload_optimizer=True): AdamW's state on the host "
        "except for its step (a 7B policy on one GPU)",
    )
    p.add_argument(
        "--no-ckpt",
        dest="ckpt",
        action="store_false",
        help="no checkpoint per step (a 7B policy's is 91 GB of weights and AdamW state)",
    )
    p.add_argument("--ckpt-writer", choices=("thread", "process"), default="thread")
    p.add_argument("--ckpt-when-busy", choices=("wait", "defer"), default="wait")
    p.add_argument("--judge-port", type=int, default=18517)
    p.add_argument("--serve-judge", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--judge-slots",
        type=int,
        default=None,
        help="the colocated judge engine's slots (default: the rollout engine's: 8 x prompts, "
        "x2 in the seed mix); every step decodes all of them, used or not",
    )
    p.add_argument(
        "--run-budget-s",
        type=float,
        default=None,
        help="seconds this run may take from its start: no timed step starts that would end "
        "past it (at least one runs); the JSON records how many were left out",
    )
    p.add_argument("--prepare", action="store_true", help="only save the models, then exit")
    p.add_argument("--model-dir", default=None, help="saved models (made once if missing)")
    p.add_argument("--out-dir", default="bench/results/step_runs")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint root (default: see below)")
    p.add_argument("--report", action="store_true", help="combine the runs in --results-dir")
    p.add_argument("--results-dir", default=None)
    args = p.parse_args(argv)
    if not (args.report or args.serve_judge or args.prepare or args.layout):
        p.error("pass --layout, or --report")
    if args.rollout_backend != "builtin" and args.layout not in (None, "full", "partial"):
        p.error(f"--rollout-backend {args.rollout_backend}: only --layout full or partial")
    if args.judge_gpu is not None and args.judge_gpus is not None:
        p.error("pass --judge-gpu N or --judge-gpus LIST, not both")
    if args.judge_gpu is not None:
        args.judge_gpus = [args.judge_gpu]  # a pool of one
    if args.judge_gpus and args.layout not in (None, "dedicated"):
        p.error(f"--judge-gpu(s): only with --layout dedicated, not {args.layout}")
    if args.prompts is not None and args.prompts_per_rank is not None:
        p.error("pass --prompts (over all GPUs) or --prompts-per-rank, not both")
    for name in ("prompts", "prompts_per_rank", "judge_slots"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    args.mixes = [m for m in args.mix.split(",") if m]
    for mix in args.mixes:
        if mix not in setup.MIXES:
            p.error(f"--mix {mix!r}: use {setup.MIXES}")
    is_seed = "seed" in args.mixes
    # The seed mix's workload: a 1.5B judge writing a chain of thought.
    if args.judge_tokens is None:
        args.judge_tokens = setup.SEED_JUDGE_TOKENS if is_seed else 8
    if args.judge_tokens < 1:
        p.error(f"--judge-tokens {args.judge_tokens}: must be >= 1")
    if is_seed and args.judge_shape is None and not args.tiny:
        args.judge_shape = setup.SEED_JUDGE_SHAPE
    if args.no_variance_share is not None and not 0.0 <= args.no_variance_share < 1.0:
        p.error(f"--no-variance-share {args.no_variance_share}: must be in [0, 1)")
    if args.run_budget_s is not None and not args.run_budget_s > 0:
        p.error(f"--run-budget-s {args.run_budget_s}: must be > 0 (seconds), e.g. 110")
    if args.keep_partial and (args.layout != "partial" or args.sampler != "new" or not is_seed):
        p.error("--keep-partial: only with --layout partial, --sampler new and the seed mix")
    if args.judge_batch_window_ms is not None:
        if not args.judge_batch_window_ms >= 0:
            p.error(f"--judge-batch-window-ms {args.judge_batch_window_ms}: must be >= 0, e.g. 200")
        if args.layout not in ("full", "partial"):
            p.error(
                "--judge-batch-window-ms: only with --layout full or partial (a colocated judge)"
            )
    if args.fill_probability is not None:
        if args.sampler != "new" or not is_seed:
            p.error("--fill-probability: only with the seed mix and --sampler new")
        if not 0.0 < args.fill_probability < 1.0:
            p.error(f"--fill-probability {args.fill_probability}: must be in (0, 1), e.g. 0.9")
    if args.model_dir is None:
        shapes = setup.shape_names(args)
        name = "yatt-step" + ("" if shapes == ("0.5b", "0.5b") else "-" + "-".join(shapes))
        args.model_dir = str(
            Path(tempfile.gettempdir()) / ("yatt-step-tiny" if args.tiny else name)
        )
    return args


def _tokens_or_auto(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a token count or 'auto'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a token count >= 1, or 'auto'")
    return value


def _gpu_list(text: str) -> list[int]:
    try:
        gpus = [int(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices, comma-separated (6,7)") from None
    if not gpus or min(gpus) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices >= 0, comma-separated (6,7)")
    return gpus


# -- one run ------------------------------------------------------------------------------------
def build(args: argparse.Namespace, runtime, servers: list) -> SimpleNamespace:
    """Engines, judge, trainer, plan and checkpointer of this rank for args.layout."""
    import torch

    from yatt import core, genrm
    from yatt.ckpt import Checkpointer
    from yatt.placement import Plan

    layout = args.layout
    if layout == "dedicated" and not args.judge_gpus:
        layout = "separate"
    if layout == "separate" and runtime.dp_size > 1:
        raise ValueError("--layout dedicated without --judge-gpu(s) runs one process (1 GPU)")
    judge_gpus = args.judge_gpus if layout == "dedicated" else []
    work = setup.workload(args, num_gpus=runtime.world_size + len(set(judge_gpus)))
    shapes = setup.shape_names(args)
    if runtime.is_rank_zero:
        setup.make_models(Path(args.model_dir), tiny=args.tiny, shapes=shapes)
    torch.distributed.barrier()
    policy_dir, judge_dir = setup.make_models(Path(args.model_dir), tiny=args.tiny, shapes=shapes)
    ctx = SimpleNamespace(args=args, work=work, runtime=runtime, layout=layout, servers=[])
    ctx.shapes = shapes
    ctx.prompts = setup.prompt_range(work.num_prompts, runtime.dp_size, runtime.dp_rank)
    if not ctx.prompts:
        raise ValueError(f"{work.num_prompts} prompts leave rank {runtime.dp_rank} none")
    slots = len(ctx.prompts) * work.group_size
    if "seed" in args.mixes:  # over-sampling: about 1 / keep rate as many samples at once
        slots *= 2
    device = str(runtime.device)
    ctx.judge_gpus = judge_gpus
    if layout == "dedicated":
        _step_judge.check_judge_gpus(judge_gpus, runtime)
        if runtime.local_rank == 0:  # the node's pool, started once
            ctx.servers = _step_judge.start_judge_servers(args, __file__, work)
            servers += ctx.servers  # killed by the caller if the rest of the build fails
    ctx.engine = setup.make_rollout_engine(
        args, policy_dir, device=device, work=work, max_batch_size=slots
    )
    ctx.judge_engine = None
    if layout == "dedicated":
        urls = _step_judge.wait_for_judges(ctx.servers, args.judge_port, len(judge_gpus))
        # score() cuts this rank's samples into one request per server (at most `slots` each);
        # a server joins the ranks' concurrent requests into its running decode.
        ctx.judge = genrm.GenRMClient(urls, batching=genrm.BatchingConfig(max_batch_size=slots))
    else:
        ctx.judge, ctx.judge_engine = setup.build_judge(
            judge_dir,
            device=device,
            tiny=args.tiny,
            work=work,
            slots=args.judge_slots or slots,
            keep_graphs=args.keep_graphs,
            batch_window_ms=args.judge_batch_window_ms,
            compile_scope=args.compile_scope,
        )
    ctx.policy = core.TorchPolicy(
        core.TorchPolicyConfig(
            model_dir=str(policy_dir),
            lr=1e-6,
            dtype="float32" if args.tiny else "bfloat16",
            # 152k vocab: 16k tokens hold 10 GB of float32 logits (x3 with their gradient), but
            # fewer micro-batches cut the host's launch overhead, which bounds this small model.
            max_tokens_per_microbatch=2048 if args.tiny else args.micro_batch_tokens,
            gradient_checkpointing=args.activation_checkpointing,
            should_offload_optimizer=args.offload_optimizer,
        ),
        runtime,
    )
    # the trainer's own sync (train_grpo's WeightSync: bench/ imports the trainer's step module)
    ctx.sync = _step_sampling.trainer().WeightSync(
        ctx.engine,
        ctx.policy,
        is_lora=getattr(ctx.policy.config, "lora", None) is not None,
        engine_device=runtime.device,  # every layout here puts the engine on the rank's GPU
        trainer_device=runtime.device,
    )
    roles = dict(rollout=ctx.engine, train=ctx.policy)
    offload = args.offload  # "auto": a role sleeps only when the next phase would not fit
    if layout == "full":
        ctx.plan = Plan.full_colocation(**roles, genrm=ctx.judge_engine, offload=offload)
    elif layout == "partial":
        ctx.plan = Plan.partial_colocation(**roles, genrm=ctx.judge_engine, offload=offload)
    elif layout == "dedicated":
        ctx.plan = Plan.full_colocation(**roles, offload=offload)  # rollout + trainer share it
    else:
        ctx.plan = Plan.separate(**roles, genrm=ctx.judge_engine)
        if runtime.device.type == "cuda":  # fixed shares of the one GPU, never moved
            ctx.engine.set_memory_fraction(0.3)
            ctx.judge_engine.set_memory_fraction(0.3)
    root = Path(args.ckpt_dir) if args.ckpt_dir else setup.default_ckpt_root(args.tiny)
    ctx.ckpt_root = root / f"{layout}_{runtime.world_size}"
    if runtime.is_rank_zero:
        shutil.rmtree(ctx.ckpt_root, ignore_errors=True)
    torch.distributed.barrier()
    how = dict(writer=args.ckpt_writer, when_busy=args.ckpt_when_busy)
    ctx.ckpt = Checkpointer(ctx.ckpt_root, keep_last=1, every_steps=1, **how)
    # One optimizer step per batch (as TRL at num_iterations=1): no old-logprob forward pass.
    ctx.loss = core.PolicyLoss(is_on_policy=True)
    ctx.judge_tokens_seen = ctx.judge_batches_seen = ctx.judge_joins_seen = 0
    # The seed mix: one dynamic sampler for the run (its keep rate carries over), and the
    # groups an abort cut when they are resumed (--keep-partial).
    ctx.sampler = _step_sampling.make_sampler(ctx) if "seed" in args.mixes else None
    ctx.partials = _step_sampling.make_partials(ctx) if "seed" in args.mixes else None
    return ctx


def one_step(ctx, mix: str, step: int, global_step: int) -> dict:
    import torch

    from yatt import core

    rt, plan, judge, policy = ctx.runtime, ctx.plan, ctx.judge, ctx.policy
    phases: dict[str, float] = {}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    if mix == "seed":
        batch, counts, extra = _seed_rollout(ctx, step, phases)
    else:
        batch, counts, extra = _rollout(ctx, mix, step, phases)
    batch.samples["advantages"] = core.compute_grpo_advantages(
        batch.samples["reward"], batch.samples["group_id"]
    )
    with _step_profile.timed(phases, "train"):
        # The policy's own cost model: balancing weighs samples as its micro-batch packing does.
        costs = policy.estimate_batch_costs(batch)
        batch, _ = batch.rebalance(group=rt.dp_group, group_key="group_id", costs=costs)
        with plan.phase("train"):  # the trainer's own updates (ctx.loss: one, on-policy)
            _step_sampling.trainer().train_on_batch(
                batch,
                policy=policy,
                reference=None,
                loss=ctx.loss,
                costs=None,  # (one mini-batch: no split to weigh)
                device=rt.device,
                seed=0,
                step=global_step,
            )
    with _step_profile.timed(phases, "sync"), plan.phase("sync"):
        # the trainer's sync (full weights, the LoRA adapter, or the adapter bound), its call
        # timed alone too: the phase also holds the plan's bookkeeping around its switch
        sync_call_s = _step_profile.device_seconds(ctx.sync)
    with _step_profile.timed(phases, "ckpt"):  # async: blocks until staged in host memory
        if ctx.args.ckpt:
            ctx.ckpt.maybe_save(global_step + 1, policy.state(), extra={"step": global_step})
    torch.distributed.barrier()
    t1 = time.perf_counter()
    # The judge's load this step: this rank's (a pool's servers also judge the other ranks').
    if ctx.layout != "dedicated":
        judge_prompt_tokens = judge.metrics["num_prompt_tokens"] - ctx.judge_tokens_seen
        ctx.judge_tokens_seen += judge_prompt_tokens
    if "judge_prompt_tokens" in counts:  # the seed mix counts its verdicts' own
        judge_prompt_tokens = counts["judge_prompt_tokens"]
    elif ctx.layout == "dedicated":
        judge_prompt_tokens = sum(v.num_judge_prompt_tokens for v in counts["verdicts"])
    metrics = plan.metrics()  # the latest switch into each phase: this step's
    switches = {k.split("/")[1]: v for k, v in metrics.items() if k.endswith("/switch_s")}
    memory = _step_memory.timeline(metrics, plan.phases)
    return {
        "t0": t0,
        "t1": t1,
        "phases": phases,
        "switch_s": sum(switches.values()),
        "switches": switches,
        "sync_call_s": sync_call_s,
        "bad_lengths": counts["bad_lengths"],
        "num_completions": counts["num_completions"],
        "response_tokens": counts["response_tokens"],
        "judge_prompt_tokens": judge_prompt_tokens,
        "num_unparsable": counts["num_unparsable"],
        # The plan resets torch's peak stats at each switch (its peak reader): the step's peak is
        # the highest phase peak of its timeline, device-wide.
        "max_reserved_gib": _step_memory.step_peak_gib(memory)
        if torch.cuda.is_available()
        else None,
        "memory": memory,
        **extra,
    }


def _rollout(ctx, mix: str, step: int, phases: dict[str, float]):
    """Every prompt of this rank, once (fixed, longtail): (batch, counts, extra)."""
    from yatt import core, genrm

    requests, sampling, expected, prompts = setup.make_requests(ctx, mix, step)

    def to_sample(c):
        return genrm.Sample(
            prompt=prompts[c.request_index], response=setup.ids_to_text(c.response_ids)
        )

    completions, verdicts, tail_s = _step_sampling.generate_and_score(
        ctx, phases, requests, sampling, to_sample
    )
    extra = {}
    if tail_s is not None:  # partial: the judge scored each completion as it landed
        phases["genrm_tail"] = tail_s
        # Did the judge's batches join its running decode (yatt.rollout), or run one by one?
        extra = _judge_calls(ctx)  # (the split moved in generate_and_score)
    bad_lengths = sum(len(c.response_ids) != expected[c.request_index] for c in completions) + abs(
        len(completions) - len(expected)
    )
    samples = core.rollout_samples(
        completions,
        rewards=[v.reward for v in verdicts],
        group_ids=[c.metadata["group"] for c in completions],
    )
    batch = core.rollout_batch(samples)
    counts = {
        "bad_lengths": bad_lengths,
        "num_completions": len(completions),
        "response_tokens": sum(len(c.response_ids) for c in completions),
        "num_unparsable": sum(v.status != "ok" for v in verdicts),
        "verdicts": verdicts,
    }
    return batch, counts, extra


def _seed_rollout(ctx, step: int, phases: dict[str, float]):
    """The seed mix: dynamic sampling (_step_sampling.py): (kept batch, counts, extra)."""
    if ctx.sampler.mode == "stream":
        batch, stats, tally = _step_sampling.stream_step(ctx, step, phases)
    else:
        batch, stats, tally = _step_sampling.rounds_step(ctx, step, phases)
    if ctx.layout == "partial":  # the judge's work after the rollout stopped
        phases["genrm_tail"] = tally.genrm_tail_s
    counts = {
        "bad_lengths": tally.bad_lengths,
        "num_completions": tally.num_completions,
        "response_tokens": tally.response_tokens,
        "num_unparsable": tally.num_unparsable,
        "judge_prompt_tokens": tally.judge_prompt_tokens,
    }
    sampling = stats | {
        "num_tokens_generated": float(tally.response_tokens),
        "num_groups_resumed": float(tally.num_resumed_groups),
        "num_groups_kept_partial": float(tally.num_kept_partial),
    }
    return batch, counts, {"sampling": sampling} | _judge_calls(ctx)


def _judge_calls(ctx) -> dict[str, int]:
    """This step's judge batches and the engine calls that joined its running decode (a
    judge fed sample by sample: few joins would mean its batches ran one after another)."""
    if ctx.judge_engine is None:  # dedicated: the servers' own
        return {}
    extra = {"judge_batches": ctx.judge.metrics["num_batches"] - ctx.judge_batches_seen}
    extra["judge_joined_calls"] = ctx.judge_engine.num_joined_calls - ctx.judge_joins_seen
    ctx.judge_batches_seen += extra["judge_batches"]
    ctx.judge_joins_seen += extra["judge_joined_calls"]
    return extra


def run_layout(args: argparse.Namespace) -> Path | None:
    import torch

    from yatt import core

    started_at = time.time()  # wall clock: the report compares it across processes
    if args.tiny:  # tiny models gain nothing from intra-op threads on a shared CPU
        torch.set_num_threads(1)
    runtime = core.init_runtime(seed=0)
    ctx = None
    sampler = None
    servers: list[subprocess.Popen] = []
    try:
        ctx = build(args, runtime, servers)
        gpus = []
        if runtime.device.type == "cuda":
            gpus = [setup.physical_gpu(runtime.device.index)]
            if runtime.local_rank == 0:  # the judge pool's GPUs, sampled once
                gpus += sorted(setup.physical_gpu(g) for g in set(ctx.judge_gpus))
        sampler = setup.GpuSampler(gpus).start()
        per_mix: dict[str, list[dict]] = {}
        num_skipped = 0  # timed steps --run-budget-s left out
        global_step = 0
        for mix in args.mixes:
            rows = []
            for step in range(args.warmup + args.steps):
                if _past_budget(args, runtime, started_at, rows):
                    num_skipped += args.warmup + args.steps - step
                    break
                try:
                    row = one_step(ctx, mix, step, global_step)
                except Exception as exc:
                    if _step_memory.is_out_of_memory(exc):  # the 7B run's bar counts them
                        _step_memory.write_oom(args.out_dir, ctx, mix, step, exc)
                    raise
                global_step += 1
                row["gpus"] = sampler.window(row["t0"], row["t1"])
                row["is_warmup"] = step < args.warmup
                rows.append(row)
                if runtime.is_rank_zero:
                    parts = " ".join(f"{k} {v:.2f}" for k, v in row["phases"].items())
                    tag = "warmup" if row["is_warmup"] else "timed"
                    print(
                        f"[{ctx.layout} x{runtime.world_size} {mix}] step {step} {tag} "
                        f"{row['t1'] - row['t0']:.2f}s: {parts}",
                        flush=True,
                    )
            if args.profile or args.profile_phase:  # after the timed steps: counts in none
                only = f"_{args.profile_phase}" if args.profile_phase else ""
                variant = setup.variant_key(ctx.layout, args, runtime.world_size)
                name = f"profile_{variant}_{runtime.world_size}x_{mix}{only}.txt"
                path = Path(args.out_dir) / name if runtime.is_rank_zero else None
                with _step_profile.maybe_profile(path, phase=args.profile_phase):
                    one_step(ctx, mix, args.warmup + args.steps, global_step)
                global_step += 1
            per_mix[mix] = rows
        ctx.ckpt.wait()
        ended_at = time.time()
        gathered = [None] * runtime.world_size
        torch.distributed.all_gather_object(gathered, per_mix)
        if runtime.is_rank_zero:
            return _step_report.write_run(
                args.out_dir,
                layout=ctx.layout,
                variant=setup.variant_key(ctx.layout, args, runtime.world_size),
                num_ranks=runtime.world_size,
                tiny=args.tiny,
                judge_pool=_step_judge.pool_record(ctx) if ctx.layout == "dedicated" else None,
                workload=vars(ctx.work)
                | {"prompts_per_rank": args.prompts_per_rank}
                | {"policy_shape": ctx.shapes[0], "judge_shape": ctx.shapes[1]}
                | {"mixes": args.mixes, "steps": args.steps, "warmup": args.warmup}
                | {"keep_graphs_asleep": args.keep_graphs, "offload": args.offload}
                | {"micro_batch_tokens": args.micro_batch_tokens, "ckpt_writer": args.ckpt_writer}
                | {"chosen_micro_batch_tokens": ctx.policy.max_tokens_per_microbatch}
                | {"activation_checkpointing": args.activation_checkpointing}
                | {"offload_optimizer": args.offload_optimizer, "ckpt": args.ckpt}
                | {"ckpt_when_busy": args.ckpt_when_busy}
                | {"ckpt_deferred": ctx.ckpt.num_deferred_saves}
                | {"run_budget_s": args.run_budget_s, "steps_left_out": num_skipped},
                ckpt_root=str(ctx.ckpt_root.parent),
                by_mix={mix: [g[mix] for g in gathered] for mix in args.mixes},
                started_at=started_at,
                ended_at=ended_at,
            )
        return None
    finally:
        if sampler is not None:
            sampler.stop()
        if ctx is not None:
            setup.close_run(ctx)
        for server in servers:
            if server.poll() is None:
                server.kill()
        runtime.shutdown()


def past_budget(budget_s: float | None, elapsed_s: float, rows: list[dict]) -> bool:
    """Whether the next step would end past `budget_s` (seconds from the run's start), judged
    by the last step's length; never before one timed step has run."""
    timed = [r for r in rows if not r["is_warmup"]]
    if budget_s is None or not timed:
        return False
    return elapsed_s + (rows[-1]["t1"] - rows[-1]["t0"]) > budget_s


def _past_budget(args, runtime, started_at: float, rows: list[dict]) -> bool:
    """past_budget on rank 0's clock, the same answer on every rank."""
    import torch

    answer = [past_budget(args.run_budget_s, time.time() - started_at, rows)]
    if runtime.world_size > 1 and args.run_budget_s is not None:
        torch.distributed.broadcast_object_list(answer, src=0)
    return bool(answer[0])


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    # Random-weight verdicts never parse (reward 0 by design here); one line each is noise.
    logging.getLogger("yatt.genrm").setLevel(logging.ERROR)
    args = parse_args(argv)
    if args.report:
        _step_report.write_report(Path(args.results_dir or args.out_dir))
    elif args.prepare:
        shapes = setup.shape_names(args)
        print(setup.make_models(Path(args.model_dir), tiny=args.tiny, shapes=shapes), flush=True)
    elif args.serve_judge:
        _step_judge.serve_judge(args)
    else:
        run_layout(args)


if __name__ == "__main__":
    main(sys.argv[1:])
