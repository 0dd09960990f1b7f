"""GPU verification of yatt-rollout's built-in engine, in one command (about 2-4 minutes).

    python bench/rollout/rollout_gpu.py                 # writes bench/results/rollout_<device>.json/.md
    python bench/rollout/rollout_gpu.py --skip-static   # without HF generate + static cache (compiles)
    python bench/rollout/rollout_gpu.py --smoke         # tiny model on CPU: checks the script runs

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
     the decode step (where the time goes); decode ms per step with 8/32/128/256 of 256 slots
     active, every slot decoding (before batch buckets) vs the bucket for that count (now); a
     long-tail call (1 in 32 samples long) without and with batch buckets.

Random-weight bf16 models have near-ties in their logits everywhere (logits are rounded to bf16
before the argmax), so two correct runs whose kernels round differently can pick different
greedy tokens. The comparisons therefore check the logprobs up to the first differing token
and that, at that token, both runs' chosen tokens had the same logprob (a tie).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
from pathlib import Path

import torch

from yatt.placement import offload, offloaded_named_parameters, onload
from yatt.rollout import BuiltinEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from _rollout_checks import (
    CHECK_DETAILS,
    CHECKS,
    RUN,
    agrees,
    build_model,
    check,
    compare_greedy,
    describe,
    engine_config,
    engine_tensors,
    free_bytes,
    greedy,
    prompts,
    reserved_by_pool,
    sync,
    trainer_logprobs,
)
from _rollout_throughput import BEFORE_LABEL, bench_throughput
from report import write_report


def bench_memory_and_weights(results: dict) -> None:
    # The first engine of a process also loads CUDA kernels and creates cuBLAS handles: process
    # memory that no engine can give back. A warm-up engine (own regions, left asleep) pays it.
    cold = free_bytes(empty_cache=True)
    warm = BuiltinEngine(build_model(seed=0), config=engine_config(64, region_prefix="warmup"))
    warm.generate(prompts(64, RUN.prompt_len), greedy(8))
    warm.generate(prompts(8, RUN.prompt_len), SamplingParams(max_new_tokens=8, seed=0))
    warm.sleep()
    warm.close()
    del warm
    base = free_bytes(empty_cache=True)
    engine = BuiltinEngine(build_model(seed=0), config=engine_config(64))
    reqs = prompts(8, RUN.prompt_len)
    engine.generate(prompts(64, RUN.prompt_len), greedy(8))  # capture graphs, touch all memory
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
        prompts(16, RUN.prompt_len, seed=3),
        SamplingParams(max_new_tokens=64, seed=0, ignore_eos=True),
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
    # Pinned CPU -> GPU, as after a trainer offload: an offloaded CUDA parameter is an empty
    # placeholder on the device, its values are offload's pinned host copy.
    offload(trainer)
    cpu_pairs = list(offloaded_named_parameters(trainer))
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
    if RUN.device == "cuda":
        torch.cuda.empty_cache()


def bench_graph_matches_eager(results: dict) -> None:
    reqs, rows = prompts(8, RUN.prompt_len, seed=5), {}
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


def markdown(results: dict) -> str:
    lines = [
        f"device: {results['device']} (torch {results['torch']})",
        "",
        f"| batch | yatt tok/s | before ({BEFORE_LABEL}) tok/s | speed-up | HF dynamic tok/s | "
        "HF static tok/s | x HF dynamic | roofline (weights) tok/s | "
        "roofline (weights+KV read) tok/s | decode step ms | before: step ms | sampling ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for batch, r in results.get("throughput", {}).items():
        key = "nominal" if "roofline_weights_nominal_tok_s" in r else "measured"
        hf = r.get("hf_dynamic_tok_s", nan)
        lines.append(
            f"| {batch} | {r['yatt_tok_s']:.0f} | {r['old_yatt_tok_s']:.0f} | "
            f"{r['yatt_tok_s'] / r['old_yatt_tok_s']:.2f} | {hf:.0f} | "
            f"{r.get('hf_static_tok_s', nan):.0f} | {r['yatt_tok_s'] / hf:.1f} | "
            f"{r[f'roofline_weights_{key}_tok_s']:.0f} | "
            f"{r[f'roofline_weights_kv_{key}_tok_s']:.0f} | "
            f"{r['yatt_decode_step_ms']:.2f} | {r['old_yatt_decode_step_ms']:.2f} | "
            f"{r['sampling_ms']:.2f} |"
        )
    if results.get("prefill"):
        lines += [
            "",
            "| judge-like load | batch | prompt tokens | prefill tok/s | new tokens | "
            "generated tok/s (whole call) |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in results["prefill"].items():
            lines.append(
                f"| {name} | {r['batch']} | {r['prompt_tokens']} | {r['prefill_tok_s']:.0f} | "
                f"{r['new_tokens']} | {r['generated_tok_s']:.0f} |"
            )
    for batch, r in results.get("throughput", {}).items():
        active = r.get("active_decode")
        if not active:
            continue
        lines += [
            "",
            f"Decode step with k of {active['slots']} slots active (span {active['span']}, "
            f"batch {batch}): every slot decoding (before) vs the batch bucket for k (now)",
            "",
            "| active k | bucket | every slot ms | bucket ms | speed-up |",
            "|---|---|---|---|---|",
        ]
        for k, a in active["by_active_count"].items():
            lines.append(
                f"| {k} | {a['bucket']} | {a['every_slot_ms']:.3f} | {a['bucket_ms']:.3f} | "
                f"{a['speedup']:.2f} |"
            )
    tail = results.get("tail")
    if tail:
        lines += [
            "",
            f"- long-tail call (batch {tail['batch']}, {tail['long']} samples of "
            f"{tail['new_tokens']} tokens, the rest 1/16 of that): every slot decoding "
            f"{tail['every_slot_s']:.2f} s, batch buckets {tail['buckets_s']:.2f} s "
            f"({tail['speedup']:.2f}x); same tokens: {tail['same_tokens_fraction']:.2f}; "
            f"steps by batch: {tail['buckets_steps_by_batch']}",
        ]
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
        for name, ok in results.get("checks", {}).items()
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "results"))
    parser.add_argument(
        "--skip-static", action="store_true", help="skip HF generate with static cache"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU; no results")
    parser.add_argument(
        "--throughput-only",
        action="store_true",
        help="decode (before/after) and prefill throughput only: no checks, no HF generate",
    )
    args = parser.parse_args()
    RUN.throughput_only = args.throughput_only
    if args.smoke:
        RUN.device, RUN.smoke, RUN.prompt_len, RUN.new_tokens = "cpu", True, 8, 8
        RUN.hf_tokens = {64: 4, 256: 4}
        RUN.prefill_batch, RUN.prefill_new_tokens = 8, 4
        RUN.prefill_fixed_len, RUN.prefill_mixed_lens = 32, (8, 40)
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
    name = torch.cuda.get_device_name() if RUN.device == "cuda" else "cpu-smoke"
    results: dict = {"device": name, "torch": torch.__version__}
    t0 = time.perf_counter()
    if not RUN.throughput_only:
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
    if RUN.throughput_only:
        out = out.with_name(out.stem + "_throughput.json")
    if not RUN.smoke:
        markdown_text = f"# yatt-rollout built-in engine on a GPU\n\n{table}\n"
        write_report(out.with_suffix(".md"), markdown_text, data=results, default=str)
    print(table)
    done = "smoke run, nothing written" if RUN.smoke else f"wrote {out} and .md"
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
