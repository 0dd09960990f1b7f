"""The engine table (issue 28): the built-in engine against vLLM and SGLang on one GPU, same models.

    python bench/rollout/engines.py --prepare 0.5b,1.5b            # random-weight models, once
    python bench/rollout/engines.py --run builtin:0.5b --out $OUT/engines_builtin_0.5b.json
    python bench/rollout/engines.py --run vllm:0.5b:native --out ...  # one engine process a run
    python bench/rollout/engines.py --run sglang:1.5b:seeded --dry-run  # the plan, nothing loaded
    python bench/rollout/engines.py --report $OUT/engines_*.json --md bench/results/engines_<gpu>.md

(--report runs engines_report.py's report, which reads the JSONs alone.)

A run is ENGINE:SHAPE[:GROUP]: one process, one engine started once (model load and graph
capture are the expensive part), every mode of its group measured on it:

    builtin:SHAPE            the built-in engine, seeded (yatt's protocol seeds every sample)
    vllm:SHAPE:adapter       yatt's VLLMEngine (engine core in-process, as the adapter requires
                             for by-reference weight buckets), seeded and unseeded; and vLLM's
                             own LLM.generate on that same in-process engine (inproc_unseeded)
    vllm:SHAPE:native        vLLM's own LLM.generate at its defaults (engine core in its own
                             process, async scheduling), seeded and unseeded
    sglang:SHAPE:seeded      SGLang in deterministic mode (it reads per-request seeds only
                             there): yatt's SGLangEngine and SGLang's own Engine.generate on it
    sglang:SHAPE:unseeded    the same, deterministic mode off (its fast path)

Workloads, each at temperature 1 with EOS ignored (forced lengths): decode at batch 64 and 256
(128-token random prompts, 512 new tokens; tok/s counts new tokens), and a judge-like load
(1,024-token prompts, 128 new tokens, --judge-batch prompts): its prefill throughput is prompt
tokens / the time of the same call with 1 new token, its total is (prompt + new) tokens / the
time of the full call. Prompts are drawn afresh for every call, so no prefix cache hits. One
warm-up call per workload, then --repeats timed calls: median, min and max tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# The report lives in engines_report.py (--report calls it); its names and ENGINE_NAMES stay
# importable from here, where tests/test_bench_engines.py imports them (engines.*).
from _engine_shapes import ENGINE_NAMES, ENGINES, SHAPES  # noqa: F401
from engines_report import (  # noqa: F401
    COLUMNS,
    WAYS,
    adapter_ratios,
    build_report,
    builtin_ratios,
    cell_value,
    columns_of,
    fmt_cell,
    mode_name,
    table_rows,
    write_report,
)

GROUPS: dict[str, dict[str, tuple[str, ...]]] = {
    "builtin": {"": ("adapter_seeded",)},
    "vllm": {
        # inproc: vLLM's own LLM.generate on the adapter's in-process engine, which splits an
        # adapter/native gap into the adapter's own cost and the engine core's placement.
        "adapter": ("adapter_seeded", "adapter_unseeded", "inproc_unseeded"),
        "native": ("native_unseeded", "native_seeded"),
    },
    "sglang": {
        "seeded": ("adapter_seeded", "native_seeded"),
        "unseeded": ("adapter_unseeded", "native_unseeded"),
    },
}
DECODE_PROMPT_TOKENS = 128
# SGLang's attention backends, best first on Hopper: fa3 is its own default for MHA models
# there (server_args._get_default_attn_backend), flashinfer its default elsewhere.
SGLANG_ATTENTION = ("fa3", "flashinfer", "triton")


@dataclass(frozen=True)
class RunSpec:
    """One engine process: ENGINE:SHAPE[:GROUP] and the modes measured on it."""

    engine: str
    shape: str
    group: str
    modes: tuple[str, ...]

    @property
    def tag(self) -> str:
        return "_".join(p for p in (self.engine, self.shape, self.group) if p)


def parse_run(spec: str) -> RunSpec:
    """'vllm:0.5b:native' -> RunSpec; a clear ValueError naming the part that is wrong."""
    parts = spec.strip().split(":")
    engine = parts[0]
    if engine not in ENGINES:
        raise ValueError(f"--run {spec!r}: engine {engine!r} is not one of {ENGINES}")
    if len(parts) < 2 or parts[1] not in SHAPES:
        raise ValueError(f"--run {spec!r}: give a shape, one of {tuple(SHAPES)} (ENGINE:SHAPE)")
    group = parts[2] if len(parts) > 2 else ""
    groups = GROUPS[engine]
    if group not in groups or len(parts) > 3:
        choices = [g for g in groups if g] or ["none"]
        raise ValueError(f"--run {spec!r}: {engine}'s group is one of {choices}")
    return RunSpec(engine, parts[1], group, groups[group])


def parse_csv_ints(text: str) -> list[int]:
    if text.strip() == "none":  # --batches none: the judge-like load alone
        return []
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers separated by commas") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 1")
    return values


def summarize(seconds: list[float], tokens: int) -> dict:
    """tok/s of `tokens` per call: median, min and max over the timed calls."""
    rates = [tokens / s for s in seconds]
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": statistics.median(rates),
        "min_tok_s": min(rates),
        "max_tok_s": max(rates),
    }


def max_seq_len(args) -> int:
    return max(DECODE_PROMPT_TOKENS + args.new_tokens, args.judge_prompt + args.judge_new)


def max_batch(args) -> int:
    return max([*args.batches, args.judge_batch])


# ---- the plan (what --dry-run prints; also the settings written into the JSON) ----------------


def sglang_attention_choice(
    preferred: list[str], usable: dict[str, str | None]
) -> tuple[str, dict[str, str]]:
    """The first backend of `preferred` whose kernels are here; usable maps name -> None (here)
    or why not. Returns (backend, {skipped backend: why})."""
    skipped = {}
    for name in preferred:
        why = usable.get(name, "no check for this backend")
        if why is None:
            return name, skipped
        skipped[name] = why
    raise ValueError(
        f"--sglang-attention {','.join(preferred)}: none usable here ({skipped}); add triton"
    )


def sglang_kernels_here() -> dict[str, str | None]:
    """Which SGLang attention backends can load their kernels on this machine (no network)."""
    usable: dict[str, str | None] = {"triton": None if find_spec("triton") else "no triton"}
    cache = Path(os.environ.get("SGLANG_CACHE_DIR", "~/.cache/sglang")).expanduser()
    try:
        has_sgl_fa3 = find_spec("sgl_kernel.flash_ops") is not None
    except Exception:  # sgl_kernel's own import can fail in many ways where its kernels can't load
        has_sgl_fa3 = False
    # SGLang 0.5.17 loads FA3 from the `kernels` hub (kernels-community/sgl-flash-attn3, needs
    # the network or its lock file in SGLANG_CACHE_DIR), else from sgl_kernel.flash_ops.
    usable["fa3"] = (
        None
        if has_sgl_fa3 or (cache / "kernels.lock").exists()
        else f"no sgl_kernel.flash_ops and no {cache}/kernels.lock (the hub's FA3 kernels)"
    )
    usable["flashinfer"] = flashinfer_missing()
    return usable


def flashinfer_missing() -> str | None:
    """None if FlashInfer can build or load its kernels here, else why not: flashinfer-python
    compiles them at first use (nvcc) unless its prebuilt jit-cache package is installed."""
    if find_spec("flashinfer") is None:
        return "flashinfer not installed"
    if find_spec("flashinfer_jit_cache") is not None:
        return None
    nvcc = shutil.which("nvcc") or Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin/nvcc")
    if Path(nvcc).exists():
        return None
    return "no flashinfer-jit-cache and no nvcc to compile its kernels"


def engine_settings(run: RunSpec, args, sglang_usable: dict[str, str | None] | None) -> dict:
    """Every setting an engine is built with, as written into the JSON and the plan."""
    batch, seq = max_batch(args), max_seq_len(args)
    if run.engine == "builtin":
        return {"EngineConfig": {"dtype": "bfloat16", "max_batch_size": batch, "max_seq_len": seq}}
    if run.engine == "vllm":
        common = {
            "dtype": "bfloat16",
            "gpu_memory_utilization": args.memory,
            "max_model_len": seq,
            "max_num_seqs": batch,
            # Graphs up to the largest batch run (vLLM's default captures up to 2x max_num_seqs).
            "compilation_config": {"max_cudagraph_capture_size": batch},
            "attention_backend": "vLLM's choice (FLASH_ATTN with its FA3 on Hopper)",
        }
        if run.group == "adapter":
            return {
                **common,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0 (the adapter requires it; inproc mode "
                "calls LLM.generate on this same engine)",
                "enable_sleep_mode": True,
                "logprobs_mode": "processed_logprobs",
                "async_scheduling": "vLLM's default (on where the executor supports it)",
            }
        return {
            **common,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1 (vLLM's default: engine core in its own process)",
            "async_scheduling": "vLLM's default (on)",
        }
    attention, skipped = sglang_attention_choice(
        args.sglang_attention, sglang_usable if sglang_usable is not None else {}
    )
    settings = {
        "dtype": "bfloat16",
        "mem_fraction_static": args.memory,
        "context_length": seq + 2,  # SGLang serves 2 positions less than this
        "max_running_requests": batch,
        "cuda_graph_max_bs_decode": batch,
        "attention_backend": attention,
        "enable_deterministic_inference": run.group == "seeded",
        "enable_memory_saver": "True (the adapter's; native calls run on the adapter's engine)",
    }
    if skipped:
        settings["attention_backends_skipped"] = skipped
    if (sglang_usable or {}).get("flashinfer") is not None and run.group != "seeded":
        # SGLang samples with FlashInfer whenever it imports; without its kernels that fails.
        settings["sampling_backend"] = "pytorch"
    return settings


def plan(run: RunSpec, args, sglang_usable: dict[str, str | None] | None = None) -> dict:
    return {
        "run": run.tag,
        "engine": run.engine,
        "shape": run.shape,
        "model": SHAPES[run.shape],
        "modes": list(run.modes),
        "settings": engine_settings(run, args, sglang_usable),
        "workload": {
            "decode": {
                "batches": args.batches,
                "prompt_tokens": DECODE_PROMPT_TOKENS,
                "new_tokens": args.new_tokens,
            },
            "judge": {
                "batch": args.judge_batch,
                "prompt_tokens": args.judge_prompt,
                "new_tokens": args.judge_new,
            },
            "repeats": args.repeats,
            "temperature": 1.0,
            "ignore_eos": True,
        },
    }


# ---- models --------------------------------------------------------------------------------------


def model_dir(args, shape: str) -> Path:
    return Path(args.model_root) / f"qwen25-{shape}-shape"


def save_model(path: Path, shape: str) -> Path:
    """The shape with random bf16 weights and a tokenizer, saved once, reused by every process."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from yatt.testing import make_tokenizer

    config = Qwen2Config(
        **SHAPES[shape], rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
        bos_token_id=151643, eos_token_id=151643,
    )  # fmt: skip
    torch.manual_seed(0)
    # On the GPU: a 7B's random init on the host takes minutes.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    make_tokenizer().save_pretrained(tmp)
    tmp.rename(path)  # a half-written model is never taken for a whole one
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the engine built next in this process gets the memory back
    return path


# ---- engines -------------------------------------------------------------------------------------


def build_engine(run: RunSpec, path: Path, settings: dict):
    """The engine of `run`: a yatt adapter (builtin, vllm adapter, sglang), or vllm.LLM."""
    if run.engine == "builtin":
        from yatt.rollout import BuiltinEngine, EngineConfig

        return BuiltinEngine(path, config=EngineConfig(device="cuda", **settings["EngineConfig"]))
    if run.engine == "vllm":
        llm_kwargs = {
            "max_num_seqs": settings["max_num_seqs"],
            "compilation_config": settings["compilation_config"],
        }
        if run.group == "native":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            import vllm

            return vllm.LLM(
                model=str(path), dtype="bfloat16", seed=0,
                gpu_memory_utilization=settings["gpu_memory_utilization"],
                max_model_len=settings["max_model_len"], **llm_kwargs,
            )  # fmt: skip
        from yatt.rollout import VLLMConfig, VLLMEngine

        config = VLLMConfig(
            dtype="bfloat16",
            gpu_memory_utilization=settings["gpu_memory_utilization"],
            max_model_len=settings["max_model_len"],
            llm_kwargs=llm_kwargs,
        )  # seeded or not per call: generate() sets seed_each_sample, which the adapter reads per call
        return VLLMEngine(path, config=config)
    from yatt.rollout import SGLangConfig, SGLangEngine

    keys = ("max_running_requests", "cuda_graph_max_bs_decode", "attention_backend")
    kwargs = {k: settings[k] for k in keys}
    if "sampling_backend" in settings:
        kwargs["sampling_backend"] = settings["sampling_backend"]
    config = SGLangConfig(
        dtype="bfloat16",
        mem_fraction_static=settings["mem_fraction_static"],
        context_length=settings["context_length"],
        seed_each_sample=settings["enable_deterministic_inference"],
        engine_kwargs=kwargs,
    )
    return SGLangEngine(path, config=config)


def generate(run: RunSpec, engine, mode: str, ids: list[list[int]], new: int, seed: int) -> int:
    """One batch call in `mode`; returns the number of new tokens the engine gave back."""
    seeded = mode.endswith("_seeded")
    if mode.startswith("adapter"):
        from yatt.rollout import Request, SamplingParams

        if run.engine == "vllm":
            engine.config.seed_each_sample = seeded  # read per call by the adapter
        sampling = SamplingParams(
            max_new_tokens=new, ignore_eos=True, seed=seed if seeded else None
        )
        requests = [Request(prompt_ids=p) for p in ids]
        return sum(len(c.response_ids) for c in engine.generate(requests, sampling))
    seeds = [seed * 100_003 + i for i in range(len(ids))] if seeded else [None] * len(ids)
    if run.engine == "vllm":
        from vllm import SamplingParams as VSamplingParams

        params = [
            VSamplingParams(
                temperature=1.0, max_tokens=new, ignore_eos=True, seed=s, logprobs=0,
                detokenize=False,
            )
            for s in seeds
        ]  # fmt: skip
        llm = engine._llm if mode.startswith("inproc") else engine  # inproc: the adapter's LLM
        outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)
    params = [
        {"temperature": 1.0, "max_new_tokens": new, "ignore_eos": True}
        | ({"sampling_seed": s} if s is not None else {})
        for s in seeds
    ]
    outputs = engine._engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    return sum(len(o["output_ids"]) for o in outputs)


def random_prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 150000, (batch, length), generator=g).tolist()


def timed(run, engine, mode, batch, length, new, seed) -> float:
    import torch

    ids = random_prompts(batch, length, seed)
    torch.cuda.synchronize()
    start = time.perf_counter()
    got = generate(run, engine, mode, ids, new, seed)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if got != batch * new:
        raise RuntimeError(f"{mode}: {got} new tokens, expected {batch} x {new} (forced length)")
    return seconds


def measure_mode(run: RunSpec, engine, mode: str, args) -> dict:
    seed = iter(range(1000 * (1 + run.modes.index(mode)), 10**9))  # fresh prompts every call
    out: dict = {"decode": {}}
    for batch in args.batches:
        timed(run, engine, mode, batch, DECODE_PROMPT_TOKENS, 64, next(seed))  # warm-up
        seconds = [
            timed(run, engine, mode, batch, DECODE_PROMPT_TOKENS, args.new_tokens, next(seed))
            for _ in range(args.repeats)
        ]
        out["decode"][str(batch)] = summarize(seconds, batch * args.new_tokens)
        log(f"{run.tag} {mode} batch {batch}: {out['decode'][str(batch)]['tok_s']:,.0f} tok/s")
    b, p, n = args.judge_batch, args.judge_prompt, args.judge_new
    timed(run, engine, mode, b, p, 1, next(seed))  # warm-up
    prefill = [timed(run, engine, mode, b, p, 1, next(seed)) for _ in range(args.repeats)]
    total = [timed(run, engine, mode, b, p, n, next(seed)) for _ in range(args.repeats)]
    out["judge"] = {"prefill": summarize(prefill, b * p), "total": summarize(total, b * (p + n))}
    log(f"{run.tag} {mode} judge prefill: {out['judge']['prefill']['tok_s']:,.0f} tok/s")
    return out


def resolved_settings(run: RunSpec, engine) -> dict:
    """What the engine itself settled on (its defaults resolved), read back after start-up."""
    if run.engine == "builtin":
        return {}
    if run.engine == "sglang":
        args = engine._engine.server_args
        keys = (
            "attention_backend", "sampling_backend", "cuda_graph_max_bs_decode",
            "chunked_prefill_size", "max_running_requests", "disable_radix_cache",
            "enable_deterministic_inference", "disable_overlap_schedule", "mem_fraction_static",
        )  # fmt: skip
        return {k: getattr(args, k, None) for k in keys}
    llm = engine if run.group == "native" else engine._llm
    config = llm.llm_engine.vllm_config
    sizes = config.compilation_config.cudagraph_capture_sizes or []
    return {
        "async_scheduling": config.scheduler_config.async_scheduling,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "attention_backend": str(config.attention_config.backend),  # None: vLLM picks per GPU
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "cudagraph_capture_sizes": f"{min(sizes)}..{max(sizes)} ({len(sizes)})" if sizes else "-",
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
    }


def engine_version(engine: str) -> str:
    dist = {"builtin": "yatt-rollout"}.get(engine, engine)
    try:
        return f"{dist} {version(dist)}"
    except PackageNotFoundError:
        return f"{dist} (source tree)"


def close(run: RunSpec, engine) -> None:
    if run.engine == "vllm" and run.group == "native":
        # vllm.LLM has no close: its engine-core process ends with this one.
        shutdown = getattr(getattr(engine, "llm_engine", None), "shutdown", None)
        if shutdown:
            shutdown()
        return
    engine.close()


def run_engine(run: RunSpec, args) -> dict:
    import torch

    usable = sglang_kernels_here() if run.engine == "sglang" else None
    result = plan(run, args, usable)
    result.update(
        version=engine_version(run.engine),
        versions={d: engine_version(d) for d in ("yatt-rollout", "torch", "vllm", "sglang",
                                                 "sglang-kernel", "flashinfer-python")},
        device=torch.cuda.get_device_name(),
        commit=os.environ.get("YATT_COMMIT", "unknown"),
        results={},
        errors={},
    )  # fmt: skip
    path = save_model(model_dir(args, run.shape), run.shape)
    start = time.perf_counter()
    try:
        engine = build_engine(run, path, result["settings"])
    except Exception as exc:  # recorded: the report shows why the row is missing
        result["errors"]["startup"] = f"{type(exc).__name__}: {exc}"[:2000]
        return result
    result["startup_s"] = time.perf_counter() - start
    try:
        result["resolved"] = resolved_settings(run, engine)
    except Exception as exc:  # a renamed attribute costs this record, not the run
        result["resolved"] = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"{run.tag}: started in {result['startup_s']:.0f} s")
    try:
        for mode in run.modes:
            try:
                result["results"][mode] = measure_mode(run, engine, mode, args)
            except Exception as exc:  # one mode failing keeps the others' numbers
                result["errors"][mode] = f"{type(exc).__name__}: {exc}"[:2000]
                log(f"{run.tag} {mode}: FAILED {result['errors'][mode]}")
    finally:
        close(run, engine)
    return result


def log(text: str) -> None:
    print(text, flush=True)


# ---- the command line ----------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="ENGINE:SHAPE[:GROUP], e.g. vllm:0.5b:native")
    parser.add_argument("--prepare", help="shapes to save once, e.g. 0.5b,1.5b,7b")
    parser.add_argument(
        "--batches",
        type=parse_csv_ints,
        default=[64, 256],
        help="decode batch sizes, e.g. 64,256; 'none': the judge-like load alone",
    )
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--judge-batch", type=int, default=256)
    parser.add_argument("--judge-prompt", type=int, default=1024)
    parser.add_argument("--judge-new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", type=float, default=0.5, help="vLLM/SGLang's GPU share")
    parser.add_argument(
        "--sglang-attention",
        type=lambda s: s.split(","),
        default=list(SGLANG_ATTENTION),
        help="SGLang attention backends, first usable here wins",
    )
    parser.add_argument("--model-root", default="/tmp/yatt-bench/engines")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, load nothing")
    parser.add_argument("--out", help="JSON file for this run")
    parser.add_argument("--report", nargs="*", help="JSON files to merge into --md")
    parser.add_argument("--md", help="markdown written from --report files")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if sum(x is not None for x in (args.run, args.prepare, args.report)) != 1:
        parser.error("give one of --run, --prepare or --report")
    if args.report is not None and not args.md:
        parser.error("--report needs --md (the markdown file to write)")
    if args.run and not (args.out or args.dry_run):
        parser.error("--run needs --out (the JSON file to write) or --dry-run")
    for name in ("new_tokens", "judge_batch", "judge_prompt", "judge_new", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 < args.memory <= 1.0:
        parser.error("--memory must be in (0, 1]")
    bad = [b for b in args.sglang_attention if b not in SGLANG_ATTENTION]
    if bad:
        parser.error(f"--sglang-attention {bad}: use some of {SGLANG_ATTENTION}")
    try:
        args.run_spec = parse_run(args.run) if args.run else None
        args.prepare_shapes = (
            [parse_run(f"builtin:{s}").shape for s in args.prepare.split(",")]
            if args.prepare
            else []
        )
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.report is not None:
        print(write_report(args.report, args.md))
        return 0
    if args.prepare_shapes:
        for shape in args.prepare_shapes:
            if args.dry_run:
                log(f"would save {shape} to {model_dir(args, shape)}")
                continue
            start = time.perf_counter()
            save_model(model_dir(args, shape), shape)
            log(f"{shape}: {model_dir(args, shape)} ({time.perf_counter() - start:.0f} s)")
        return 0
    run = args.run_spec
    if args.dry_run:
        usable = {b: None for b in SGLANG_ATTENTION} if run.engine == "sglang" else None
        shown = plan(run, args, usable)
        shown["note"] = "SGLang's backend is chosen on the GPU machine from the kernels there"
        shown["model_dir"] = str(model_dir(args, run.shape))
        print(json.dumps(shown, indent=2))
        return 0
    result = run_engine(run, args)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 1 if "startup" in result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
