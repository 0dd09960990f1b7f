"""Do two built-in engines' decodes overlap on one GPU? The policy's rollout and a judge, alone
and at once (issue 26: partial colocation runs them together, full colocation one after the other).

    python bench/rollout/engines_overlap.py                      # bench/results/engines_overlap_<gpu>.json/.md
    python bench/rollout/engines_overlap.py --mix fixed --judge-tokens 128 --out /tmp/o.json
    python bench/rollout/engines_overlap.py --tiny --out /tmp/o.json   # CPU: checks the script runs

Two random-weight models, built locally as bench/step builds them (bench/step/_step_setup.py:
make_models): the policy in Qwen2.5-0.5B's shape, the judge in Qwen2.5-1.5B's (--tiny: 2-layer
models, float32, on CPU, small workloads; its times mean nothing). Each is a BuiltinEngine in
one process with its own CUDA stream; the policy's has stream_priority=-1 (--policy-priority),
as partial colocation sets it.

Workloads (forced lengths, ignore_eos, fixed seeds, the same in every timing):
- policy: 16 prompts x 8 samples of 128-token prompts; responses of bench/step's long-tail mix
  (90% of 64-192 tokens, 10% of 512-1,024), or --mix fixed (256 tokens each);
- judge: one prompt per policy sample, as long as the judge reads it (chat template + prompt +
  a long-tail response: about 350-1,310 tokens), writing --judge-tokens (default 384, the seed
  mix's verdicts) greedy tokens each.

After one warm-up call of each engine (compile, CUDA-graph capture), each of --repeats rounds
times: the policy alone, the judge alone, and both at once (two threads released together,
each calling its engine's generate; `together` ends when both have returned, and each
engine's own finish time inside it is kept). With sum = policy alone + judge alone and
max = the larger of the two,

    overlap = (sum - together) / (sum - max)

is 1 when running both at once takes only the longer one's time (perfect overlap), 0 when it
takes the sum (none: the GPU is the bottleneck), negative when it is worse than one after the
other. together / sum is what partial colocation can at best save on this pair of phases.
The GPU busy fraction (NVML, when pynvml imports) of each timing is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from yatt.rollout import BuiltinEngine, Request, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))  # bench/step: _step_setup
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from _rollout_checks import RUN, engine_config, sync
from _rollout_throughput import time_call
from _step_setup import (
    JUDGE_TEMPLATE_TOKENS,
    SEED_JUDGE_TOKENS,
    GpuSampler,
    device_name,
    make_models,
    physical_gpu,
    response_lengths,
    workload,
)
from report import write_report as write_files

ROOT = Path(__file__).resolve().parents[2]
POLICY_MIXES = ("longtail", "fixed")
TINY_SCALE = 16  # --tiny divides every prompt and response length by this
TINY_JUDGE_TOKENS = 8
TIMINGS = ("alone_policy", "alone_judge", "together")


def overlap_fraction(alone_a: float, alone_b: float, together: float) -> float:
    """(sum - together) / (sum - max) of two phases' alone times and their time run at once:
    1 = together takes the longer phase's time, 0 = the sum, < 0 = worse than the sum.
    NaN when one phase takes no time (nothing to overlap)."""
    total, longest = alone_a + alone_b, max(alone_a, alone_b)
    if total - longest <= 0:
        return math.nan
    return (total - together) / (total - longest)


def summarize(alone_policy: float, alone_judge: float, together: float) -> dict:
    """The derived numbers of one round (or of the medians)."""
    total = alone_policy + alone_judge
    return {
        "sum_s": total,
        "max_s": max(alone_policy, alone_judge),
        "overlap": overlap_fraction(alone_policy, alone_judge, together),
        "together_over_sum": together / total if total > 0 else math.nan,
    }


# -- arguments -----------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models on CPU (a smoke run)")
    parser.add_argument("--mix", default="longtail", help=f"policy lengths: {POLICY_MIXES}")
    parser.add_argument(
        "--judge-tokens",
        type=int,
        default=None,
        help=f"forced verdict tokens (default {SEED_JUDGE_TOKENS}; --tiny {TINY_JUDGE_TOKENS})",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    parser.add_argument(
        "--policy-priority", type=int, default=-1, help="the policy engine's stream_priority"
    )
    parser.add_argument("--out", help="JSON file (a .md is written beside it)")
    parser.add_argument(
        "--model-dir",
        default=str(Path(tempfile.gettempdir()) / "yatt-engines-overlap"),
        help="where the random models are saved once",
    )
    args = parser.parse_args(argv)
    if args.judge_tokens is None:
        args.judge_tokens = TINY_JUDGE_TOKENS if args.tiny else SEED_JUDGE_TOKENS
    return args


def check_args(args: argparse.Namespace) -> None:
    """Bad input fails here, before any model is built."""
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats}: must be >= 1 (timed rounds)")
    if args.judge_tokens < 1:
        raise ValueError(f"--judge-tokens={args.judge_tokens}: must be >= 1 (verdict tokens)")
    if args.mix not in POLICY_MIXES:
        raise ValueError(f"--mix={args.mix!r}: use one of {POLICY_MIXES}")
    if not args.tiny and not torch.cuda.is_available():
        raise ValueError("CUDA is not available: run on a GPU, or pass --tiny for a CPU smoke run")


# -- workloads -----------------------------------------------------------------------------------
def _scaled(n: int, tiny: bool) -> int:
    return max(1, n // TINY_SCALE) if tiny else n


def make_workloads(args: argparse.Namespace, vocab_size: int) -> dict:
    """{"policy": (requests, sampling), "judge": (requests, sampling)} and their sizes."""
    work = workload(args)
    work = replace(work, prompt_tokens=_scaled(work.prompt_tokens, args.tiny))
    g = torch.Generator().manual_seed(work.seed)

    def ids(length: int) -> list[int]:
        return torch.randint(3, vocab_size, (length,), generator=g).tolist()

    # Policy: every sample of a group shares its prompt; lengths differ per sample.
    policy_lengths = [_scaled(n, args.tiny) for n in response_lengths(args.mix, work, step=0)]
    prompts = [ids(work.prompt_tokens) for _ in range(work.num_prompts)]
    policy = [
        Request(prompt_ids=prompts[i // work.group_size], max_new_tokens=n)
        for i, n in enumerate(policy_lengths)
    ]
    policy_sampling = SamplingParams(
        temperature=1.0, max_new_tokens=max(policy_lengths), ignore_eos=True, seed=1000
    )
    # Judge: what it reads of each sample (template + prompt + a long-tail response).
    responses = [_scaled(n, args.tiny) for n in response_lengths("longtail", work, step=1)]
    template = _scaled(JUDGE_TEMPLATE_TOKENS, args.tiny)
    judge_lengths = [template + work.prompt_tokens + n for n in responses]
    judge = [Request(prompt_ids=ids(n)) for n in judge_lengths]
    judge_sampling = SamplingParams(
        temperature=0.0, max_new_tokens=args.judge_tokens, ignore_eos=True
    )
    return {
        "policy": (policy, policy_sampling),
        "judge": (judge, judge_sampling),
        "sizes": {
            "policy_samples": len(policy),
            "policy_prompt_tokens": work.prompt_tokens,
            "policy_new_tokens": sum(policy_lengths),
            "policy_max_new_tokens": max(policy_lengths),
            "judge_samples": len(judge),
            "judge_prompt_tokens": [min(judge_lengths), max(judge_lengths)],
            "judge_prompt_tokens_total": sum(judge_lengths),
            "judge_new_tokens": args.judge_tokens,
            "policy_max_seq_len": work.prompt_tokens + max(policy_lengths),
            "judge_max_seq_len": max(judge_lengths) + args.judge_tokens,
        },
    }


# -- timing --------------------------------------------------------------------------------------
def time_together(calls: dict) -> tuple[float, dict[str, float]]:
    """Runs every call of {name: fn} on its own thread, released at once: (seconds until all
    have returned, {name: seconds until that one returned}). generate returns once its tokens
    are on the host, so each finish time is that engine's own end."""
    start = threading.Barrier(len(calls) + 1)
    t0 = [0.0]
    finish: dict[str, float] = {}
    errors: list[BaseException] = []

    def run(name, fn) -> None:
        start.wait()
        try:
            fn()
        except BaseException as exc:  # re-raised in the main thread below
            errors.append(exc)
        finish[name] = time.perf_counter() - t0[0]

    threads = [threading.Thread(target=run, args=item, name=item[0]) for item in calls.items()]
    for thread in threads:
        thread.start()
    sync()
    t0[0] = time.perf_counter()
    start.wait()
    for thread in threads:
        thread.join()
    sync()
    total = time.perf_counter() - t0[0]
    if errors:
        raise errors[0]
    return total, finish


def measure(engines: dict, loads: dict, repeats: int, sampler: GpuSampler) -> list[dict]:
    calls = {name: partial(engines[name].generate, *loads[name]) for name in ("policy", "judge")}
    rounds = []
    for r in range(repeats):
        row: dict = {}
        for timing in TIMINGS:
            t0 = time.perf_counter()
            if timing == "together":
                row["together_s"], finish = time_together(calls)
                row["together_policy_done_s"] = finish["policy"]
                row["together_judge_done_s"] = finish["judge"]
            else:
                row[f"{timing}_s"] = time_call(calls[timing.removeprefix("alone_")])
            window = sampler.window(t0, time.perf_counter()) if sampler.available else []
            busy = row[f"{timing}_busy"] = window[0]["busy"] if window else None
            print(
                f"[round {r + 1}/{repeats}] {timing}: {row[f'{timing}_s']:.3f} s"
                + (f" (GPU busy {busy:.2f})" if busy is not None else ""),
                flush=True,
            )
        row.update(summarize(row["alone_policy_s"], row["alone_judge_s"], row["together_s"]))
        rounds.append(row)
    return rounds


def medians(rounds: list[dict]) -> dict:
    keys = [k for k in rounds[0] if k.endswith("_s") and k not in ("sum_s", "max_s")]
    keys += [k for k in rounds[0] if k.endswith("_busy") and rounds[0][k] is not None]
    out = {k: statistics.median(row[k] for row in rounds) for k in keys}
    # The ratios of the medians (not the median of the ratios): one consistent set of times.
    out.update(summarize(out["alone_policy_s"], out["alone_judge_s"], out["together_s"]))
    return out


# -- report --------------------------------------------------------------------------------------
def verdict(overlap: float) -> str:
    if math.isnan(overlap):
        return "undefined (a phase took no time)"
    if overlap < 0:
        return "worse than running them one after the other"
    if overlap < 0.25:
        return "close to the sum: little overlap, the GPU is the bottleneck"
    if overlap < 0.75:
        return "between the sum and the max: partial overlap"
    return "close to the max: the two engines' work mostly overlaps"


def write_markdown(result: dict, path: Path) -> str:
    m, sizes = result["median"], result["workload"]
    cols = [
        ("alone_policy_s", "policy alone s"),
        ("alone_judge_s", "judge alone s"),
        ("together_s", "together s"),
        ("together_policy_done_s", "policy done s"),
        ("together_judge_done_s", "judge done s"),
        ("sum_s", "sum s"),
        ("max_s", "max s"),
        ("overlap", "overlap"),
        ("together_over_sum", "together / sum"),
    ]
    lines = [
        f"# Two built-in engines at once on one device ({result['device']})",
        "",
        f"Policy {result['shapes']['policy']} ({sizes['policy_samples']} samples, "
        f"{result['mix']} mix, {sizes['policy_new_tokens']} new tokens, stream priority "
        f"{result['policy_priority']}); judge {result['shapes']['judge']} "
        f"({sizes['judge_samples']} prompts of {sizes['judge_prompt_tokens'][0]}-"
        f"{sizes['judge_prompt_tokens'][1]} tokens, {sizes['judge_new_tokens']} forced tokens "
        f"each). Command: `{result['command']}`.",
        "",
        "| round | " + " | ".join(label for _, label in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    rows = [(str(i + 1), row) for i, row in enumerate(result["rounds"])] + [("median", m)]
    for name, row in rows:
        cells = [f"{row[k]:.3f}" if k in row else "" for k, _ in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    busy = [f"{t.replace('_', ' ')} {m[f'{t}_busy']:.2f}" for t in TIMINGS if f"{t}_busy" in m]
    lines += [
        "",
        f"GPU busy fraction (NVML, median): {', '.join(busy)}." if busy else "GPU busy: no NVML.",
        "",
        summary_paragraph(m),
        "",
    ]
    text = "\n".join(lines)
    write_files(path, text)
    return text


def summary_paragraph(m: dict) -> str:
    slow_policy = m["together_policy_done_s"] / m["alone_policy_s"]
    slow_judge = m["together_judge_done_s"] / m["alone_judge_s"]
    return (
        f"Run at once, the two engines take {m['together_s']:.2f} s against "
        f"{m['sum_s']:.2f} s one after the other and {m['max_s']:.2f} s for the longer alone: "
        f"overlap {m['overlap']:.2f} (1 = the max, 0 = the sum), {verdict(m['overlap'])}. "
        f"together / sum = {m['together_over_sum']:.2f}: running both at once saves "
        f"{1 - m['together_over_sum']:.0%} of their time one after the other. A step that full "
        f"colocation draws in one round is these two phases one after the other, so issue 26's "
        f"bar (partial / full <= 0.75) needs together / sum <= 0.75 here unless partial "
        f"colocation also does less work. Inside `together` the policy finishes after "
        f"{m['together_policy_done_s']:.2f} s ({slow_policy:.2f}x its time alone) and the "
        f"judge after {m['together_judge_done_s']:.2f} s ({slow_judge:.2f}x)."
    )


# -- main ----------------------------------------------------------------------------------------
def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    check_args(args)
    RUN.device = "cpu" if args.tiny else "cuda"
    RUN.smoke = args.tiny
    dtype = "float32" if args.tiny else "bfloat16"  # make_models saves tiny models in float32
    out = (
        Path(args.out)
        if args.out
        else ROOT / "bench" / "results" / (f"engines_overlap_{device_name()}.json")
    )
    shapes = ("tiny", "tiny") if args.tiny else ("0.5b", "1.5b")
    t0 = time.perf_counter()
    policy_dir, judge_dir = make_models(Path(args.model_dir), tiny=args.tiny, shapes=shapes)
    dirs = {"policy": policy_dir, "judge": judge_dir}
    vocab = json.loads((dirs["policy"] / "config.json").read_text())["vocab_size"]
    loads = make_workloads(args, vocab)
    sizes = loads.pop("sizes")
    print(f"models in {dirs['policy'].parent} ({time.perf_counter() - t0:.0f} s); {sizes}")
    # Slots for every sample, the KV cache as long as the longest request: both fit at once.
    configs = {
        "policy": engine_config(
            sizes["policy_samples"],
            dtype=dtype,
            max_seq_len=sizes["policy_max_seq_len"],
            region_prefix="rollout",
            stream_priority=args.policy_priority,
        ),
        "judge": engine_config(
            sizes["judge_samples"],
            dtype=dtype,
            max_seq_len=sizes["judge_max_seq_len"],
            region_prefix="genrm",
        ),
    }
    engines, warmup_s = {}, {}
    sampler = GpuSampler([physical_gpu(0)] if not args.tiny else []).start()
    try:
        for name in ("policy", "judge"):
            engines[name] = BuiltinEngine(dirs[name], config=configs[name])
            # The whole workload once: compiles and captures every graph the timed calls use.
            warmup_s[name] = time_call(partial(engines[name].generate, *loads[name]))
            print(f"warm-up {name}: {warmup_s[name]:.1f} s", flush=True)
        rounds = measure(engines, loads, args.repeats, sampler)
    finally:
        sampler.stop()
        for engine in engines.values():
            engine.close()
    result = {
        "device": device_name(),
        "command": "python bench/rollout/engines_overlap.py " + " ".join(argv),
        "shapes": dict(zip(("policy", "judge"), shapes, strict=True)),
        "mix": args.mix,
        "policy_priority": args.policy_priority,
        "repeats": args.repeats,
        "workload": sizes,
        "engine_configs": {
            name: {k: getattr(c, k) for k in ("max_batch_size", "max_seq_len", "dtype")}
            for name, c in configs.items()
        },
        "warmup_s": warmup_s,
        "rounds": rounds,
        "median": medians(rounds),
        "gpu_busy_available": sampler.available,
    }
    text = write_markdown(result, out.with_suffix(".md"))
    write_files(out.with_suffix(".md"), text, data=result, json_path=out)  # the JSON beside it
    print(text)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
