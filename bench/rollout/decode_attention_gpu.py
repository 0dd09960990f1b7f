"""Decode attention alone on one GPU: the engine's Triton kernel variants against torch SDPA.

    python3 bench/rollout/decode_attention_gpu.py --out-dir $OUT          # about 1-2 minutes (H200)
    python3 bench/rollout/decode_attention_gpu.py --quick --out-dir $OUT  # 0.5B, spans 256 and 640
    python3 bench/rollout/decode_attention_gpu.py --smoke                 # CPU: checks the script runs

For the Qwen2.5-0.5B and -1.5B attention shapes (bench/step/_step_setup.py: 14/2 heads of 64,
12/2 heads of 128), batch 64 and 256, spans 128/256/512/640, every row seeing the whole span
(its position span - 1: the worst case of a span bucket, what the engine's full-span profile
times), bf16 caches of the engine's layout [slots, KV heads, 640, D]:
- each variant of `decode_kernel.BENCH_CONFIGS` ("legacy": the kernel measured before issue
  28; "gqa": the engine's default; the rest: launch settings to choose between) and the
  engine's SDPA path (`decode_kernel.sdpa_decode_attention`, additive bf16 mask);
- time: one CUDA graph of one call per layer, each layer on its own cache (as in the engine:
  nothing stays in L2 between layers, launches cost what graph nodes cost); the median of
  the replays, divided by the layers, is "us/layer";
- the KV-read roofline: bytes of K and V the visible positions hold / 4.8 TB/s (H200 HBM3e);
- max |variant - SDPA| on layer 0 (and SDPA against a float32 reference, for scale).
A variant that fails is reported with its error; the run goes on (a CUDA fault, which poisons
the context, ends it, but the JSON written after every case stays). Writes
decode_attention_<device>.json/.md to --out-dir.

--smoke runs tiny shapes on CPU through Triton's interpreter (float32; needs `pip install
triton`), so the script can be checked without a GPU; its times mean nothing.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # Triton reads this when it is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import json
import math
import re
import statistics
import time
import traceback
from pathlib import Path

import torch

from yatt.rollout.builtin import decode_kernel
from yatt.rollout.builtin.decode_kernel import BENCH_CONFIGS, choose_splits
from yatt.rollout.builtin.decode_kernel import sdpa_decode_attention as decode_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from _step_setup import shape_config
from report import write_report

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e, nominal
MAX_SPAN = 640  # the engine's cache length in bench/rollout/rollout_gpu.py (prompt 128 + 512)
SDPA = "sdpa"


def attention_shape(name: str) -> dict:
    cfg = shape_config(name)
    return dict(
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["hidden_size"] // cfg["num_attention_heads"],
    )


def kv_read_bytes(batch: int, shape: dict, visible: int, itemsize: int) -> int:
    """Bytes of K and V that `batch` rows each seeing `visible` positions must read once."""
    return 2 * batch * shape["num_kv_heads"] * visible * shape["head_dim"] * itemsize


class Layers:
    """One query and one KV cache per layer, in the engine's layouts."""

    def __init__(self, shape: dict, batch: int, *, num_layers: int, device, dtype, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)
        Hq, Hkv, D = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
        # HF's query: q_proj(x).view(B, 1, Hq, D).transpose(1, 2) -> [B, Hq, 1, D], not contiguous.
        self.queries = [
            torch.randn(batch, 1, Hq, D, generator=g, device=device, dtype=dtype).transpose(1, 2)
            for _ in range(num_layers)
        ]
        self.keys, self.values = (
            [
                torch.randn(batch, Hkv, MAX_SPAN, D, generator=g, device=device, dtype=dtype)
                for _ in range(num_layers)
            ]
            for _ in range(2)
        )
        self.slot_B = torch.arange(batch, device=device)
        self.scale = D**-0.5


def make_call(variant: str, layers: Layers, pos_B: torch.Tensor, mask: torch.Tensor, span: int):
    """call(layer) -> [B, 1, Hq, D]: what the engine's decode op runs for that layer."""
    if variant == SDPA:
        return lambda i: decode_attention(
            layers.queries[i], layers.keys[i], layers.values[i], mask, span=span,
            scaling=layers.scale,
        )  # fmt: skip
    config = BENCH_CONFIGS[variant]
    run = (
        decode_kernel.run_decode_attention  # the interpreter (--smoke) runs CPU tensors
        if pos_B.device.type == "cpu"
        else decode_kernel.triton_decode_attention
    )

    def call(i):
        out = run(
            layers.queries[i], layers.keys[i], layers.values[i], pos_B, span=span,
            scale=layers.scale, slot_B=layers.slot_B, config=config,
        )  # fmt: skip
        if out is None:
            raise RuntimeError("triton_decode_attention returned None (Triton unavailable here)")
        return out

    return call


def reference_attention(layers: Layers, span: int) -> torch.Tensor:
    """Layer 0 in float32: softmax(q k^T * scale) v over positions [0, span), grouped heads."""
    q = layers.queries[0].float()  # [B, Hq, 1, D]
    k = layers.keys[0][:, :, :span].float()
    v = layers.values[0][:, :, :span].float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    weights = torch.softmax((q @ k.transpose(-1, -2)) * layers.scale, dim=-1)
    return (weights @ v).transpose(1, 2)  # [B, 1, Hq, D]


def split_kernel_resources(programs: int, num_sms: int) -> dict:
    """Shared memory, registers and resident programs per SM of the last split-kernel launch
    (from Triton's handle; {} in the interpreter), and the waves its grid takes."""
    handle = decode_kernel.last_compiled.get("split")
    if handle is None or not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    shared = int(handle.metadata.shared)
    num_warps = int(handle.metadata.num_warps)
    n_regs = int(getattr(handle, "n_regs", 0) or 0)
    resident = min(
        32,  # blocks per SM (Hopper)
        64 // num_warps,  # warps per SM
        smem_per_sm // (shared + 1024) if shared else 32,  # 1 KiB reserved per block
        regs_per_sm // (n_regs * 32 * num_warps) if n_regs else 32,
    )
    return dict(
        smem_kib=round(shared / 1024, 1),
        regs=n_regs,
        spills=int(getattr(handle, "n_spills", 0) or 0),
        resident_per_sm=resident,
        waves=round(programs / (num_sms * max(resident, 1)), 2),
    )


def time_per_layer_us(call, num_layers: int, *, num_replays: int) -> tuple[float, float]:
    """(median, min) microseconds per layer: CUDA graph replays of one call per layer."""
    if not torch.cuda.is_available():  # --smoke: wall time of the interpreter, meaningless
        start = time.perf_counter()
        for i in range(num_layers):
            call(i)
        us = (time.perf_counter() - start) * 1e6 / num_layers
        return us, us
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile / autotune / workspace outside the capture
        for i in range(num_layers):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_layers):
            call(i)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(num_replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / num_layers)
    del graph
    return statistics.median(times), min(times)


def bench_case(shape_name, shape, batch, spans, variants, args, results, deadline) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    num_layers = args.layers or shape["num_layers"]
    layers = Layers(shape, batch, num_layers=num_layers, device=device, dtype=dtype, seed=batch)
    rows = batch * shape["num_kv_heads"]
    num_sms = decode_kernel.num_sms(torch.device(device))
    for span in spans:
        pos_B = torch.full((batch,), span - 1, device=device, dtype=torch.long)
        visible = torch.arange(span, device=device)[None, :] <= pos_B[:, None]
        mask = torch.where(visible, 0.0, float("-inf")).to(dtype)[:, None, None, :]
        roofline_us = kv_read_bytes(batch, shape, span, dtype.itemsize) / HBM_BYTES_PER_S * 1e6
        reference = reference_attention(layers, span)
        sdpa_out = None
        for variant in variants:
            row = dict(
                shape=shape_name, batch=batch, span=span, variant=variant,
                num_layers=num_layers, roofline_us=round(roofline_us, 2),
            )  # fmt: skip
            if variant != SDPA:
                row["splits"] = choose_splits(rows, span, num_sms, BENCH_CONFIGS[variant])[0]
            if time.perf_counter() > deadline:
                row["error"] = "skipped: time budget (--budget-s) spent"
                results.append(row)
                continue
            try:
                call = make_call(variant, layers, pos_B, mask, span)
                out = call(0)
                if variant != SDPA:
                    try:  # Triton's handle attributes differ across versions: a nicety only
                        row.update(split_kernel_resources(rows * row["splits"], num_sms))
                    except Exception as exc:
                        row["resources_error"] = f"{type(exc).__name__}: {exc}"[:200]
                if variant == SDPA:
                    sdpa_out = out
                    err = (out.float() - reference).abs().max().item()
                    row["max_abs_err_vs_fp32"] = err
                elif sdpa_out is not None:
                    row["max_abs_err_vs_sdpa"] = (out.float() - sdpa_out.float()).abs().max().item()
                    row["max_abs_err_vs_fp32"] = (out.float() - reference).abs().max().item()
                median_us, min_us = time_per_layer_us(call, num_layers, num_replays=args.replays)
                row.update(us_per_layer=round(median_us, 2), us_min=round(min_us, 2))
                row["kv_tb_s"] = round(kv_read_bytes(batch, shape, span, dtype.itemsize)
                                       / (median_us * 1e-6) / 1e12, 2)  # fmt: skip
            except Exception as exc:  # report it, go on with the next variant
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                traceback.print_exc()
                if "CUDA error" in str(exc) or "illegal" in str(exc).lower():
                    results.append(row)
                    raise  # the context is gone: nothing after this can run
            results.append(row)
            print(json.dumps(row), flush=True)
    del layers
    if device == "cuda":
        torch.cuda.empty_cache()


def markdown(report: dict) -> str:
    results = report["results"]
    lines = [
        "# Decode attention alone (bench/rollout/decode_attention_gpu.py)",
        "",
        f"device: {report['device']} (torch {report['torch']}, Triton {report['triton']}); "
        f"{report['wall_s']:.0f} s; the engine's default: {report['default_variant']}; us per layer = median of CUDA-graph replays of one call per "
        "layer / layers; every row sees the whole span; roofline = K+V bytes read / 4.8 TB/s.",
        "",
    ]
    keys = sorted({(r["shape"], r["batch"]) for r in results}, key=lambda k: (k[0], k[1]))
    for shape_name, batch in keys:
        rows = [r for r in results if r["shape"] == shape_name and r["batch"] == batch]
        spans = sorted({r["span"] for r in rows})
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        by = {(r["variant"], r["span"]): r for r in rows}
        num_layers = rows[0]["num_layers"]
        lines += [
            f"## {shape_name}, batch {batch} ({num_layers} layers)",
            "",
            "| variant | " + " | ".join(f"span {s}: us/layer (x legacy)" for s in spans)
            + " | splits | split kernel at the last span: smem KiB, regs, per SM, waves"
            + " | max err vs SDPA | max err vs fp32 |",
            "|---|" + "---|" * (len(spans) + 4),
        ]  # fmt: skip
        for variant in variants:
            cells, errors, errors32, splits = [], [], [], set()
            for span in spans:
                r = by.get((variant, span), {})
                us = r.get("us_per_layer")
                legacy = by.get(("legacy", span), {}).get("us_per_layer")
                if us is None:
                    cells.append("failed" if "error" in r else "")
                elif legacy:
                    cells.append(f"{us:.1f} ({legacy / us:.2f}x)")
                else:
                    cells.append(f"{us:.1f}")
                errors.append(r.get("max_abs_err_vs_sdpa", float("nan")))
                errors32.append(r.get("max_abs_err_vs_fp32", float("nan")))
                if "splits" in r:
                    splits.add(r["splits"])
            splits_cell = "/".join(str(s) for s in sorted(splits)) or "-"
            last = by.get((variant, spans[-1]), {})
            resources = (
                f"{last['smem_kib']}, {last['regs']}, {last['resident_per_sm']}, {last['waves']}"
                if "smem_kib" in last
                else "-"
            )
            lines.append(
                f"| {variant} | " + " | ".join(cells)
                + f" | {splits_cell} | {resources} | {_max(errors)} | {_max(errors32)} |"
            )  # fmt: skip
        roof = [by.get((variants[0], s), {}).get("roofline_us", float("nan")) for s in spans]
        lines.append("| KV-read roofline | " + " | ".join(f"{x:.1f}" for x in roof) + " |" * 5)
        lines.append("")
        for span in spans:
            timed = [
                (by[(v, span)]["us_per_layer"], v)
                for v in variants
                if v != SDPA and "us_per_layer" in by.get((v, span), {})
            ]
            legacy = by.get(("legacy", span), {}).get("us_per_layer")
            if timed and legacy:
                us, best = min(timed)
                saved_ms = (legacy - us) * num_layers / 1e3
                lines.append(
                    f"- span {span}: fastest {best} {us:.1f} us/layer, legacy {legacy:.1f} "
                    f"(saves {saved_ms:.3f} ms a decode step over {num_layers} layers)"
                )
        lines.append("")
    failed = [r for r in results if "error" in r]
    if failed:
        lines += ["## Failed or skipped", ""]
        lines += [
            f"- {r['shape']} batch {r['batch']} span {r['span']} {r['variant']}: {r['error']}"
            for r in failed
        ]
        lines.append("")
    return "\n".join(lines)


def _max(values) -> str:
    finite = [v for v in values if not math.isnan(v)]
    return f"{max(finite):.2e}" if finite else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "results"))
    parser.add_argument("--quick", action="store_true", help="0.5B only, spans 256 and 640")
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny")
    parser.add_argument("--variants", nargs="*", help=f"of {[*BENCH_CONFIGS, SDPA]} (all)")
    parser.add_argument("--layers", type=int, default=0, help="layers per graph (0: the shape's)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=150.0, help="then skip what is left")
    args = parser.parse_args()
    variants = args.variants or [*BENCH_CONFIGS, SDPA]
    unknown = [v for v in variants if v != SDPA and v not in BENCH_CONFIGS]
    if unknown:
        parser.error(f"--variants {unknown}: use some of {[*BENCH_CONFIGS, SDPA]}")
    if SDPA in variants:  # first: the others' errors are measured against it
        variants = [SDPA] + [v for v in variants if v != SDPA]
    shapes, batches, spans = ["0.5b", "1.5b"], [64, 256], [128, 256, 512, 640]
    if args.quick:
        shapes, spans = ["0.5b"], [256, 640]
    if args.smoke:
        shapes, batches, spans = ["0.5b"], [3], [40, 96]
        args.layers, args.replays = args.layers or 2, 1
    elif not torch.cuda.is_available():
        print("decode_attention_gpu.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    import triton

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu-smoke"
    report = dict(
        device=name, torch=torch.__version__, triton=triton.__version__,
        default_variant=next((k for k, c in BENCH_CONFIGS.items()
                              if c == decode_kernel.DEFAULT_CONFIG), "not a candidate"),
        args=vars(args), results=[],
    )  # fmt: skip
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    out = Path(args.out_dir) / f"decode_attention_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    status = 0
    try:
        for shape_name in shapes:
            shape = attention_shape(shape_name)
            for batch in batches:
                bench_case(
                    shape_name, shape, batch, spans, variants, args, report["results"], deadline
                )
                report["wall_s"] = time.perf_counter() - t0
                out.write_text(json.dumps(report, indent=2) + "\n")  # what is done so far
    except Exception:
        traceback.print_exc()
        status = 1
    report["wall_s"] = time.perf_counter() - t0
    table = markdown(report)
    write_report(out.with_suffix(".md"), table, data=report, json_path=out)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    failed = [r for r in report["results"] if not r.get("error", "skipped").startswith("skipped")]
    return status or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
