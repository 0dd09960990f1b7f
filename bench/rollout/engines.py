"""Decode throughput of the built-in engine, vLLM and SGLang on one GPU, same model, same workload.

    python bench/rollout/engines.py --engine builtin --out $OUT/engines_builtin.json   # one engine a process
    python bench/rollout/engines.py --engine vllm --out $OUT/engines_vllm.json
    python bench/rollout/engines.py --engine vllm --unseeded --out $OUT/engines_vllm_unseeded.json
    python bench/rollout/engines.py --report $OUT/engines_*.json --md bench/results/engines_<gpu>.md

Workload: the Qwen2.5-0.5B shape with random bf16 weights (saved once with `save_pretrained`),
prompts of 128 random tokens, 512 new tokens per sample (EOS ignored), temperature 1, batch 64
and 256 in one call. One warm-up call, then --repeats timed calls; the median is reported.
yatt's protocol seeds every sample (reproducible rollouts); vLLM and SGLang pay for that (vLLM:
per-request generators; SGLang: deterministic mode), so --unseeded measures their fast path too.
Each engine runs in its own process: vLLM and SGLang each bring their own dependency set, and a
process that exits returns every byte of GPU memory before the next engine starts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _rollout_checks import RUN, build_model, prompts

from yatt.rollout import BuiltinEngine, EngineConfig, SamplingParams

PROMPT_TOKENS = 128


def save_model(path: Path) -> Path:
    """The 0.5B-shaped model with a tokenizer, saved once and reused by every engine's process."""
    if (path / "config.json").exists():
        return path
    from yatt.testing import make_tokenizer

    model = build_model(seed=0).cpu()
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def build_engine(name: str, model_dir: Path, max_batch: int, new_tokens: int):
    max_seq_len = PROMPT_TOKENS + new_tokens
    if name == "builtin":
        config = EngineConfig(
            device=RUN.device, dtype="bfloat16", max_batch_size=max_batch, max_seq_len=max_seq_len
        )
        return BuiltinEngine(model_dir, config=config)
    if name == "vllm":
        from yatt.rollout import VLLMConfig, VLLMEngine

        config = VLLMConfig(
            gpu_memory_utilization=0.5,
            max_model_len=max_seq_len,
            seed_each_sample=not ARGS.unseeded,
            llm_kwargs={"max_num_seqs": max_batch},
        )
        return VLLMEngine(model_dir, config=config)
    if name == "sglang":
        from yatt.rollout import SGLangConfig, SGLangEngine

        kwargs = {"max_running_requests": max_batch, "attention_backend": ARGS.sglang_attention}
        config = SGLangConfig(
            mem_fraction_static=0.5,
            context_length=max_seq_len + 2,  # SGLang serves 2 positions less than this
            seed_each_sample=not ARGS.unseeded,
            engine_kwargs=kwargs,
        )
        return SGLangEngine(model_dir, config=config)
    raise ValueError(f"--engine {name!r}: use builtin, vllm or sglang")


def generate_natively(engine, requests, new_tokens: int) -> list[int]:
    """The engine's own batch call, past our adapter: how much of the time is the adapter's."""
    ids = [list(r.prompt_ids) for r in requests]
    if ARGS.engine == "vllm":
        params = engine._vllm.SamplingParams(
            max_tokens=new_tokens, ignore_eos=True, logprobs=0, detokenize=False
        )
        prompts_in = [{"prompt_token_ids": p} for p in ids]
        outputs = engine._llm.generate(prompts_in, params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]
    params = {"max_new_tokens": new_tokens, "ignore_eos": True}
    outputs = engine._engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    return [len(o["output_ids"]) for o in outputs]


def time_generate(engine, batch: int, new_tokens: int, seed: int) -> float:
    requests = prompts(batch, PROMPT_TOKENS, seed=seed)
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, seed=seed)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if ARGS.native:
        lengths = generate_natively(engine, requests, new_tokens)
    else:
        lengths = [len(c.response_ids) for c in engine.generate(requests, sampling)]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert sum(lengths) == batch * new_tokens, f"short samples: {sorted(set(lengths))}"
    return seconds


def engine_version(name: str) -> str:
    if name == "builtin":
        return "yatt " + version("yatt-rollout") if _installed("yatt-rollout") else "yatt (src)"
    return f"{name} {version(name)}"


def _installed(dist: str) -> bool:
    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


def run_engine(args) -> dict:
    model_dir = save_model(Path(args.model_dir))
    start = time.perf_counter()
    engine = build_engine(args.engine, model_dir, max(args.batches), args.new_tokens)
    result = {
        "engine": args.engine,
        "version": engine_version(args.engine),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "startup_s": time.perf_counter() - start,
        "new_tokens": args.new_tokens,
        "prompt_tokens": PROMPT_TOKENS,
        "rows": {},
    }
    result["label"] = args.engine + (" unseeded" if args.unseeded else "")
    result["label"] += " native batch call" if args.native else ""
    if args.engine == "sglang":
        result["label"] += f" ({args.sglang_attention} attention)"
    try:
        for batch in args.batches:
            time_generate(engine, batch, min(args.new_tokens, 64), seed=1)  # warm-up
            seconds = [
                time_generate(engine, batch, args.new_tokens, seed=2 + i)
                for i in range(args.repeats)
            ]
            median = statistics.median(seconds)
            result["rows"][str(batch)] = {
                "seconds": seconds,
                "median_s": median,
                "tok_s": batch * args.new_tokens / median,
            }
            print(
                f"{args.engine} batch {batch}: {batch * args.new_tokens / median:,.0f} tok/s "
                f"(median of {seconds})",
                flush=True,
            )
    finally:
        engine.close()
    return result


def write_report(paths: list[str], md_path: str) -> None:
    loaded = [json.loads(Path(p).read_text()) for p in sorted(paths)]
    results = {r.get("label", r["engine"]): r for r in loaded}
    batches = sorted({int(b) for r in results.values() for b in r["rows"]})
    device = next(iter(results.values()))["device"]
    lines = [
        f"# Decode throughput by engine ({device})",
        "",
        "Qwen2.5-0.5B shape, random bf16 weights, 128 prompt tokens, "
        f"{next(iter(results.values()))['new_tokens']} new tokens per sample, temperature 1, "
        "EOS ignored; median of the timed calls, one process per engine, one device call.",
        "",
        "| engine | version | startup s | "
        + " | ".join(f"batch {b} tok/s" for b in batches)
        + " | "
        + " | ".join(f"batch {b} vs built-in" for b in batches)
        + " |",
        "|---|---|---:|" + "---:|" * (2 * len(batches)),
    ]
    base = results.get("builtin")
    for name, r in results.items():
        cells = [
            f"{r['rows'][str(b)]['tok_s']:,.0f}" if str(b) in r["rows"] else "-" for b in batches
        ]
        ratios = []
        for b in batches:
            if base and str(b) in base["rows"] and str(b) in r["rows"]:
                ratios.append(f"{r['rows'][str(b)]['tok_s'] / base['rows'][str(b)]['tok_s']:.2f}x")
            else:
                ratios.append("-")
        lines.append(
            f"| {name} | {r['version']} | {r['startup_s']:.0f} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(ratios)
            + " |"
        )
    Path(md_path).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("builtin", "vllm", "sglang"))
    parser.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256]
    )
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", default="/tmp/yatt-bench/qwen25-05b-shape")
    parser.add_argument("--native", action="store_true", help="vLLM/SGLang's own batch call")
    parser.add_argument("--unseeded", action="store_true", help="no per-sample seeds (fast path)")
    parser.add_argument("--sglang-attention", default="triton", help="SGLang attention_backend")
    parser.add_argument("--out", help="JSON file for this engine's results")
    parser.add_argument("--report", nargs="*", help="JSON files to merge into --md")
    parser.add_argument("--md", help="markdown table written from --report files")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args(sys.argv[1:])
    if ARGS.report:
        write_report(ARGS.report, ARGS.md)
    else:
        outcome = run_engine(ARGS)
        Path(ARGS.out).write_text(json.dumps(outcome, indent=2))
