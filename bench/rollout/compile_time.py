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


def measure(kind: str, layers: int, device: str, model_root: Path) -> dict:
    """One measurement, in this process (the caller gives it a fresh one and a fresh cache)."""
    import torch
    from torch._dynamo.utils import counters

    from yatt.testing import make_tiny_causal_lm

    model_dir = model_root / f"qwen2-{layers}"
    if not (model_dir / "config.json").is_file():
        make_tiny_causal_lm(model_dir, arch="qwen2", num_layers=layers)
    if kind.startswith("engine"):
        from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

        config = EngineConfig(
            device=device,
            max_batch_size=4,
            max_seq_len=128,
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
    return {
        "kind": kind,
        "layers": layers,
        "first_s": times[0],
        "second_s": times[1],
        "unique_graphs": counters["stats"]["unique_graphs"],
    }


def run_all(args: argparse.Namespace) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for layers in args.layers:
            for kind in args.kinds:
                cache = Path(work) / f"inductor-{kind}-{layers}"  # empty: a cold compile
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
                cmd = [sys.executable, __file__, "--one", kind, str(layers)]
                cmd += ["--device", args.device, "--model-root", str(Path(work) / "models")]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                if done.returncode or not lines:
                    rows.append({"kind": kind, "layers": layers, "error": done.stderr[-400:]})
                else:
                    rows.append(json.loads(lines[-1]))
                print(json.dumps(rows[-1])[:300], flush=True)
    return {
        "commit": measured_commit(["bench", "packages"]),
        "device": "cpu" if args.device == "cpu" else device_name(),
        "command": "python bench/rollout/compile_time.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }


def markdown(results: dict) -> str:
    lines = [
        f"# First-call compile time by depth ({results['device']})",
        "",
        f"commit: {results['commit']} · random Qwen2, width 64 (bench/rollout/compile_time.py); "
        "each row its own process and empty inductor cache",
        "",
        "| layers | kind | first call s | second call s | unique graphs |",
        "|---:|---|---:|---:|---:|",
    ]
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['layers']} | {row['kind']} | error | | |")
            continue
        lines.append(
            f"| {row['layers']} | {row['kind']} | {row['first_s']:.1f} | {row['second_s']:.2f} "
            f"| {row['unique_graphs']} |"
        )
    lines += ["", f"Command: `{results['command']}`"]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="/tmp/yatt-compile-time")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 24])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--one", nargs=2, metavar=("KIND", "LAYERS"), help=argparse.SUPPRESS)
    p.add_argument("--model-root", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        kind, layers = args.one[0], int(args.one[1])
        print(json.dumps(measure(kind, layers, args.device, Path(args.model_root))))
        return
    results = run_all(args)
    name = "compile_time_" + ("cpu" if args.device == "cpu" else device_name())
    path = write_report(Path(args.out_dir) / f"{name}.md", markdown(results), data=results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
