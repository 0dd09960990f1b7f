"""GPU verification of yatt-rollout's built-in engine, in one command (about 3-5 minutes).

    python bench/rollout_gpu.py                 # writes bench/results/rollout_<device>.json
    python bench/rollout_gpu.py --skip-static   # without HF generate + static cache (compiles)
    python bench/rollout_gpu.py --smoke         # tiny model on CPU: checks the script runs

Needs CUDA, torch_memory_saver (yatt-placement[cuda]) and yatt-rollout installed. Checks, each
PASS/FAIL (the script exits 1 if any fails):
  1. sleep() returns >= 95% of the engine's GPU memory (torch.cuda.mem_get_info) and wake_up()
     restores it with greedy outputs unchanged; trainer offload/onload likewise.
  2. update_weights from a trainer copy: engine logprobs match the trainer's forward pass within
     bf16 tolerance; weight-sync bandwidth (GPU->GPU and pinned CPU->GPU) in GB/s.
  3. CUDA-graph decode gives the same greedy tokens as eager decode.
  4. Throughput on a Qwen2.5-0.5B-shaped random bf16 model, batch 64 and 256, prompt 128, 512
     forced new tokens, against HF generate (dynamic and static cache, fewer tokens: reported
     as tokens/s) and the weights-only memory-bandwidth roofline. Bar: >= 10x HF generate
     (dynamic cache) at batch 256.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from yatt.placement import offload, onload
from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

PROMPT_LEN, NEW_TOKENS = 128, 512
HF_TOKENS = {64: 32, 256: 64}  # HF generate is slow: fewer new tokens, reported as tokens/s
DEVICE = "cuda"
SMOKE = False  # --smoke: a tiny model on CPU, to test this script without a GPU
NOMINAL_HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
CHECKS: dict[str, bool] = {}


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


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(
            qwen25_05b_config(), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval().requires_grad_(False)


def free_bytes() -> int:
    gc.collect()
    if DEVICE == "cpu":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def check(name: str, ok: bool, detail: str) -> None:
    CHECKS[name] = bool(ok)
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def prompts(num: int, length: int, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 150000, (num, length), generator=g)
    return [Request(prompt_ids=row.tolist()) for row in ids]


def greedy(n_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n_tokens, ignore_eos=True)


def engine_config(batch: int, **kwargs) -> EngineConfig:
    seq_len = PROMPT_LEN + NEW_TOKENS
    return EngineConfig(
        device=DEVICE, dtype="bfloat16", max_batch_size=batch, max_seq_len=seq_len, **kwargs
    )


def trainer_logprobs(model, completions) -> list[torch.Tensor]:
    out = []
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.response_ids], device=DEVICE)
        logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(c.prompt_ids) :, None])[:, 0]
        out.append(lp.cpu())
    return out


def bench_memory_and_weights(results: dict) -> None:
    base = free_bytes()
    engine = BuiltinEngine(build_model(seed=0), config=engine_config(64))
    reqs = prompts(8, PROMPT_LEN)
    engine.generate(prompts(64, PROMPT_LEN), greedy(8))  # capture graphs, touch all memory
    before = engine.generate(reqs, greedy(32))
    if DEVICE == "cuda":
        torch.cuda.empty_cache()  # the model's pre-engine copy is free but cached
    used = max(base - free_bytes(), 1)
    engine.sleep()
    returned = free_bytes() - (base - used)
    engine.wake_up()
    after = engine.generate(reqs, greedy(32))
    same = [a.response_ids for a in after] == [b.response_ids for b in before]
    lp_diff = max(
        abs(x - y)
        for a, b in zip(after, before, strict=True)
        for x, y in zip(a.logprobs, b.logprobs, strict=True)
    )
    results["sleep"] = {
        "engine_bytes": used,
        "returned_bytes": returned,
        "returned_fraction": returned / used,
        "outputs_unchanged": same,
        "logprob_max_diff_after_wake": lp_diff,
    }
    check(
        "sleep returns >= 95%",
        returned / used >= 0.95,
        f"{returned / 2**30:.2f} of {used / 2**30:.2f} GiB",
    )
    check(
        "wake_up keeps outputs",
        same and lp_diff < 1e-3,
        f"tokens equal={same}, logprob diff {lp_diff:.1e}",
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


def bench_graph_matches_eager() -> None:
    reqs, outs = prompts(8, PROMPT_LEN, seed=5), []
    for use_graph in (False, True):
        engine = BuiltinEngine(
            build_model(seed=0), config=engine_config(8, use_cuda_graph=use_graph)
        )
        outs.append([c.response_ids for c in engine.generate(reqs, greedy(48))])
        engine.close()
    agree = sum(a == b for a, b in zip(*outs, strict=True))
    check(
        "CUDA graph decode == eager decode",
        agree == len(reqs),
        f"{agree}/{len(reqs)} sequences equal",
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
                # The engine attends over the whole cache each step (fixed shapes).
                step_bytes = weight_bytes + row["kv_cache_bytes"]
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
    }
    engine.close()
    logits = torch.randn(batch, 151936, device=DEVICE, dtype=torch.bfloat16)
    row["sampling_ms"] = _time_sampling(logits) * 1e3
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


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
        f"device: {results['device']}",
        "",
        "| batch | yatt tok/s | HF dynamic tok/s | HF static tok/s | x HF dynamic | roofline (weights) tok/s | roofline (weights+KV) tok/s | decode step ms | sampling ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for batch, r in results.get("throughput", {}).items():
        key = "nominal" if "roofline_weights_nominal_tok_s" in r else "measured"
        lines.append(
            f"| {batch} | {r['yatt_tok_s']:.0f} | {r['hf_dynamic_tok_s']:.0f} | "
            f"{r.get('hf_static_tok_s', float('nan')):.0f} | {r['yatt_tok_s'] / r['hf_dynamic_tok_s']:.1f} | "
            f"{r[f'roofline_weights_{key}_tok_s']:.0f} | {r[f'roofline_weights_kv_{key}_tok_s']:.0f} | "
            f"{r['yatt_decode_step_ms']:.2f} | {r['sampling_ms']:.2f} |"
        )
    lines.append("")
    lines += [f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in results["checks"].items()]
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
    bench_graph_matches_eager()
    bench_throughput(results, args.skip_static)
    results["checks"] = CHECKS
    results["wall_s"] = time.perf_counter() - t0
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    out = Path(args.out_dir) / f"rollout_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not SMOKE:
        out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(markdown(results))
    print(
        f"\n{'smoke run, nothing written' if SMOKE else 'wrote ' + str(out)} in {results['wall_s']:.0f}s"
    )
    return 0 if all(CHECKS.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
