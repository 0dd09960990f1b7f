"""Where a decode step of the built-in engine spends its time (used by bench/rollout/rollout_gpu.py).

`profile_decode(engine, with_kernels=...)` times one graph replay per attention span and, with
kernels, groups the CUDA kernels of a full-span step (graph replay and eager) by kind. The steps
run through the engine's public diagnostics (`attention_spans`, `run_decode_steps`).

`decode_ms_by_active_count(engine, counts)` times a step with k sequences active two ways: every
slot decoding (the engine before batch buckets: one graph over all slots, whatever k) and the
batch bucket the engine now picks for k (`decode_batch_buckets`).
"""

from __future__ import annotations

import re
import time

import torch

KERNEL_GROUPS = [  # first match wins; names of cuBLAS/cutlass/SDPA/ATen/Triton kernels
    # The engine's split-K decode kernel (_decode_kernel.py), before inductor's fused kernels,
    # whose names may mention the decode_kv_attention op they feed.
    ("attention", re.compile(r"^_split_kernel|^_merge_kernel")),
    ("fused (inductor)", re.compile(r"^triton_")),
    ("attention", re.compile(r"fmha|attention|flash|cutlassF|efficient", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|splitk", re.I)),
    ("scan/sort", re.compile(r"scan|cumsum|sort|search|radix", re.I)),
    ("reduce/softmax", re.compile(r"softmax|reduce|norm|argmax", re.I)),
    ("index/copy", re.compile(r"index|gather|scatter|copy|cat_|where", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled", re.I)),
]


def _kernel_table(prof, num_steps: int, groups_by_name=None) -> dict:
    """Kernel time per step by kind: the first of groups_by_name ([(kind, regex)]; default
    KERNEL_GROUPS) whose regex matches a kernel's name, else "other"."""
    rules = KERNEL_GROUPS if groups_by_name is None else groups_by_name
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
    ]
    total_us = sum(e.self_device_time_total for e in kernels)
    groups: dict[str, float] = {}
    for e in kernels:
        group = next((g for g, rx in rules if rx.search(e.key)), "other")
        groups[group] = groups.get(group, 0.0) + e.self_device_time_total / num_steps / 1e3
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
    return {
        "kernels_per_step": sum(e.count for e in kernels) / num_steps,
        "kernel_ms_per_step": total_us / num_steps / 1e3,
        "ms_per_step_by_group": {g: round(v, 4) for g, v in sorted(groups.items())},
        "top_kernels": [
            [e.key[:90], e.count // num_steps, round(e.self_device_time_total / num_steps / 1e3, 4)]
            for e in top
        ],
    }


def profile_decode(engine, *, with_kernels: bool) -> dict:
    """Decode-step time per attention span (graph replays), and where a step's time goes.

    The engine is idle here; idle slots compute exactly what active ones do (fixed shapes).
    """
    from torch.profiler import ProfilerActivity, profile

    out = {}
    config = engine.config
    if not (config.use_cuda_graph and torch.device(config.device).type == "cuda"):
        return out
    by_span = out["graph_step_ms_by_span"] = {}
    for span in engine.attention_spans:
        engine.run_decode_steps(span=span, num_steps=1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.run_decode_steps(span=span, num_steps=20)
        end.record()
        end.synchronize()
        by_span[span] = round(start.elapsed_time(end) / 20, 4)
    if not with_kernels:
        return out
    span = engine.attention_spans[-1]
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        engine.run_decode_steps(span=span, num_steps=5)
        torch.cuda.synchronize()
    out["graph_profile_full_span"] = _kernel_table(prof, 5)
    with profile(activities=acts) as prof:
        engine.run_decode_steps(span=span, num_steps=3, use_graph=False)
        torch.cuda.synchronize()
    out["eager_profile_full_span"] = _kernel_table(prof, 3)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30), flush=True)
    return out


def _step_ms(engine, *, span: int, batch: int, num_steps: int = 20) -> float:
    """Mean ms of one decode step of `batch` rows (graph replays on CUDA, eager on CPU)."""
    engine.run_decode_steps(span=span, num_steps=2, batch=batch)  # warm (first replay, caches)
    if torch.device(engine.config.device).type != "cuda":
        t0 = time.perf_counter()
        engine.run_decode_steps(span=span, num_steps=num_steps, batch=batch)
        return (time.perf_counter() - t0) / num_steps * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    engine.run_decode_steps(span=span, num_steps=num_steps, batch=batch)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / num_steps


def decode_ms_by_active_count(engine, counts=(8, 32, 128, 256), *, span: int | None = None) -> dict:
    """Decode ms per step with k of the engine's slots active, before and with batch buckets.

    Run it after a call that filled the slots to the length of interest: every row reads its
    slot's KV up to that slot's last position (finished slots keep theirs, as in a rollout's
    tail). span: the attention span of the steps (default: the longest).
    """
    span = span or engine.attention_spans[-1]
    buckets = engine.decode_batch_buckets
    slots = buckets[-1]
    every_slot_ms = _step_ms(engine, span=span, batch=slots)
    out = {}
    for k in counts:
        if k > slots:
            continue
        bucket = next(b for b in buckets if b >= k)
        bucket_ms = every_slot_ms if bucket == slots else _step_ms(engine, span=span, batch=bucket)
        out[k] = {
            "bucket": bucket,
            "every_slot_ms": round(every_slot_ms, 4),
            "bucket_ms": round(bucket_ms, 4),
            "speedup": round(every_slot_ms / bucket_ms, 3),
        }
    return {"span": span, "slots": slots, "by_active_count": out}
