"""Where the built-in engine's judge-like prefill spends its time, and what a compiled forward
could gain (issue #28: the built-in prefill should match the best of vLLM and SGLang on the
judge-like load).

    python3 bench/rollout/prefill_profile.py --out $OUT/prefill_profile_nvidia_h200.json
    python3 bench/rollout/prefill_profile.py --tiny --out /tmp/p.json   # CPU: checks the script runs

On an H200 the engine table (bench/rollout/engines.py) measured the built-in engine's judge
prefill (256 prompts of 1,024 random tokens, 1 new token each) at ~291k prompt tok/s for the
Qwen2.5-0.5B shape, and SGLang 0.5.17 at ~523k. The engine prefills in chunks of at
most EngineConfig.max_prefill_tokens padded tokens (16,384: 16 forwards of [16, 1024] here),
each attention layer writing its keys/values into the static KV cache. On the same
random-weight model (engines.py's save_model: a model that `engines.py --prepare 0.5b` saved
under --model-root is reused), this measures:

1. engine: the engine table's judge prefill through the public API (BuiltinEngine with the
   table's EngineConfig and an eager prefill, compile_prefill=False; engines.py's `generate`
   in its adapter_seeded mode, fresh prompts every call): 1 warm-up call, then --repeats timed
   calls; median prompt tok/s.
2. engine["profile"]: one more such call under torch.profiler: device kernel time by kind (the groups of
   _decode_profile.KERNEL_GROUPS with prefill's own kinds ahead of the generic ones: the
   pow/mean/rsqrt of eager RMSNorm, SiLU, the index/gather kernels of the KV write, mul/add,
   casts/copies), the kernel count, and the total kernel time against the call's wall time:
   the difference is time the GPU waits for the host. The busiest host ops are listed too.
3. forward: the plain HF model (SDPA attention, no KV write, the same weights) on one engine
   chunk, model(input_ids=[rows, T], logits_to_keep=1, use_cache=False) under no_grad, bf16:
   eager; eager with SDPA restricted to flash, and to cuDNN (CUDA only); torch.compile(model,
   dynamic=False) in its default mode (its first call compiles). 1 warm-up, then
   --forward-repeats timed calls; median. A variant that fails records its error string and
   the others go on. Each variant's one forward is profiled like the engine's call.
4. gemm_bound: the model's own nn.Linear layers alone on the chunk's tokens, back to back (and
   the head on the kept rows): what a prefill would take if every other cost were free, with
   these cuBLAS kernels. The plain model runs q/k/v and gate/up as separate GEMMs; the engine
   fuses each group into one (EngineConfig.fuse_projections), a little faster.
5. flops_per_token: from the config (see `flops_per_token`), so every timed row also reads
   as achieved TFLOP/s, as a share of the nominal bf16 dense peak, and against the GEMM bound.
6. engine_compile_prefill (with --engine-compile-prefill, last): 1. and 2. again on an engine
   with EngineConfig.compile_prefill=True, the CUDA default (its warm-up call compiles the
   prefill forward).

--tiny: a 2-layer Qwen2-shaped model (yatt.testing.make_tiny_causal_lm) on the CPU, 4 prompts of
32 tokens in chunks of 2 rows; the CUDA-only variants are recorded as skipped with the reason.
Its times mean nothing. The JSON (and the .md beside it) is rewritten as each phase ends, so a
run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))  # bench/step: _step_setup
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from _decode_profile import KERNEL_GROUPS, _kernel_table
from _engine_shapes import SHAPES
from _step_setup import device_name
from engines import RunSpec, engine_version, generate, model_dir, random_prompts, save_model
from measured_commit import measured_commit
from report import write_report

ROOT = Path(__file__).resolve().parents[2]
MODE = "adapter_seeded"  # engines.py's only built-in mode: yatt's API, every sample seeded
VARIANTS = ("eager", "flash", "cudnn", "compiled")
# The engines timed (result key -> EngineConfig fields beyond the table's, report label).
ENGINES = {
    "engine": ({"compile_prefill": False}, "engine (generate)"),
    "engine_compile_prefill": ({"compile_prefill": True}, "engine, compile_prefill"),
}
DEFAULTS = {"batch": 256, "prompt_tokens": 1024, "max_seq_len": 1152, "max_prefill_tokens": 16384}
TINY = {"batch": 4, "prompt_tokens": 32, "max_seq_len": 40, "max_prefill_tokens": 64}
# Nominal dense bf16 tensor-core peaks (no sparsity), FLOP/s; H100: the SXM part's.
NOMINAL_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}

# _decode_profile's groups with prefill's own kinds ahead of its generic ones (first match
# wins): eager RMSNorm is pow, mean, rsqrt and mul kernels (its mul lands in mul/add), SwiGLU's
# activation is silu, and PrefillWrite's KV write is ATen index, gather and index_put kernels
# (index/gather also takes the embedding lookup and the kept-logits index: 2 kernels a chunk).
_FIRST_GENERIC = next(i for i, (name, _) in enumerate(KERNEL_GROUPS) if name == "scan/sort")
PREFILL_KERNEL_GROUPS = [
    *KERNEL_GROUPS[:_FIRST_GENERIC],
    ("attention", re.compile(r"sdpa|cudnn", re.I)),  # cuDNN's SDPA kernels
    ("norm: pow/mean/rsqrt", re.compile(r"pow_tensor|rsqrt|MeanOps", re.I)),
    ("silu", re.compile(r"silu", re.I)),
    ("index/gather (KV write)", re.compile(r"index_elementwise|scatter_gather|indexSelect", re.I)),
    ("mul/add", re.compile(r"MulFunctor|AddFunctor|CUDAFunctor_add|neg_kernel", re.I)),
    ("cast/copy/cat", re.compile(r"copy|CatArray", re.I)),
    *KERNEL_GROUPS[_FIRST_GENERIC:],
]


# -- the FLOP estimate -----------------------------------------------------------------------------
def flops_per_token(config, prompt_tokens: int) -> dict[str, float]:
    """FLOPs per prompt token of a causal prefill of prompts of `prompt_tokens` tokens from
    position 0, keeping the last position's logits of each prompt. A multiply-add is 2 FLOPs.

    gemm: 2 x (q, k, v, o, gate, up, down weights of a layer) x layers (biases, norms left out);
    attention: q K^T and P V, 2 x 2 x heads x head_dim per attended key, at the mean causal
        context (T + 1) / 2 (token i attends to i + 1 keys), x layers;
    lm_head: 2 x hidden x vocab for the one kept row of logits, spread over the T tokens.
    """
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    weights = (
        2 * hidden * heads * head_dim  # q and o
        + 2 * hidden * kv_heads * head_dim  # k and v
        + 3 * hidden * config.intermediate_size  # gate, up, down
    )
    out = {
        "gemm": 2.0 * weights * layers,
        "attention": 4.0 * heads * head_dim * (prompt_tokens + 1) / 2 * layers,
        "lm_head": 2.0 * hidden * config.vocab_size / prompt_tokens,
    }
    out["total"] = sum(out.values())
    return out


# -- arguments -------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU (a smoke run)")
    parser.add_argument("--shape", default="0.5b", help=f"one of {tuple(SHAPES)} (not --tiny)")
    parser.add_argument("--batch", type=int, help="prompts per call (default 256; --tiny 4)")
    parser.add_argument("--prompt-tokens", type=int, help="tokens a prompt (1024; --tiny 32)")
    parser.add_argument(
        "--max-seq-len",
        type=int,
        help="EngineConfig.max_seq_len (default 1152, the engine table's: 1,024 + 128; --tiny 40)",
    )
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        help="EngineConfig.max_prefill_tokens (default 16384, the engine's; --tiny 64)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed engine calls (median)")
    parser.add_argument("--forward-repeats", type=int, default=5, help="timed forwards (median)")
    parser.add_argument(
        "--variants",
        type=lambda text: [v for v in text.split(",") if v],
        default=list(VARIANTS),
        help=f"forward variants, comma-separated, of {','.join(VARIANTS)}",
    )
    parser.add_argument(
        "--engine-compile-prefill",
        action="store_true",
        help="also time an engine with EngineConfig.compile_prefill=True (last; it compiles)",
    )
    parser.add_argument(
        "--model-root",
        default="/tmp/yatt-bench/engines",
        help="where the random model is saved once (engines.py's default: its models are reused)",
    )
    parser.add_argument("--out", help="JSON file (a .md is written beside it)")
    args = parser.parse_args(argv)
    for name, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tiny:
        args.shape = "tiny"
    return args


class UsageError(ValueError):
    """Bad command-line input: the command line prints it without a traceback (exit code 2)."""


def check_args(args: argparse.Namespace) -> None:
    """Bad input fails here, before any model is built."""
    if not args.tiny and not torch.cuda.is_available():
        raise UsageError(
            "CUDA is not available: this script profiles the engine on a GPU; pass --tiny for a "
            "CPU smoke run"
        )
    if not args.tiny and args.shape not in SHAPES:
        raise UsageError(f"--shape={args.shape!r}: use one of {tuple(SHAPES)}")
    for name in ("batch", "prompt_tokens", "repeats", "forward_repeats"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.max_seq_len <= args.prompt_tokens:
        raise UsageError(
            f"--max-seq-len={args.max_seq_len}: must exceed --prompt-tokens="
            f"{args.prompt_tokens} (a prompt and its new token)"
        )
    if args.max_prefill_tokens < args.max_seq_len:
        raise UsageError(
            f"--max-prefill-tokens={args.max_prefill_tokens}: must be >= --max-seq-len="
            f"{args.max_seq_len} (EngineConfig's rule: the longest prompt fits one prefill)"
        )
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        raise UsageError(f"--variants={','.join(args.variants)}: use some of {VARIANTS}")


def chunk_rows(args: argparse.Namespace) -> int:
    """Rows of one engine prefill forward: the host loop fills a chunk while (rows + 1) x the
    longest prompt stays within max_prefill_tokens (all prompts are equally long here)."""
    return min(args.batch, max(1, args.max_prefill_tokens // args.prompt_tokens))


# -- helpers ---------------------------------------------------------------------------------------
def log(text: str) -> None:
    print(text, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def seconds(fn: Callable[[], object], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def timings(fn: Callable[[], object], device: str, repeats: int) -> dict:
    """1 warm-up call, then `repeats` timed: each call's seconds, the first's and the median."""
    first = seconds(fn, device)
    times = [seconds(fn, device) for _ in range(repeats)]
    return {"first_call_s": first, "seconds": times, "median_s": statistics.median(times)}


def prompts(batch: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """engines.py's random prompts (ids 1000-150000), folded into a smaller vocabulary."""
    ids = random_prompts(batch, length, seed)
    return ids if vocab > 150000 else [[t % vocab for t in row] for row in ids]


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# -- the profile -----------------------------------------------------------------------------------
def profile_call(fn: Callable[[], object], device: str, *, print_table: bool = False) -> dict:
    """One call of `fn` under torch.profiler: its wall time, its device kernels by kind (CUDA;
    none on the CPU), the time the device sat without a kernel, the busiest host ops."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    wall_ms = (time.perf_counter() - start) * 1e3
    if print_table:
        sort_by = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
        log(prof.key_averages().table(sort_by=sort_by, row_limit=25))
    out = {"wall_ms_profiled": wall_ms, **kernel_summary(prof)}
    out["idle_ms_profiled"] = wall_ms - out["kernel_ms"]
    return out


def kernel_summary(prof) -> dict:
    """The kernels of a profile (one call) grouped by PREFILL_KERNEL_GROUPS, the top kernels
    ([name, count, ms]) and the host ops with the most self time ([name, count, ms])."""
    table = _kernel_table(prof, num_steps=1, groups_by_name=PREFILL_KERNEL_GROUPS)
    host_ops = sorted(
        (e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: -e.self_cpu_time_total,
    )[:12]
    return {
        "kernels": table["kernels_per_step"],
        "kernel_ms": table["kernel_ms_per_step"],
        "kernel_ms_by_group": table["ms_per_step_by_group"],
        "top_kernels": table["top_kernels"],
        "top_host_ops": [
            [e.key[:80], e.count, round(e.self_cpu_time_total / 1e3, 3)] for e in host_ops
        ],
    }


# -- the model -------------------------------------------------------------------------------------
def prepare_model(args: argparse.Namespace) -> Path:
    """The random-weight model's directory (with a tokenizer), saved once under --model-root."""
    if not args.tiny:
        return save_model(model_dir(args, args.shape), args.shape)
    path = Path(args.model_root) / "qwen2-tiny"
    if not (path / "config.json").exists():
        from yatt.testing import make_tiny_causal_lm

        make_tiny_causal_lm(path, arch="qwen2", tie_word_embeddings=True)
    return path


def model_record(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    keys = (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings",
    )  # fmt: skip
    return {"dir": str(path), **{k: config.get(k) for k in keys}}


# -- 1 + 2 (and 6): the engine --------------------------------------------------------------------
def measure_engine(args, path: Path, device: str, result: dict, key: str = "engine") -> None:
    """The judge prefill through BuiltinEngine.generate, timed and profiled, into result[key]."""
    from yatt.rollout import BuiltinEngine, EngineConfig

    extra, label = ENGINES[key]
    run = RunSpec(engine="builtin", shape=args.shape, group="", modes=(MODE,))
    vocab = result["model"]["vocab_size"]
    settings = {
        "dtype": "bfloat16",
        "max_batch_size": args.batch,
        "max_seq_len": args.max_seq_len,
        "max_prefill_tokens": args.max_prefill_tokens,
        **extra,
    }
    start = time.perf_counter()
    engine = BuiltinEngine(path, config=EngineConfig(device=device, **settings))
    row = result[key] = {
        "EngineConfig": dataclasses.asdict(engine.config),
        "startup_s": time.perf_counter() - start,
    }
    log(f"{label}: started in {row['startup_s']:.1f} s")
    seeds = iter(range(1000, 10**9))

    def call() -> Callable[[], None]:
        """A judge-prefill call on fresh prompts (drawn now, outside the timing)."""
        seed = next(seeds)
        ids = prompts(args.batch, args.prompt_tokens, seed, vocab)

        def run_call() -> None:
            got = generate(run, engine, MODE, ids, 1, seed)
            if got != args.batch:
                raise RuntimeError(f"{got} new tokens, expected {args.batch} x 1")

        return run_call

    try:
        row["first_call_s"] = seconds(call(), device)
        times = [seconds(call(), device) for _ in range(args.repeats)]
        tokens = args.batch * args.prompt_tokens
        median = statistics.median(times)
        row.update(
            seconds=times,
            median_s=median,
            prompt_tokens=tokens,
            tok_s=tokens / median,
            min_tok_s=tokens / max(times),
            max_tok_s=tokens / min(times),
            ms_per_chunk=median * 1e3 / result["settings"]["chunks"],
        )
        log(
            f"{label}: {row['tok_s']:,.0f} prompt tok/s (median of {args.repeats}, "
            f"{median * 1e3:.1f} ms a call; warm-up call {row['first_call_s']:.2f} s)"
        )
        try:
            profile = profile_call(call(), device, print_table=True)
        except Exception as exc:  # the profile explains the numbers; never lose them for it
            result["errors"][f"{key}_profile"] = error_text(exc)
            log(f"{label} profile: FAILED {result['errors'][f'{key}_profile']}")
            return
        profile["idle_ms"] = median * 1e3 - profile["kernel_ms"]  # against the unprofiled call
        row["profile"] = profile
        log(
            f"{label}, one call profiled: {profile['kernels']:.0f} kernels, "
            f"{profile['kernel_ms']:.1f} ms of kernels in {median * 1e3:.1f} ms (unprofiled "
            f"median; {profile['wall_ms_profiled']:.1f} ms profiled); kernel ms by kind "
            f"{profile['kernel_ms_by_group']}"
        )
    finally:
        engine.close()  # its memory stays in the engine's pools (plenty left on the GPU)
        free_memory(device)


# -- 3 + 4: the plain forward and its GEMMs --------------------------------------------------------
def gemm_bound(model, ids: torch.Tensor, device: str, repeats: int) -> dict:
    """The model's nn.Linear layers alone on the chunk's tokens, back to back, and the head on
    the one kept position of each row: a prefill with every non-GEMM cost free."""
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    rows, tokens = ids.shape[0], ids.numel()
    dtype = head.weight.dtype
    inputs = {
        n: torch.randn(tokens, n, device=device, dtype=dtype)
        for n in {m.in_features for m in linears}
    }
    head_in = torch.randn(rows, head.in_features, device=device, dtype=dtype)

    def run() -> None:
        for m in linears:
            torch.nn.functional.linear(inputs[m.in_features], m.weight, m.bias)
        torch.nn.functional.linear(head_in, head.weight)

    with torch.no_grad():
        row = timings(run, device, repeats)
    flops = 2.0 * tokens * sum(m.in_features * m.out_features for m in linears)
    flops += 2.0 * rows * head.in_features * head.out_features
    row.update(
        gemms=len(linears) + 1,
        flops=flops,
        tok_s=tokens / row["median_s"],
        ms=row["median_s"] * 1e3,
        tflop_s=flops / row["median_s"] / 1e12,  # the GEMMs' own rate
    )
    return row


def variant_skip_reason(name: str, device: str) -> str | None:
    if name in ("flash", "cudnn") and device != "cuda":
        return "CUDA only: an SDPA backend of CUDA"
    if name == "cudnn" and not (
        hasattr(torch.nn.attention.SDPBackend, "CUDNN_ATTENTION")
        and torch.backends.cudnn.is_available()
    ):
        return "cuDNN attention is not available in this torch build"
    return None


def variant_forward(name: str, model, ids: torch.Tensor) -> Callable[[], object]:
    """One forward of the chunk as variant `name` runs it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forward(m) -> object:
        with torch.no_grad():
            return m(input_ids=ids, logits_to_keep=1, use_cache=False)

    if name == "compiled":
        compiled = torch.compile(model, dynamic=False)
        return lambda: forward(compiled)
    if name in ("flash", "cudnn"):
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]

        def restricted() -> object:
            with sdpa_kernel([backend]):
                return forward(model)

        return restricted
    return lambda: forward(model)


def measure_forwards(args, path: Path, device: str, result: dict, save: Callable) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    model = model.to(device).eval().requires_grad_(False)
    rows = result["settings"]["chunk_rows"]
    vocab = result["model"]["vocab_size"]
    ids = torch.tensor(prompts(rows, args.prompt_tokens, 7, vocab), device=device)
    tokens = ids.numel()
    try:
        result["gemm_bound"] = gemm_bound(model, ids, device, args.forward_repeats)
        log(
            f"GEMMs only, one chunk [{rows}, {args.prompt_tokens}]: "
            f"{result['gemm_bound']['ms']:.2f} ms ({result['gemm_bound']['tflop_s']:.0f} TFLOP/s)"
        )
    except Exception as exc:  # the bound is a reference; the variants still run without it
        result["errors"]["gemm_bound"] = error_text(exc)
        log(f"GEMMs only: FAILED {result['errors']['gemm_bound']}")
    save()
    forward = result["forward"]
    for name in sorted(args.variants, key=VARIANTS.index):  # compile last: the longest, riskiest
        why = variant_skip_reason(name, device)
        if why:
            forward[name] = {"skipped": why}
            log(f"forward {name}: skipped ({why})")
            continue
        try:
            fn = variant_forward(name, model, ids)
            row = forward[name] = timings(fn, device, args.forward_repeats)
            row.update(ms=row["median_s"] * 1e3, tok_s=tokens / row["median_s"])
            log(
                f"forward {name}: {row['ms']:.2f} ms a chunk, {row['tok_s']:,.0f} tok/s (first "
                f"call {row['first_call_s']:.2f} s)"
            )
            row["profile"] = profile_call(fn, device)
            log(f"forward {name} kernels by kind (ms): {row['profile']['kernel_ms_by_group']}")
        except Exception as exc:  # one variant failing keeps the others' numbers
            forward[name] = {"error": error_text(exc)}
            log(f"forward {name}: FAILED {forward[name]['error']}")
        save()
    del model
    free_memory(device)


# -- the derived numbers and the report ------------------------------------------------------------
def timed_rows(result: dict) -> dict[str, dict]:
    """Every row of the report that has a tok/s, by its label."""
    rows = {
        label: result[key] for key, (_, label) in ENGINES.items() if "tok_s" in result.get(key, {})
    }
    for name, row in result.get("forward", {}).items():
        if "tok_s" in row:
            rows[f"forward {name}"] = row
    return rows


def derive(result: dict) -> None:
    """TFLOP/s of every timed row, its share of the bf16 peak and of the GEMM-only bound, and
    the ratios the next optimisation is planned on."""
    per_token = result["flops_per_token"]["total"]
    peak = result["nominal_bf16_flops"]
    bound = result.get("gemm_bound", {}).get("tok_s")
    eager = result.get("forward", {}).get("eager", {}).get("tok_s")
    for row in timed_rows(result).values():
        row["tflop_s"] = per_token * row["tok_s"] / 1e12
        row["of_nominal_peak"] = per_token * row["tok_s"] / peak if peak else None
        row["of_gemm_bound"] = row["tok_s"] / bound if bound else None
        row["vs_eager_forward"] = row["tok_s"] / eager if eager else None
    if "gemm_bound" in result and peak:
        result["gemm_bound"]["of_nominal_peak"] = result["gemm_bound"]["tflop_s"] * 1e12 / peak
    compiled = result.get("forward", {}).get("compiled", {}).get("tok_s")
    engine = result.get("engine", {}).get("tok_s")
    result["ratios"] = {
        "compiled_over_eager_forward": compiled / eager if compiled and eager else None,
        "engine_over_eager_forward": engine / eager if engine and eager else None,
        "engine_over_compiled_forward": engine / compiled if engine and compiled else None,
    }
    if "tok_s" in result.get("engine_compile_prefill", {}):
        ratio = result["engine_compile_prefill"]["tok_s"] / engine if engine else None
        result["ratios"]["engine_compile_prefill_over_engine"] = ratio


def _fmt(value, spec: str) -> str:
    return (
        ""
        if value is None or (isinstance(value, float) and math.isnan(value))
        else spec.format(value)
    )


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"# Built-in engine prefill profile ({result['device']})",
        "",
        f"Judge-like prefill: {s['batch']} prompts x {s['prompt_tokens']:,} tokens, 1 new token; "
        f"the {s['shape']} shape (random bf16 weights); the engine prefills in {s['chunks']} "
        f"chunks of {s['chunk_rows']} rows (max_prefill_tokens {s['max_prefill_tokens']:,}). "
        f"Commit {result['commit']}, torch {result['versions']['torch']}, transformers "
        f"{result['versions']['transformers']}. Command: `{result['command']}`.",
        "",
        "| what | ms a chunk | prompt tok/s | TFLOP/s | of bf16 peak | of GEMM-only bound "
        "| vs eager forward |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in timed_rows(result).items():
        ms = row.get("ms_per_chunk", row.get("ms"))
        lines.append(
            f"| {label} | {_fmt(ms, '{:.2f}')} | {_fmt(row['tok_s'], '{:,.0f}')} | "
            f"{_fmt(row.get('tflop_s'), '{:.1f}')} | {_fmt(row.get('of_nominal_peak'), '{:.0%}')} "
            f"| {_fmt(row.get('of_gemm_bound'), '{:.0%}')} | "
            f"{_fmt(row.get('vs_eager_forward'), '{:.2f}x')} |"
        )
    bound = result.get("gemm_bound")
    if bound:
        lines.append(
            f"| GEMMs only (bound; TFLOP/s: the GEMMs' own) | {bound['ms']:.2f} | "
            f"{bound['tok_s']:,.0f} | {bound['tflop_s']:.1f} | "
            f"{_fmt(bound.get('of_nominal_peak'), '{:.0%}')} | 100% | |"
        )
    f = result["flops_per_token"]
    lines += [
        "",
        f"FLOPs a prompt token: GEMMs {f['gemm'] / 1e6:.1f} M, attention {f['attention'] / 1e6:.1f} "
        f"M, lm_head {f['lm_head'] / 1e6:.3f} M, total {f['total'] / 1e6:.1f} M. Forward rows: "
        "the plain HF model on one chunk (no KV write); compiled: torch.compile, dynamic=False.",
    ]
    firsts = [
        f"{label} {row['first_call_s']:.1f} s"
        for label, row in timed_rows(result).items()
        if "first_call_s" in row
    ]
    if firsts:
        lines.append(f"First (warm-up) calls, compiles included: {', '.join(firsts)}.")
    for name, row in result.get("forward", {}).items():
        if "tok_s" not in row:
            lines.append(f"- forward {name}: {row.get('skipped') or row.get('error')}")
    lines += kernel_lines(result)
    for phase, text in result["errors"].items():
        lines.append(f"\nError in {phase}: {text}")
    return "\n".join(lines) + "\n"


def kernel_lines(result: dict) -> list[str]:
    """Kernel time by kind: each engine's call divided by its chunks (one forward's worth)
    beside each profiled forward; then each engine call's idle time and top kernels."""
    chunks = result["settings"]["chunks"]
    columns = {}  # label -> (profile, divisor)
    for key, (_, label) in ENGINES.items():
        if "profile" in result.get(key, {}):
            columns[f"{label}, a chunk"] = (result[key]["profile"], chunks)
    for name, row in result.get("forward", {}).items():
        if "profile" in row:
            columns[f"forward {name}"] = (row["profile"], 1)
    if not columns:
        return []
    if not any(profile["kernels"] for profile, _ in columns.values()):
        return ["", "No device kernels on the CPU (the host ops are in the JSON)."]
    first = next(iter(columns.values()))[0]["kernel_ms_by_group"]
    groups = sorted(
        {g for profile, _ in columns.values() for g in profile["kernel_ms_by_group"]},
        key=lambda g: -first.get(g, 0.0),
    )
    lines = [
        "",
        "## Device kernel time by kind (ms)",
        "",
        "| kind | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for group in [*groups, "all kernels", "kernel count"]:
        cells = []
        for profile, divisor in columns.values():
            if group == "kernel count":
                cells.append(f"{profile['kernels'] / divisor:.0f}")
                continue
            value = profile["kernel_ms"] if group == "all kernels" else None
            value = value if value is not None else profile["kernel_ms_by_group"].get(group, 0.0)
            cells.append(f"{value / divisor:.2f}")
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    for key, (_, label) in ENGINES.items():
        profile = result.get(key, {}).get("profile")
        if not profile:
            continue
        wall_ms = result[key]["median_s"] * 1e3
        lines += [
            "",
            f"{label}, one call: {profile['kernel_ms']:.1f} ms of kernels in {wall_ms:.1f} ms "
            f"(the unprofiled median; {profile['wall_ms_profiled']:.1f} ms under the profiler): "
            f"the device waits {profile['idle_ms']:.1f} ms ({profile['idle_ms'] / wall_ms:.0%}) "
            "for the host. Its top kernels:",
            "",
            "| kernel | count | ms |",
            "|---|---:|---:|",
        ]
        for name, count, ms in profile["top_kernels"][:8]:
            lines.append(f"| `{name.replace('|', '/')}` | {count} | {ms:.2f} |")
    return lines


def write_outputs(result: dict, out: Path) -> None:
    derive(result)
    write_report(out.with_suffix(".md"), markdown(result), data=result, json_path=out)


# -- main ------------------------------------------------------------------------------------------
def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    check_args(args)
    device = "cpu" if args.tiny else "cuda"
    out = (
        Path(args.out)
        if args.out
        else ROOT / "bench" / "results" / f"prefill_profile_{device_name()}.json"
    )
    rows = chunk_rows(args)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    import transformers

    result: dict = {
        "device": gpu,
        "command": "python3 bench/rollout/prefill_profile.py " + " ".join(argv),
        "commit": measured_commit(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "yatt-rollout": engine_version("builtin"),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
        },
        "settings": {
            "tiny": args.tiny,
            "shape": args.shape,
            "dtype": "bfloat16",
            "batch": args.batch,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": 1,
            "max_seq_len": args.max_seq_len,
            "max_prefill_tokens": args.max_prefill_tokens,
            "chunk_rows": rows,
            "chunks": math.ceil(args.batch / rows),
            "repeats": args.repeats,
            "forward_repeats": args.forward_repeats,
            "variants": args.variants,
            "engine_compile_prefill": args.engine_compile_prefill,
            "mode": MODE,
        },
        "nominal_bf16_flops": next((v for k, v in NOMINAL_BF16_FLOPS.items() if k in gpu), None),
        "forward": {},
        "errors": {},
    }
    start = time.perf_counter()
    path = prepare_model(args)
    result["model"] = model_record(path)
    result["flops_per_token"] = flops_per_token(
        transformers.AutoConfig.from_pretrained(path), args.prompt_tokens
    )
    log(f"model {path} ({time.perf_counter() - start:.0f} s); settings {result['settings']}")
    try:
        measure_engine(args, path, device, result)
    except Exception as exc:  # recorded; the forwards still run
        result["errors"]["engine"] = error_text(exc)
        log(f"engine: FAILED {result['errors']['engine']}")
    write_outputs(result, out)
    try:
        measure_forwards(args, path, device, result, lambda: write_outputs(result, out))
    except Exception as exc:
        result["errors"]["forward"] = error_text(exc)
        log(f"forwards: FAILED {result['errors']['forward']}")
    write_outputs(result, out)
    if args.engine_compile_prefill:
        try:
            measure_engine(args, path, device, result, key="engine_compile_prefill")
        except Exception as exc:
            result["errors"]["engine_compile_prefill"] = error_text(exc)
            log(f"engine, compile_prefill: FAILED {result['errors']['engine_compile_prefill']}")
        write_outputs(result, out)
    log(markdown(result))
    log(f"wrote {out} and {out.with_suffix('.md')} ({time.perf_counter() - start:.0f} s)")
    return result


if __name__ == "__main__":
    try:
        outcome = main(sys.argv[1:])
    except UsageError as exc:
        print(f"prefill_profile.py: error: {exc}", file=sys.stderr)
        sys.exit(2)  # as argparse's own errors: no traceback
    sys.exit(1 if outcome["errors"] else 0)
