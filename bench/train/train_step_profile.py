"""Where the policy's train step spends its time, by batch shape and micro-batch plan (one GPU).

The long-tail mix of bench/step/step.py trains 39.8k tokens in 1.73 s where the fixed mix
trains 49.2k in 0.82 s (bench/results/verl_nvidia_h200.md). This times `TorchPolicy.train_step`
alone on the same shapes (the Qwen2.5-0.5B shape, random weights, bf16 compute, 16k-token
micro-batches, GRPO loss with one optimizer step per batch), then varies one thing at a time:

    fixed              128 rows of 128 + 256 tokens: no padding
    fixed_masked       the same with one row a token shorter: the padded-batch attention path
    longtail           bench/step's long-tail lengths, the policy's own plan
    longtail_cap_only  the plan before fbb579c: cost-packed bins cut only at the token cap
    longtail_sorted    rows sorted by length, filled greedily to the cap (fewest micro-batches
                       at little padding)
    longtail_fresh     long-tail batches whose shapes no earlier step had (as in a run, where
                       lengths differ every step), timed on their first and only step

and profiles one fixed and one long-tail step (CUDA kernels by kind, the host's share).
With --compile-head, a second policy with TorchPolicyConfig.compile_head_logprobs (the head's
logprob chunks through torch.compile) times the same fixed and long-tail batches:

    fixed_compiled_head     as fixed, compiled head chunks
    longtail_compiled_head  as longtail, compiled head chunks

after checking that both policies give the same logprobs (before either has trained).

    python3 bench/train/train_step_profile.py --out bench/results/train_step_profile_<gpu>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "step"))
sys.path.insert(0, str(ROOT / "bench" / "rollout"))

from _decode_profile import _kernel_table  # noqa: E402
from _step_setup import _longtail_lengths, make_models  # noqa: E402

from yatt import core  # noqa: E402
from yatt.balance import pack  # noqa: E402
from yatt.core import Batch  # noqa: E402

PROMPT_TOKENS = 128


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


NUM_SAMPLES = 128  # 16 prompts x 8 samples, as bench/step
GROUP_SIZE = 8


def make_batch(response_lengths: list[int], seed: int, vocab: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(response_lengths):
        length = PROMPT_TOKENS + n
        mask = torch.zeros(length, dtype=torch.int64)
        mask[PROMPT_TOKENS:] = 1
        rows.append(
            {
                "input_ids": torch.randint(3, min(vocab, 5000), (length,), generator=gen),
                "loss_mask": mask,
                "group_id": i // GROUP_SIZE,
                "reward": float(i % 2),
            }
        )
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    batch.samples["advantages"] = core.compute_grpo_advantages(batch["reward"], batch["group_id"])
    return batch


def plan_cap_only(lengths: list[int], costs: list[float], cap: int) -> list[list[int]]:
    """Cost-packed bins, each cut in pack order where rows x longest row would pass the cap."""
    out = []
    for index in pack(costs, max_tokens=cap, lengths=lengths, allow_oversize=True):
        part: list[int] = []
        for i in index:
            longest = max([lengths[j] for j in part] + [lengths[i]])
            if part and (len(part) + 1) * longest > cap:
                out.append(part)
                part = []
            part.append(i)
        out.append(part)
    return out


def plan_sorted(lengths: list[int], cap: int) -> list[list[int]]:
    """Rows longest first, each micro-batch filled until rows x its first row would pass the cap."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= cap:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def padded_tokens(plan: list[list[int]], lengths: list[int]) -> int:
    return sum(len(p) * max(lengths[i] for i in p) for p in plan if p)


def time_steps(
    policy, loss_fn, batches: list[Batch], plan_fn=None, repeats: int = 1, warmup: bool = True
) -> dict:
    """Median wall time of train_step over `batches` (after one warm-up step on the first,
    unless `warmup` is False: then every batch is timed on its first step)."""
    original = policy.plan_micro_batches
    if plan_fn is not None:
        policy.plan_micro_batches = lambda b: plan_fn(b.lengths.tolist())
    try:
        first_s = None
        if warmup:
            start = time.perf_counter()
            policy.train_step(batches[0], loss_fn)
            _sync()
            first_s = time.perf_counter() - start  # with torch.compile: compiling included
        times, plans = [], []
        for _ in range(repeats):
            for b in batches:
                plan = policy.plan_micro_batches(b)
                plans.append((len(plan), padded_tokens(plan, b.lengths.tolist())))
                start = time.perf_counter()
                policy.train_step(b, loss_fn)
                _sync()
                times.append(time.perf_counter() - start)
            # forward only (the logprobs pass), for the forward/backward split
        fwd = []
        for b in batches:
            start = time.perf_counter()
            policy.logprobs(b)
            _sync()
            fwd.append(time.perf_counter() - start)
    finally:
        policy.plan_micro_batches = original
    tokens = [int(b.lengths.sum()) for b in batches]
    return {
        "steps_s": [round(t, 4) for t in times],
        "warmup_s": first_s,
        "step_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "logprobs_s": statistics.median(fwd),
        "tokens": statistics.median(tokens),
        "micro_batches": statistics.median(p[0] for p in plans),
        "padded_tokens": statistics.median(p[1] for p in plans),
    }


def kernel_profile(policy, loss_fn, batch: Batch) -> dict:
    from torch.profiler import ProfilerActivity, profile

    policy.train_step(batch, loss_fn)
    _sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        policy.train_step(batch, loss_fn)
        _sync()
    wall_s = time.perf_counter() - start
    table = _kernel_table(prof, num_steps=1)
    ops = sorted(
        (e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: -e.self_cpu_time_total,
    )[:15]
    return {
        "wall_ms_profiled": wall_s * 1e3,
        **table,
        "top_host_ops": [
            {"name": e.key[:80], "ms": round(e.self_cpu_time_total / 1e3, 2), "count": e.count}
            for e in ops
        ],
    }


def compare_logprobs(eager, compiled, batch: Batch) -> dict:
    """How far the compiled head's logprobs are from the eager ones on the response tokens (bf16
    compute: rounding-level), and the first (compiling) logprobs pass's time."""
    start = time.perf_counter()
    got = compiled.logprobs(batch)
    _sync()
    first_s = time.perf_counter() - start
    expected = eager.logprobs(batch)
    mask = batch["loss_mask"].bool()
    diff = (got.float().cpu() - expected.float().cpu())[mask].abs()
    return {
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "first_logprobs_s": first_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=None, help="saved models (bench/step's, made if missing)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3, help="long-tail batches timed (steps 2..)")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a smoke run")
    p.add_argument(
        "--compile-head",
        action="store_true",
        help="also time fixed and longtail with compile_head_logprobs (a second policy)",
    )
    args = p.parse_args()
    if not (torch.cuda.is_available() or args.tiny):
        sys.exit("train_step_profile: needs a CUDA device (or --tiny for a CPU smoke run)")
    root = Path(args.model_dir or tempfile.mkdtemp(prefix="yatt-train-profile-"))
    policy_dir, _ = make_models(root, tiny=args.tiny)
    cap = args.micro_batch_tokens
    config = core.TorchPolicyConfig(
        model_dir=str(policy_dir),
        lr=1e-6,
        dtype="bfloat16",
        parallel="none",
        max_tokens_per_microbatch=cap,
        compile_head_logprobs=False,  # the eager baseline (None compiles on CUDA)
    )
    policy = core.TorchPolicy(config)
    # Same weights (the same saved model), loaded before either policy trains.
    compiled = (
        core.TorchPolicy(dataclasses.replace(config, compile_head_logprobs=True))
        if args.compile_head
        else None
    )
    loss_fn = core.PolicyLoss(is_on_policy=True)
    vocab = policy.module.config.vocab_size
    fixed = [make_batch([256] * NUM_SAMPLES, seed=s, vocab=vocab) for s in range(2)]
    masked = [make_batch([256] * (NUM_SAMPLES - 1) + [255], seed=s, vocab=vocab) for s in range(2)]
    longtail = [
        make_batch(
            _longtail_lengths(np.random.default_rng([0, step, 1]), NUM_SAMPLES),
            seed=step,
            vocab=vocab,
        )
        for step in range(2, 2 + args.steps)
    ]

    def cost_of(lengths):  # the shape of the policy's own cost model, for pack's balance
        return [float(n) for n in lengths]

    def report(name, r):
        print(
            f"{name:22s} step {r['step_s']:.3f} s ({r['min_s']:.3f}-{r['max_s']:.3f}) "
            f"logprobs {r['logprobs_s']:.3f} s  tokens {r['tokens']:.0f} padded "
            f"{r['padded_tokens']:.0f} micro-batches {r['micro_batches']:.0f}  "
            f"steps {r['steps_s']}",
            flush=True,
        )

    results = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "micro_batch_tokens": cap,
        "runs": {},
    }
    if compiled is not None:
        results["compiled_head_check"] = compare_logprobs(policy, compiled, fixed[0])
        print("compiled head vs eager logprobs:", results["compiled_head_check"], flush=True)
    runs = {
        "fixed": (fixed, None),
        "fixed_masked": (masked, None),
        "longtail": (longtail, None),
        "longtail_cap_only": (longtail, lambda n: plan_cap_only(n, cost_of(n), cap)),
        "longtail_sorted": (longtail, lambda n: plan_sorted(n, cap)),
    }
    for name, (batches, plan_fn) in runs.items():
        r = time_steps(policy, loss_fn, batches, plan_fn, repeats=2)
        results["runs"][name] = r
        report(name, r)
    # Shapes no earlier step had: seeds far from the ones above, each batch timed once.
    fresh = [
        make_batch(
            _longtail_lengths(np.random.default_rng([0, step, 1]), NUM_SAMPLES),
            seed=step,
            vocab=vocab,
        )
        for step in range(100, 100 + 2 * args.steps)
    ]
    r = time_steps(policy, loss_fn, fresh, None, repeats=1, warmup=False)
    results["runs"]["longtail_fresh"] = r
    report("longtail_fresh", r)
    if compiled is not None:
        for name, batches in (("fixed", fixed), ("longtail", longtail)):
            r = time_steps(compiled, loss_fn, batches, None, repeats=2)
            r["step_vs_eager"] = r["step_s"] / results["runs"][name]["step_s"]
            r["logprobs_vs_eager"] = r["logprobs_s"] / results["runs"][name]["logprobs_s"]
            results["runs"][f"{name}_compiled_head"] = r
            report(f"{name}_compiled_head", r)
            print(
                f"{'':22s} vs eager: step x{r['step_vs_eager']:.3f} logprobs "
                f"x{r['logprobs_vs_eager']:.3f} (warm-up step with compiling {r['warmup_s']:.1f} s)",
                flush=True,
            )
    if args.profile and torch.cuda.is_available():
        profiled = [(policy, "fixed", fixed[0]), (policy, "longtail", longtail[0])]
        if compiled is not None:
            profiled.append((compiled, "fixed_compiled_head", fixed[0]))
        for profiled_policy, name, batch in profiled:
            prof = kernel_profile(profiled_policy, loss_fn, batch)
            results[f"profile_{name}"] = prof
            print(f"== profile {name}: " + json.dumps(prof, indent=1), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        print("wrote", args.out)


if __name__ == "__main__":
    main()
