"""GPU verification of yatt-rollout's built-in engine, in one command (about 2-4 minutes).

    python bench/rollout_gpu.py                 # writes bench/results/rollout_<device>.json/.md
    python bench/rollout_gpu.py --skip-static   # without HF generate + static cache (compiles)
    python bench/rollout_gpu.py --smoke         # tiny model on CPU: checks the script runs

Needs CUDA, torch_memory_saver (yatt-placement[cuda]) and yatt-rollout installed. Checks, each
PASS/FAIL (the script exits 1 if any fails):
  1. sleep() returns >= 95% of the engine's GPU memory (torch.cuda.mem_get_info, baseline taken
     after a warm-up engine, so the CUDA kernels and library handles that the first engine of a
     process loads, and no engine can give back, are reported apart); wake_up() restores the
     weights bit for bit and greedy outputs agree (tie-aware, see compare_greedy); trainer
     offload/onload likewise.
  2. update_weights from a trainer copy: engine logprobs match the trainer's forward pass within
     bf16 tolerance; weight-sync bandwidth (GPU->GPU and pinned CPU->GPU) in GB/s.
  3. CUDA-graph decode agrees with eager decode: tie-aware in bf16, and strictly in float32.
  4. Throughput on a Qwen2.5-0.5B-shaped random bf16 model, batch 64 and 256, prompt 128, 512
     forced new tokens, against HF generate (dynamic and static cache, the same 512 tokens; reported
     as tokens/s) and the memory-bandwidth roofline. Bar: >= 10x HF generate (dynamic cache)
     at batch 256. Also: decode-graph time per attention span, and a kernel-time profile of
     the decode step (where the time goes).

Random-weight bf16 models have near-ties in their logits everywhere (logits are rounded to bf16
before the argmax), so two correct runs whose kernels round differently can pick different
greedy tokens. The comparisons therefore check the logprobs up to the first differing token
and that, at that token, both runs' chosen tokens had the same logprob (a tie).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from yatt.placement import offload, onload
from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from _decode_profile import profile_decode

PROMPT_LEN, NEW_TOKENS = 128, 512
HF_TOKENS = {64: 512, 256: 512}  # the same forced length as yatt: the issue's workload
DEVICE = "cuda"
SMOKE = False  # --smoke: a tiny model on CPU, to test this script without a GPU
NOMINAL_HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
CHECKS: dict[str, bool] = {}
CHECK_DETAILS: dict[str, str] = {}


def qwen25_05b_config() -> Qwen2Config:
    # Qwen2.5-0.5B's shape; --smoke shrinks the layers and keeps the vocabulary.
    big = dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864
    )
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    rest = dict(vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, eos_token_id=151643)
    return Qwen2Config(
        **(small if SMOKE else big), **rest, num_key_value_heads=2, bos_token_id=151643
    )


def build_model(seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(
            qwen25_05b_config(), dtype=dtype, attn_implementation="sdpa"
        )
    return model.eval().requires_grad_(False)


def free_bytes(*, empty_cache: bool = False) -> int:
    gc.collect()
    if DEVICE == "cpu":
        return 0
    torch.cuda.synchronize()
    if empty_cache:
        torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def reserved_by_pool() -> dict:
    """What torch's allocator still reserves, per memory pool (tms regions are pools too)."""
    if DEVICE == "cpu":
        return {}
    pools: dict[str, dict] = {}
    for seg in torch.cuda.memory_snapshot():
        row = pools.setdefault(str(seg.get("segment_pool_id")), {"reserved": 0, "allocated": 0})
        row["reserved"] += seg["total_size"]
        row["allocated"] += seg["allocated_size"]
    return pools


def compare_greedy(a, b) -> dict:
    """Greedy runs a and b, sample by sample: where they first differ and how close they are.

    prefix_max_diff: largest logprob difference before the first differing token.
    tie_max_gap: at each first differing token, |logprob chosen in a - logprob chosen in b|;
        both were the argmax of their run, so near 0 means a tie, large means a real change.
    """
    first, diffs, gaps, compared, total = [], [0.0], [0.0], 0, 0
    for ca, cb in zip(a, b, strict=True):
        n = min(len(ca.response_ids), len(cb.response_ids))
        k = next((i for i in range(n) if ca.response_ids[i] != cb.response_ids[i]), n)
        first.append(k if k < n else None)
        diffs += [abs(x - y) for x, y in zip(ca.logprobs[:k], cb.logprobs[:k], strict=True)]
        if k < n:
            gaps.append(abs(ca.logprobs[k] - cb.logprobs[k]))
        compared, total = compared + k, total + n
    return {
        "num_identical": sum(k is None for k in first),
        "num": len(first),
        "first_divergence": first,
        "prefix_max_diff": max(diffs),
        "tie_max_gap": max(gaps),
        "compared_fraction": compared / max(total, 1),
    }


def agrees(cmp: dict, *, atol: float, min_fraction: float) -> bool:
    return (
        cmp["prefix_max_diff"] <= atol
        and cmp["tie_max_gap"] <= atol
        and cmp["compared_fraction"] >= min_fraction
    )


def describe(cmp: dict) -> str:
    return (
        f"{cmp['num_identical']}/{cmp['num']} identical, first divergences "
        f"{[k for k in cmp['first_divergence'] if k is not None]}, prefix logprob diff "
        f"{cmp['prefix_max_diff']:.1e}, tie gap {cmp['tie_max_gap']:.1e}"
    )


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def check(name: str, ok: bool, detail: str) -> None:
    CHECKS[name] = bool(ok)
    CHECK_DETAILS[name] = detail
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def prompts(num: int, length: int, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 150000, (num, length), generator=g)
    return [Request(prompt_ids=row.tolist()) for row in ids]


def greedy(n_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n_tokens, ignore_eos=True)


def engine_config(batch: int, dtype: str = "bfloat16", **kwargs) -> EngineConfig:
    seq_len = PROMPT_LEN + NEW_TOKENS
    # keep_graphs_asleep=False: the memory check expects sleep to return every byte.
    kwargs.setdefault("keep_graphs_asleep", False)
    return EngineConfig(
        device=DEVICE, dtype=dtype, max_batch_size=batch, max_seq_len=seq_len, **kwargs
    )


def trainer_logprobs(model, completions) -> list[torch.Tensor]:
    out = []
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.response_ids], device=DEVICE)
        logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(c.prompt_ids) :, None])[:, 0]
        out.append(lp.cpu())
    return out


def engine_tensors(engine) -> dict[str, torch.Tensor]:
    model = engine.model
    return {
        name: t.detach().cpu().clone()
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }


def bench_memory_and_weights(results: dict) -> None:
    # The first engine of a process also loads CUDA kernels and creates cuBLAS handles: process
    # memory that no engine can give back. A warm-up engine (own regions, left asleep) pays it.
    cold = free_bytes(empty_cache=True)
    warm = BuiltinEngine(build_model(seed=0), config=engine_config(64, region_prefix="warmup"))
    warm.generate(prompts(64, PROMPT_LEN), greedy(8))
    warm.generate(prompts(8, PROMPT_LEN), SamplingParams(max_new_tokens=8, seed=0))
    warm.sleep()
    warm.close()
    del warm
    base = free_bytes(empty_cache=True)
    engine = BuiltinEngine(build_model(seed=0), config=engine_config(64))
    reqs = prompts(8, PROMPT_LEN)
    engine.generate(prompts(64, PROMPT_LEN), greedy(8))  # capture graphs, touch all memory
    before = engine.generate(reqs, greedy(32))
    again = engine.generate(reqs, greedy(32))  # control: is the engine repeatable at all?
    tensors = engine_tensors(engine)
    # empty_cache: the model's pre-engine copy is free but cached
    used = max(base - free_bytes(empty_cache=True), 1)
    engine.sleep()
    returned = free_bytes() - (base - used)
    left_reserved = reserved_by_pool()
    engine.wake_up()
    is_restored = all(torch.equal(t, tensors[n]) for n, t in engine_tensors(engine).items())
    after = engine.generate(reqs, greedy(32))
    wake, repeat = compare_greedy(before, after), compare_greedy(before, again)
    results["sleep"] = {
        "process_bytes_first_engine": cold - base,
        "engine_bytes": used,
        "returned_bytes": returned,
        "returned_fraction": returned / used,
        "reserved_by_pool_while_asleep": left_reserved,
        "weights_bit_identical_after_wake": is_restored,
        "greedy_after_wake_vs_before": wake,
        "greedy_repeat_vs_before": repeat,
    }
    check(
        "sleep returns >= 95%",
        returned / used >= 0.95,
        f"{returned / 2**30:.3f} of {used / 2**30:.3f} GiB (the process's first engine also "
        f"left {(cold - base) / 2**30:.3f} GiB of kernels/handles, outside any engine)",
    )
    check(
        "wake_up keeps weights and outputs",
        is_restored and agrees(wake, atol=0.1, min_fraction=0.5),
        f"weights bit-identical={is_restored}; after wake: {describe(wake)}; "
        f"repeat without sleep: {describe(repeat)}",
    )

    # Trainer: a separate bf16 copy with other weights, offloaded/onloaded by yatt.placement.
    trainer = build_model(seed=1)
    ref = trainer_logprobs(trainer, before[:2])
    t_base = free_bytes()
    moved = offload(trainer)
    t_freed = free_bytes() - t_base
    onload(trainer)
    same_t = all(
        torch.equal(a, b) for a, b in zip(trainer_logprobs(trainer, before[:2]), ref, strict=True)
    )
    results["trainer_offload"] = {
        "moved_bytes": moved,
        "freed_bytes": t_freed,
        "outputs_unchanged": same_t,
    }
    check(
        "trainer offload frees >= 95%",
        t_freed >= 0.95 * moved,
        f"{t_freed / 2**30:.2f} of {moved / 2**30:.2f} GiB",
    )
    check("trainer onload keeps outputs", same_t, "logprobs bit-identical")

    # Weight sync GPU->GPU, then logprobs against the trainer's forward pass.
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    sync()
    t0 = time.perf_counter()
    engine.update_weights(trainer.named_parameters())
    gpu_s = time.perf_counter() - t0
    sampled = engine.generate(
        prompts(16, PROMPT_LEN, seed=3), SamplingParams(max_new_tokens=64, seed=0, ignore_eos=True)
    )
    theirs = trainer_logprobs(trainer, sampled)
    diffs = torch.cat(
        [(torch.tensor(c.logprobs) - t).abs() for c, t in zip(sampled, theirs, strict=True)]
    )
    # What a stale policy would look like: the engine's own old weights on the same tokens.
    old = build_model(seed=0)
    stale = torch.cat(
        [(o - t).abs() for o, t in zip(trainer_logprobs(old, sampled), theirs, strict=True)]
    )
    del old
    # Pinned CPU -> GPU, as after a trainer offload.
    offload(trainer)
    cpu_pairs = list(trainer.named_parameters())
    sync()
    t0 = time.perf_counter()
    engine.update_weights(cpu_pairs)
    cpu_s = time.perf_counter() - t0
    del cpu_pairs, trainer
    results["weight_sync"] = {
        "bytes": nbytes,
        "gpu_to_gpu_GBps": nbytes / gpu_s / 1e9,
        "pinned_cpu_to_gpu_GBps": nbytes / cpu_s / 1e9,
        "logprob_abs_diff_mean": diffs.mean().item(),
        "logprob_abs_diff_max": diffs.max().item(),
        "stale_weights_abs_diff_mean": stale.mean().item(),
    }
    ok = diffs.mean().item() < 0.02 and diffs.max().item() < 0.5 and stale.mean() > 5 * diffs.mean()
    check(
        "logprobs match trainer after update_weights",
        ok,
        f"mean {diffs.mean():.4f} max {diffs.max():.3f} (stale weights: mean {stale.mean():.3f}); "
        f"sync {nbytes / gpu_s / 1e9:.1f} GB/s GPU->GPU, {nbytes / cpu_s / 1e9:.1f} GB/s CPU->GPU",
    )
    engine.close()
    del engine
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def bench_graph_matches_eager(results: dict) -> None:
    reqs, rows = prompts(8, PROMPT_LEN, seed=5), {}
    for dtype in (torch.bfloat16, torch.float32):
        outs = []
        for use_graph in (False, True):
            config = engine_config(
                8, dtype=str(dtype).removeprefix("torch."), use_cuda_graph=use_graph
            )
            engine = BuiltinEngine(build_model(seed=0, dtype=dtype), config=config)
            outs.append(engine.generate(reqs, greedy(48)))
            engine.close()
        rows[str(dtype)] = compare_greedy(*outs)
    results["graph_vs_eager"] = rows
    bf16, fp32 = rows["torch.bfloat16"], rows["torch.float32"]
    check(
        "CUDA graph decode == eager decode",
        agrees(bf16, atol=0.1, min_fraction=0.5) and agrees(fp32, atol=1e-3, min_fraction=0.9),
        f"bf16: {describe(bf16)}; float32: {describe(fp32)}",
    )


def time_call(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def bench_throughput(results: dict, skip_static: bool) -> None:
    rows = results["throughput"] = {}
    model = build_model(seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    nominal = next((bw for key, bw in NOMINAL_HBM_BYTES_PER_S.items() if key in name), None)
    big = torch.empty(2**30 if DEVICE == "cuda" else 2**24, dtype=torch.uint8, device=DEVICE)
    copy_s = min(time_call(big.clone) for _ in range(5))
    measured_bw = 2 * big.numel() / copy_s  # read + write
    big = None
    results["roofline"] = {
        "weight_bytes": weight_bytes,
        "nominal_hbm_Bps": nominal,
        "measured_copy_Bps": measured_bw,
    }
    for batch in (64, 256):
        row = rows[batch] = _bench_hf(model, batch, skip_static)
        row.update(_bench_engine(batch))
        for label, bw in (("nominal", nominal), ("measured", measured_bw)):
            if bw:
                row[f"roofline_weights_{label}_tok_s"] = batch / (weight_bytes / bw)
                # Attention reads the span bucket of each step: mean fraction of the cache.
                step_bytes = weight_bytes + row["kv_cache_bytes"] * row["mean_span_fraction"]
                row[f"roofline_weights_kv_{label}_tok_s"] = batch / (step_bytes / bw)
        rounded = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
        print(f"batch {batch}: {json.dumps(rounded)}", flush=True)
    ratio = rows[256]["yatt_tok_s"] / rows[256]["hf_dynamic_tok_s"]
    check(">= 10x HF generate at batch 256", ratio >= 10, f"{ratio:.1f}x")


def _bench_hf(model, batch: int, skip_static: bool) -> dict:
    ids = torch.tensor(
        [r.prompt_ids for r in prompts(batch, PROMPT_LEN, seed=batch)], device=DEVICE
    )
    n_hf = HF_TOKENS[batch]
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        max_new_tokens=n_hf,
        min_new_tokens=n_hf,
        pad_token_id=0,
    )
    row = {"hf_new_tokens": n_hf}
    model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    row["hf_dynamic_tok_s"] = batch * n_hf / time_call(lambda: model.generate(ids, **kwargs))
    if batch == 256 and not skip_static and not SMOKE:
        static = {**kwargs, "cache_implementation": "static"}
        row["hf_static_first_call_s"] = time_call(lambda: model.generate(ids, **static))
        row["hf_static_tok_s"] = batch * n_hf / time_call(lambda: model.generate(ids, **static))
    return row


def _bench_engine(batch: int) -> dict:
    reqs = prompts(batch, PROMPT_LEN, seed=batch)
    engine = BuiltinEngine(build_model(seed=0), config=engine_config(batch))
    engine.generate(reqs, SamplingParams(max_new_tokens=16, ignore_eos=True, seed=0))  # capture
    first_token = SamplingParams(max_new_tokens=1, seed=0)
    prefill_s = time_call(lambda: engine.generate(reqs, first_token))
    forced = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=0)
    total_s = time_call(lambda: engine.generate(reqs, forced))
    row = {
        "yatt_tok_s": batch * NEW_TOKENS / total_s,
        "yatt_total_s": total_s,
        "yatt_prefill_s": prefill_s,
        "yatt_decode_step_ms": (total_s - prefill_s) / (NEW_TOKENS - 1) * 1e3,
        "kv_cache_bytes": engine._cache.num_bytes,
        "mean_span_fraction": _mean_span_fraction(engine),
    }
    try:
        row.update(profile_decode(engine, with_kernels=batch == 256))
    except Exception as exc:  # the profile is diagnostics; never lose the measurements for it
        row["profile_error"] = repr(exc)
        print(f"profile failed: {exc!r}", flush=True)
    engine.close()
    logits = torch.randn(batch, 151936, device=DEVICE, dtype=torch.bfloat16)
    row["sampling_ms"] = _time_sampling(logits) * 1e3
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def _mean_span_fraction(engine) -> float:
    """Mean attended span / max_seq_len over the forced run, as the engine picks spans."""
    runner = engine._runner
    k, L, spans = runner.steps_per_sync, runner.cache.max_seq_len, runner.spans
    chosen = []
    for pos in range(PROMPT_LEN, PROMPT_LEN + NEW_TOKENS - 1, k):
        chosen.append(next(s for s in spans if s >= min(pos + k, L)))
    return sum(chosen) / len(chosen) / L


def _time_sampling(logits) -> float:
    from yatt.rollout._sampling import sample_tokens

    S = logits.shape[0]
    kw = dict(
        temperature_S=torch.ones(S, device=DEVICE),
        top_p_S=torch.ones(S, device=DEVICE),
        top_k_S=torch.zeros(S, dtype=torch.long, device=DEVICE),
        key_S=torch.arange(S, device=DEVICE),
        counter_S=torch.zeros(S, dtype=torch.long, device=DEVICE),
        is_greedy=False,
        is_truncated=False,
    )
    sample_tokens(logits, **kw)
    return time_call(lambda: [sample_tokens(logits, **kw) for _ in range(20)]) / 20


def markdown(results: dict) -> str:
    lines = [
        f"device: {results['device']} (torch {results['torch']})",
        "",
        "| batch | yatt tok/s | HF dynamic tok/s | HF static tok/s | x HF dynamic | "
        "roofline (weights) tok/s | roofline (weights+KV read) tok/s | decode step ms | "
        "sampling ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for batch, r in results.get("throughput", {}).items():
        key = "nominal" if "roofline_weights_nominal_tok_s" in r else "measured"
        lines.append(
            f"| {batch} | {r['yatt_tok_s']:.0f} | {r['hf_dynamic_tok_s']:.0f} | "
            f"{r.get('hf_static_tok_s', float('nan')):.0f} | "
            f"{r['yatt_tok_s'] / r['hf_dynamic_tok_s']:.1f} | "
            f"{r[f'roofline_weights_{key}_tok_s']:.0f} | "
            f"{r[f'roofline_weights_kv_{key}_tok_s']:.0f} | "
            f"{r['yatt_decode_step_ms']:.2f} | {r['sampling_ms']:.2f} |"
        )
    lines.append("")
    for batch, r in results.get("throughput", {}).items():
        if "graph_step_ms_by_span" in r:
            lines.append(f"- batch {batch}, decode graph ms by span: {r['graph_step_ms_by_span']}")
        for kind in ("graph", "eager"):
            prof = r.get(f"{kind}_profile_full_span")
            if prof:
                lines.append(
                    f"- batch {batch}, {kind} step at full span: {prof['kernels_per_step']:.0f} "
                    f"kernels, {prof['kernel_ms_per_step']:.2f} ms of kernel time; by group "
                    f"(ms): {prof['ms_per_step_by_group']}"
                )
    lines.append("")
    lines += [
        f"- {'PASS' if ok else 'FAIL'}: {name}: {CHECK_DETAILS.get(name, '')}"
        for name, ok in results["checks"].items()
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--skip-static", action="store_true", help="skip HF generate with static cache"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU; no results")
    args = parser.parse_args()
    global DEVICE, SMOKE, PROMPT_LEN, NEW_TOKENS, HF_TOKENS
    if args.smoke:
        DEVICE, SMOKE, PROMPT_LEN, NEW_TOKENS, HF_TOKENS = "cpu", True, 8, 8, {64: 4, 256: 4}
        from yatt.placement import configure_regions

        configure_regions(backend="cpu")
    elif not torch.cuda.is_available():
        print(
            "rollout_gpu.py needs a CUDA GPU (or --smoke to test the script on CPU)",
            file=sys.stderr,
        )
        return 2
    else:
        torch.zeros(1, device="cuda")  # create the context before any baseline is taken
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu-smoke"
    results: dict = {"device": name, "torch": torch.__version__}
    t0 = time.perf_counter()
    bench_memory_and_weights(results)
    bench_graph_matches_eager(results)
    bench_throughput(results, args.skip_static)
    results["checks"] = CHECKS
    results["check_details"] = CHECK_DETAILS
    results["wall_s"] = time.perf_counter() - t0
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    out = Path(args.out_dir) / f"rollout_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    if not SMOKE:
        out.write_text(json.dumps(results, indent=2, default=str) + "\n")
        out.with_suffix(".md").write_text(f"# yatt-rollout built-in engine on a GPU\n\n{table}\n")
    print(table)
    done = "smoke run, nothing written" if SMOKE else f"wrote {out} and .md"
    print(f"\n{done} in {results['wall_s']:.0f}s", flush=True)
    return 0 if all(CHECKS.values()) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # torch_memory_saver 0.0.10 in hook_mode="torch" calls exit(1) when its memory pools are
    # destroyed at interpreter shutdown (a free outside a region), which would turn every run
    # into a failure after the results are written; skip the destructors.
    os._exit(code)
