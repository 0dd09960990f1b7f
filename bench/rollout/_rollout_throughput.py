"""Check 4 of bench/rollout/rollout_gpu.py: built-in engine throughput against HF generate and the
memory-bandwidth roofline, with the decode-step profile of bench/rollout/_decode_profile.py.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

from yatt.rollout import BuiltinEngine, Request, SamplingParams
from yatt.rollout.builtin import sample_tokens

sys.path.insert(0, str(Path(__file__).parent))
from _decode_profile import decode_ms_by_active_count, profile_decode
from _rollout_checks import RUN, build_model, check, engine_config, prompts, sync

NOMINAL_HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


# The "before" column: the default engine but for its latest change (one run, side by side).
BEFORE = {"fuse_projections": False}
BEFORE_LABEL = "separate q/k/v and gate/up GEMMs"


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
    name = torch.cuda.get_device_name() if RUN.device == "cuda" else "cpu"
    nominal = next((bw for key, bw in NOMINAL_HBM_BYTES_PER_S.items() if key in name), None)
    big = torch.empty(
        2**30 if RUN.device == "cuda" else 2**24, dtype=torch.uint8, device=RUN.device
    )
    copy_s = min(time_call(big.clone) for _ in range(5))
    measured_bw = 2 * big.numel() / copy_s  # read + write
    big = None
    results["roofline"] = {
        "weight_bytes": weight_bytes,
        "nominal_hbm_Bps": nominal,
        "measured_copy_Bps": measured_bw,
    }
    for batch in (64, 256):
        row = rows[batch] = _bench_hf(model, batch, skip_static) if not RUN.throughput_only else {}
        # The engine as it was before its last change (BEFORE) beside the default one.
        old = _bench_engine(batch, profile=False, **BEFORE)
        row.update({f"old_{k}": v for k, v in old.items() if k.startswith("yatt_")})
        row.update(_bench_engine(batch))
        print(
            f"batch {batch}: decode {row['old_yatt_tok_s']:.0f} tok/s before ({BEFORE_LABEL}) "
            f"-> {row['yatt_tok_s']:.0f} tok/s now "
            f"({row['yatt_tok_s'] / row['old_yatt_tok_s']:.2f}x); step "
            f"{row['old_yatt_decode_step_ms']:.2f} -> {row['yatt_decode_step_ms']:.2f} ms",
            flush=True,
        )
        for label, bw in (("nominal", nominal), ("measured", measured_bw)):
            if bw:
                row[f"roofline_weights_{label}_tok_s"] = batch / (weight_bytes / bw)
                # Attention reads the span bucket of each step: mean fraction of the cache.
                step_bytes = weight_bytes + row["kv_cache_bytes"] * row["mean_span_fraction"]
                row[f"roofline_weights_kv_{label}_tok_s"] = batch / (step_bytes / bw)
        rounded = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
        print(f"batch {batch}: {json.dumps(rounded)}", flush=True)
    del model
    results["tail"] = bench_tail(max(rows))
    results["prefill"] = bench_prefill()
    if not RUN.throughput_only:
        ratio = rows[256]["yatt_tok_s"] / rows[256]["hf_dynamic_tok_s"]
        check(">= 10x HF generate at batch 256", ratio >= 10, f"{ratio:.1f}x")


def bench_tail(batch: int) -> dict:
    """A call with a long tail: `batch` samples, 1 in 32 forced to RUN.new_tokens, the rest to
    RUN.new_tokens // 16, through the engine without batch buckets (every step decodes every
    slot) and with them (the default): whole-call seconds, same seeds, same tokens."""
    long_every = 32
    reqs = [
        Request(
            prompt_ids=r.prompt_ids,
            max_new_tokens=RUN.new_tokens if i % long_every == 0 else max(1, RUN.new_tokens // 16),
        )
        for i, r in enumerate(prompts(batch, RUN.prompt_len, seed=batch + 1))
    ]
    forced = SamplingParams(max_new_tokens=RUN.new_tokens, ignore_eos=True, seed=0)
    out: dict = {"batch": batch, "long": len(reqs[::long_every]), "new_tokens": RUN.new_tokens}
    tokens = {}
    for name, buckets in (("every_slot", ()), ("buckets", None)):
        config = engine_config(batch, decode_batch_buckets=buckets)
        engine = BuiltinEngine(build_model(seed=0), config=config)
        engine.generate(reqs[:8], SamplingParams(max_new_tokens=16, ignore_eos=True, seed=0))
        engine._runner.bucket_steps.clear()
        completions: list = []
        out[f"{name}_s"] = time_call(
            partial(lambda e, sink: sink.extend(e.generate(reqs, forced)), engine, completions)
        )
        out[f"{name}_steps_by_batch"] = dict(sorted(engine._runner.bucket_steps.items()))
        tokens[name] = [c.response_ids for c in completions]
        engine.close()
        gc.collect()
        if RUN.device == "cuda":
            torch.cuda.empty_cache()
    out["speedup"] = out["every_slot_s"] / out["buckets_s"]
    # Diagnostics, not a check: bf16 kernels of another batch size may round a near-tie apart.
    out["same_tokens_fraction"] = sum(
        a == b for a, b in zip(tokens["every_slot"], tokens["buckets"], strict=True)
    ) / len(reqs)
    print(f"tail call: {json.dumps(out)}", flush=True)
    return out


def bench_prefill() -> dict:
    """A judge-like load: prompts of 1,024 tokens (and of 300-1,300 mixed), 128 new tokens.

    Prefill tokens/s counts prompt tokens (no padding) over a call of one new token each;
    the full call's generated tokens/s is reported beside it.
    """
    out = {}
    batch, new = RUN.prefill_batch, RUN.prefill_new_tokens
    (lo, hi), fixed = RUN.prefill_mixed_lens, RUN.prefill_fixed_len
    g = torch.Generator().manual_seed(7)
    mixed = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
    loads = {f"fixed_{fixed}": [fixed] * batch, f"mixed_{lo}_{hi}": mixed}
    for name, lengths in loads.items():
        reqs = [
            Request(prompt_ids=torch.randint(1000, 150000, (n,), generator=g).tolist())
            for n in lengths
        ]
        config = engine_config(batch, max_seq_len=max(lengths) + new)
        engine = BuiltinEngine(build_model(seed=0), config=config)
        engine.generate(reqs, SamplingParams(max_new_tokens=16, ignore_eos=True, seed=0))
        first = SamplingParams(max_new_tokens=1, seed=0)
        forced = SamplingParams(max_new_tokens=new, ignore_eos=True, seed=0)
        prefill_s = min(time_call(partial(engine.generate, reqs, first)) for _ in range(2))
        total_s = time_call(partial(engine.generate, reqs, forced))
        engine.close()
        out[name] = row = {
            "batch": batch,
            "prompt_tokens": sum(lengths),
            "new_tokens": new,
            "prefill_s": prefill_s,
            "prefill_tok_s": sum(lengths) / prefill_s,
            "total_s": total_s,
            "generated_tok_s": batch * new / total_s,
        }
        print(f"prefill {name}: {json.dumps({k: round(v, 3) for k, v in row.items()})}")
        gc.collect()
        if RUN.device == "cuda":
            torch.cuda.empty_cache()
    return out


def _bench_hf(model, batch: int, skip_static: bool) -> dict:
    ids = torch.tensor(
        [r.prompt_ids for r in prompts(batch, RUN.prompt_len, seed=batch)], device=RUN.device
    )
    n_hf = RUN.hf_tokens[batch]
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
    if batch == 256 and not skip_static and not RUN.smoke:
        static = {**kwargs, "cache_implementation": "static"}
        row["hf_static_first_call_s"] = time_call(lambda: model.generate(ids, **static))
        row["hf_static_tok_s"] = batch * n_hf / time_call(lambda: model.generate(ids, **static))
    return row


def _bench_engine(batch: int, *, profile: bool = True, **config) -> dict:
    reqs = prompts(batch, RUN.prompt_len, seed=batch)
    engine = BuiltinEngine(build_model(seed=0), config=engine_config(batch, **config))
    t0 = time.perf_counter()
    engine.generate(reqs, SamplingParams(max_new_tokens=16, ignore_eos=True, seed=0))  # capture
    first_call_s = time.perf_counter() - t0  # compile (if any) and graph capture
    first_token = SamplingParams(max_new_tokens=1, seed=0)
    prefill_s = time_call(lambda: engine.generate(reqs, first_token))
    forced = SamplingParams(max_new_tokens=RUN.new_tokens, ignore_eos=True, seed=0)
    total_s = time_call(lambda: engine.generate(reqs, forced))
    row = {
        "yatt_tok_s": batch * RUN.new_tokens / total_s,
        "yatt_total_s": total_s,
        "yatt_prefill_s": prefill_s,
        "yatt_first_call_s": first_call_s,
        "yatt_decode_step_ms": (total_s - prefill_s) / (RUN.new_tokens - 1) * 1e3,
        "kv_cache_bytes": engine.kv_cache_bytes,
        "mean_span_fraction": _mean_span_fraction(engine),
    }
    try:
        if profile:
            # After the forced run every slot holds prompt + new tokens: the rollout's tail.
            row["active_decode"] = decode_ms_by_active_count(engine)
            print(f"batch {batch}, decode by active count: {row['active_decode']}", flush=True)
            row.update(profile_decode(engine, with_kernels=batch == 256))
    except Exception as exc:  # the profile is diagnostics; never lose the measurements for it
        row["profile_error"] = repr(exc)
        print(f"profile failed: {exc!r}", flush=True)
    engine.close()
    if not profile:
        return row
    logits = torch.randn(batch, 151936, device=RUN.device, dtype=torch.bfloat16)
    row["sampling_ms"] = _time_sampling(logits) * 1e3
    gc.collect()
    if RUN.device == "cuda":
        torch.cuda.empty_cache()
    return row


def _mean_span_fraction(engine) -> float:
    """Mean attended span / max_seq_len over the forced run, as the engine picks spans."""
    k, L, spans = engine.config.steps_per_sync, engine.config.max_seq_len, engine.attention_spans
    chosen = []
    for pos in range(RUN.prompt_len, RUN.prompt_len + RUN.new_tokens - 1, k):
        chosen.append(next(s for s in spans if s >= min(pos + k, L)))
    return sum(chosen) / len(chosen) / L


def _time_sampling(logits) -> float:
    S = logits.shape[0]
    kw = dict(
        temperature_S=torch.ones(S, device=RUN.device),
        top_p_S=torch.ones(S, device=RUN.device),
        top_k_S=torch.zeros(S, dtype=torch.long, device=RUN.device),
        key_S=torch.arange(S, device=RUN.device),
        counter_S=torch.zeros(S, dtype=torch.long, device=RUN.device),
        is_greedy=False,
        is_truncated=False,
    )
    sample_tokens(logits, **kw)
    return time_call(lambda: [sample_tokens(logits, **kw) for _ in range(20)]) / 20
