"""Issue 45, Deliver 2's "measure both" and Deliver 4: the built-in engine's two ways of serving a
LoRA adapter, and a self-judging GenRM on one resident base, side by side in one run.

    python3 bench/lora/lora_modes_gpu.py --out-dir OUT            # 7B shape, rank 16, one GPU
    python bench/lora/lora_modes_gpu.py --smoke --out-dir /tmp/x  # tiny shapes on CPU: the plumbing

1. decode, merge vs beside, at equal memory: the policy's engine (same slots, same context, so
   the same KV cache) with a random rank-16 adapter on every linear layer, served merged into
   the weights (EngineConfig.lora_mode="merge") or beside the base GEMMs ("beside"). Per mode:
   the adapter sync's time (merge: a pass over the targets' weights; beside: the factors'
   copy), the decode step's time per batch bucket (engine.run_decode_steps, its CUDA graphs),
   and the bytes beside the weights (engine.adapter_bytes(): merge keeps float32 factors and
   the base values it cannot un-merge exactly; beside serves bf16 factors).
2. self-judge: the policy (LoRA, its engine) and a judge that is the same base model: a
   separate judge engine loading the base again (what reward.judge_dir=<the policy's folder>
   does) against the policy engine's base view (reward.judge_dir=policy:
   engine.without_adapter()). Per variant, one policy call then one judge call; the device's
   peak memory (torch.cuda.max_memory_allocated, reset between variants) and the engines'
   resident bytes.

Writes lora_modes_<gpu>.json/.md under --out-dir (lora_modes_cpu_smoke.* with --smoke), the
commit named. Estimates on an H200 (not measured yet): the 7B model saved ~1 min, each engine
~30 s to load, each timing under a minute.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))
import _step_setup as setup  # bench/step's helpers: shapes, saved random models
from measured_commit import measured_commit
from report import write_report

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

LORA_RANK, LORA_ALPHA = 16, 32.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODES = ("merge", "beside")


def adapter_pairs(model: torch.nn.Module, device: torch.device, seed: int = 0):
    """A random rank-16 adapter on every decoder linear, in the sync's wire format (float32,
    what TorchPolicy.named_adapter_weights() sends), B nonzero as after training."""
    gen = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            A = torch.randn(LORA_RANK, module.in_features, generator=gen) * 0.01
            B = torch.randn(module.out_features, LORA_RANK, generator=gen) * 0.01
            yield name + ".lora_A", A.to(device)
            yield name + ".lora_B", B.to(device)
            yield name + ".lora_scaling", torch.tensor(LORA_ALPHA / LORA_RANK, device=device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_engine(engine: BuiltinEngine) -> None:
    """Give the engine's memory back before the next one (regions slept, then closed)."""
    engine.sleep()
    engine.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_config(args, mode: str, prefix: str) -> EngineConfig:
    return EngineConfig(
        device=args.device,
        dtype="float32" if args.smoke else "bfloat16",
        max_batch_size=args.slots,
        max_seq_len=args.max_seq_len,
        region_prefix=prefix,
        lora_mode=mode,
    )


def time_decode(engine: BuiltinEngine, args, device: torch.device) -> dict:
    """Milliseconds per decode step, per batch bucket (the engine's graphs, replayed), each
    step attending to the middle attention span (a rollout's typical context)."""
    spans = engine.attention_spans
    span = spans[len(spans) // 2]
    out = {}
    for batch in engine.decode_batch_buckets:
        engine.run_decode_steps(span=span, num_steps=2, batch=batch)  # warm
        synchronize(device)
        start = time.perf_counter()
        engine.run_decode_steps(span=span, num_steps=args.decode_steps, batch=batch)
        synchronize(device)
        out[str(batch)] = (time.perf_counter() - start) * 1e3 / args.decode_steps
    return out


def measure_mode(policy_dir: Path, mode: str, args, device: torch.device) -> dict:
    engine = BuiltinEngine(policy_dir, config=engine_config(args, mode, f"modes-{mode}"))
    pairs = list(adapter_pairs(engine.model, device))
    synchronize(device)
    start = time.perf_counter()
    engine.update_weights(pairs)
    synchronize(device)
    sync_s = time.perf_counter() - start
    # A call first: the decode step's graphs captured with the adapter's hooks and buffers.
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    engine.generate([Request(prompt_ids=[5, 6, 7])], greedy)
    result = {
        "sync_s": sync_s,
        "decode_ms": time_decode(engine, args, device),
        "adapter_bytes": engine.adapter_bytes(),
        "resident_bytes": engine.resident_bytes(),
        "kv_cache_bytes": engine.kv_cache_bytes,
    }
    free_engine(engine)
    return result


def judge_like_calls(policy, judge, args) -> None:
    """One policy call (adapter on, sampling) then one judge call (greedy, a verdict's tokens)
    over prompts of the context's half: what a rollout then its judging hold at once."""
    prompt = list(range(3, 3 + args.max_seq_len // 2))
    policy.generate(
        [Request(prompt_ids=prompt)] * args.slots,
        SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=0),
    )
    judge.generate(
        [Request(prompt_ids=prompt)] * args.slots,
        SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True),
    )


def measure_self_judge(policy_dir: Path, variant: str, args, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mode = "beside" if variant == "shared" else "merge"
    policy = BuiltinEngine(policy_dir, config=engine_config(args, mode, f"sj-{variant}"))
    policy.update_weights(adapter_pairs(policy.model, device))
    if variant == "shared":
        judge, engines = policy.without_adapter(), [policy]
    else:
        judge = BuiltinEngine(policy_dir, config=engine_config(args, "merge", "sj-judge"))
        engines = [policy, judge]
    judge_like_calls(policy, judge, args)
    synchronize(device)
    result = {
        "resident_bytes": sum(e.resident_bytes() for e in engines),
        "weight_bytes": sum(e._weight_bytes for e in engines),
        "num_engines": len(engines),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    for engine in engines:
        free_engine(engine)
    return result


def markdown(results: dict) -> str:
    lines = [
        f"# LoRA in the built-in engine: merge vs beside, self-judge ({results['device']})",
        "",
        f"commit {results['commit']}, policy shape {results['shape']}, rank {LORA_RANK}, "
        f"{results['slots']} slots x {results['max_seq_len']} tokens",
        "",
        "| mode | sync s | adapter MiB | "
        + " | ".join(f"decode ms b={b}" for b in results["modes"]["merge"]["decode_ms"])
        + " |",
        "|---|---:|---:|" + "---:|" * len(results["modes"]["merge"]["decode_ms"]),
    ]
    for mode, r in results["modes"].items():
        decode = " | ".join(f"{ms:.3f}" for ms in r["decode_ms"].values())
        lines.append(
            f"| {mode} | {r['sync_s']:.4f} | {r['adapter_bytes'] / 2**20:.1f} | {decode} |"
        )
    lines += [
        "",
        "| judge | engines | weights GiB | resident GiB | peak GiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant, r in results["self_judge"].items():
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}"
        lines.append(
            f"| {variant} | {r['num_engines']} | {r['weight_bytes'] / 2**30:.2f} | "
            f"{r['resident_bytes'] / 2**30:.2f} | {peak} |"
        )
    lines += ["", "ratios (beside / merge, shared / separate): " + json.dumps(results["ratios"])]
    return "\n".join(lines) + "\n"


def ratios(results: dict) -> dict:
    merge, beside = results["modes"]["merge"], results["modes"]["beside"]
    out = {
        f"decode_b{b}": beside["decode_ms"][b] / merge["decode_ms"][b] for b in merge["decode_ms"]
    }
    out["sync_s"] = beside["sync_s"] / merge["sync_s"]
    shared, separate = results["self_judge"]["shared"], results["self_judge"]["separate"]
    out["self_judge_resident"] = shared["resident_bytes"] / separate["resident_bytes"]
    if shared["peak_bytes"] is not None:
        out["self_judge_peak"] = shared["peak_bytes"] / separate["peak_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--shape", default="7b", choices=sorted(setup.SHAPES))
    parser.add_argument("--slots", type=int, default=256, help="KV-cache slots (equal memory)")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=50)
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/yatt-bench-lora-modes"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.slots, args.max_seq_len, args.decode_steps = "cpu", 8, 128, 2
        args.shape = "tiny"
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --smoke on CPU)")
        args.device = "cuda"
    device = torch.device(args.device)
    policy_dir, _ = setup.make_models(args.models_dir, tiny=args.smoke, shapes=(args.shape, "tiny"))
    name = "cpu_smoke" if args.smoke else setup.device_name()
    results = {
        "device": name,
        "commit": measured_commit(),
        "shape": args.shape,
        "slots": args.slots,
        "max_seq_len": args.max_seq_len,
        "modes": {mode: measure_mode(policy_dir, mode, args, device) for mode in MODES},
        "self_judge": {
            v: measure_self_judge(policy_dir, v, args, device) for v in ("separate", "shared")
        },
    }
    results["ratios"] = ratios(results)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    md = args.out_dir / f"lora_modes_{name}.md"
    write_report(md, markdown(results), data=results, json_path=md.with_suffix(".json"))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
