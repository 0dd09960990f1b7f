"""How the first step's compile time grows with model depth, and what compiling one decoder layer
(reused by every layer) instead of the whole model would save.

    python bench/rollout/compile_time.py --out-dir OUT                 # CPU, Qwen2 width 64
    python3 bench/rollout/compile_time.py --device cuda --out-dir OUT  # the same on a GPU

Why: at 7B + 7B the trainer's first step took 337 s on a fresh H200 (rollout 176 s, judge 134 s,
compiles) and 140-160 s with inductor's cache warm, where a later step takes 15 s
(bench/results/lora_nvidia_h200.md, session 25). Every GPU bar pays it once per process.

Per depth (a random Qwen2 of the tiny width, so the time is the compile's, not the math's), each
in its own process with its own empty inductor cache (cold, as on a fresh machine):
  engine   the built-in engine's first generate with its compiled decode step and prefill (what
           the trainer's step 0 pays per engine), and a second generate (compiled: fast);
  engine-layers  the same with EngineConfig.compile_scope="layers" (each decoder layer
           compiled once, for every layer and every forward);
  whole    the plain Hugging Face forward compiled as one graph (torch.compile(model));
  layers   the same forward with each decoder layer compiled (layer.compile()): dynamo traces one
           layer and every other layer reuses its graph (one unique graph).
The engine's default compile (compile_scope="step") is the "whole" kind. Its "layers" scope
binds each layer's cache to the attention module (indexing by module.layer_idx, an int
attribute dynamo guards, would make one graph per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from device_label import device_name
from measured_commit import measured_commit
from report import write_report

KINDS = ("engine", "engine-layers", "whole", "layers")


def model_dir_for(model: str, root: Path) -> Path:
    """The saved random Qwen2 of `model`: "<N>" layers at the tiny width (the compile's time,
    not the math's), or a bench shape name ("0.5b", "1.5b", "7b": bench/step's shapes, bf16)."""
    path = root / f"qwen2-{model}"
    if (path / "config.json").is_file():
        return path
    if model.isdigit():
        from yatt.testing import make_tiny_causal_lm

        make_tiny_causal_lm(path, arch="qwen2", num_layers=int(model))
        return path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))
    import _step_setup as setup

    policy_dir, _ = setup.make_models(path.with_name(path.name + "-pair"), tiny=False,
                                      shapes=(model, "tiny"))  # fmt: skip
    policy_dir.rename(path)
    return path


def measure(kind: str, model_dir: Path, device: str, decode: tuple[int, int]) -> dict:
    """One measurement, in this process (the caller gives it a fresh one and a fresh cache).
    decode (rows, tokens): after the two calls, the engine kinds time a generate of that many
    rows and forced new tokens (steady decode under the kind's compile; (0, 0): none)."""
    import torch
    from torch._dynamo.utils import counters

    out: dict = {"kind": kind}
    if kind.startswith("engine"):
        from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

        rows, tokens = decode
        config = EngineConfig(
            device=device,
            max_batch_size=max(4, rows),
            max_seq_len=max(128, 16 + tokens),
            region_prefix="compile-time",
            compile_decode=True,
            compile_prefill=True,
            compile_scope="layers" if kind == "engine-layers" else "step",
        )
        engine = BuiltinEngine(model_dir, config=config)
        requests = [Request(prompt_ids=[5, 6, 7, 8][: 2 + i]) for i in range(3)]
        params = SamplingParams(temperature=0.9, max_new_tokens=20, seed=1, ignore_eos=True)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            engine.generate(requests, params)
            times.append(time.perf_counter() - start)
        if rows:
            batch = [Request(prompt_ids=[5 + i % 50, 6, 7, 8, 9, 10, 11, 12]) for i in range(rows)]
            forced = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=2, ignore_eos=True)
            engine.generate(batch, forced)  # this batch size's graphs captured, untimed
            start = time.perf_counter()
            engine.generate(batch, forced)
            out["decode_tok_s"] = rows * tokens / (time.perf_counter() - start)
        engine.close()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = model.to(device).eval()
        if kind == "whole":
            forward = torch.compile(model, dynamic=True)
        else:
            for layer in model.model.layers:
                layer.compile(dynamic=True)
            forward = model
        times = []
        with torch.no_grad():
            for shape in ((2, 9), (3, 13)):  # a second shape: dynamic, no recompile
                ids = torch.randint(0, 200, shape, device=device)
                start = time.perf_counter()
                forward(ids, use_cache=False)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
    return out | {
        "first_s": times[0],
        "second_s": times[1],
        "unique_graphs": counters["stats"]["unique_graphs"],
    }


def run_all(args: argparse.Namespace) -> dict:
    rows = []
    models = [str(n) for n in args.layers] + list(args.shapes)
    with tempfile.TemporaryDirectory() as work:
        for model in models:
            model_dir = model_dir_for(model, Path(work) / "models")
            for kind in args.kinds:
                cache = Path(work) / f"inductor-{kind}-{model}"  # empty: a cold compile
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
                cmd = [sys.executable, __file__, "--one", kind, str(model_dir)]
                cmd += ["--device", args.device, "--decode", *map(str, args.decode)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                if done.returncode or not lines:
                    row = {"kind": kind, "error": done.stderr[-400:]}
                else:
                    row = json.loads(lines[-1])
                rows.append({"model": model} | row)
                print(json.dumps(rows[-1])[:300], flush=True)
    return {
        "commit": measured_commit(["bench", "packages"]),
        "device": "cpu" if args.device == "cpu" else device_name(),
        "command": "python bench/rollout/compile_time.py " + " ".join(sys.argv[1:]),
        "decode": args.decode,
        "rows": rows,
    }


def markdown(results: dict) -> str:
    rows_n, tokens_n = results.get("decode", (0, 0))
    lines = [
        f"# First-call compile time by depth ({results['device']})",
        "",
        f"commit: {results['commit']} · random Qwen2: N layers at width 64, or a bench shape "
        "(bench/rollout/compile_time.py); each row its own process and empty inductor cache"
        + (f"; decode: {rows_n} rows x {tokens_n} forced tokens" if rows_n else ""),
        "",
        "| model | kind | first call s | second call s | unique graphs | decode tok/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        model = row.get("model", row.get("layers"))  # "layers": results before --shapes
        model = f"{model} layers" if str(model).isdigit() else model
        if "error" in row:
            lines.append(f"| {model} | {row['kind']} | error | | | |")
            continue
        tok_s = row.get("decode_tok_s")
        lines.append(
            f"| {model} | {row['kind']} | {row['first_s']:.1f} | {row['second_s']:.2f} "
            f"| {row['unique_graphs']} | {'' if tok_s is None else f'{tok_s:,.0f}'} |"
        )
    lines += ["", f"Command: `{results['command']}`"]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="/tmp/yatt-compile-time")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, nargs="*", default=[2, 24])
    p.add_argument("--shapes", nargs="*", default=[], help="bench shapes, e.g. 0.5b 7b (GPU)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument(
        "--decode",
        type=int,
        nargs=2,
        default=(0, 0),
        metavar=("ROWS", "TOKENS"),
        help="the engine kinds also time a generate of ROWS rows x TOKENS forced new tokens",
    )
    p.add_argument("--one", nargs=2, metavar=("KIND", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        kind, model_dir = args.one
        print(json.dumps(measure(kind, Path(model_dir), args.device, tuple(args.decode))))
        return
    results = run_all(args)
    name = "compile_time_" + ("cpu" if args.device == "cpu" else device_name())
    path = write_report(Path(args.out_dir) / f"{name}.md", markdown(results), data=results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
