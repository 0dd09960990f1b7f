"""Logprobs from full logits against logprobs computed in the head, chunk by chunk.

    python bench/logprobs/head_logprobs.py                      # CPU: peak RSS and time, 2 layers
    python bench/logprobs/head_logprobs.py --device cuda        # GPU: peak allocated memory and time

A Qwen2.5-0.5B-wide model (hidden 896, vocabulary 151936) with few layers, so the head is what
differs. Each variant runs forward + backward of a token-mean logprob loss in its own process
(a clean peak), alternating, and the table gives medians over --repeats.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))  # bench/step: _step_setup
from _step_setup import QWEN25_05B

VARIANTS = ("logits", "head")


def measure(variant: str, device: str, tokens: int, layers: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from yatt.core import compute_token_logprobs, logprobs_in_head

    config = Qwen2Config(**(QWEN25_05B | {"num_hidden_layers": layers}))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (tokens // 1024, 1024), device=device)

    def step() -> None:
        if variant == "head":
            with logprobs_in_head(model, ids, temperature=1.0, needs_entropy=False):
                logprobs = model(input_ids=ids).logits[..., 0]
        else:
            logprobs = compute_token_logprobs(model(input_ids=ids).logits, ids)
        logprobs.mean().backward()

    step()  # warm-up (kernels, allocator)
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if device == "cuda":
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
    else:  # ru_maxrss is KiB on Linux
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"variant": variant, "seconds": seconds, "peak_gib": peak_gib}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=4096, help="multiple of 1024")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON path for the runs and medians")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.device, args.tokens, args.layers)))
        return 0
    runs = []
    for _ in range(args.repeats):
        for variant in VARIANTS:
            command = [sys.executable, __file__, "--child", variant, "--device", args.device]
            command += ["--tokens", str(args.tokens), "--layers", str(args.layers)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
    medians = {
        v: {
            key: statistics.median(r[key] for r in runs if r["variant"] == v)
            for key in ("seconds", "peak_gib")
        }
        for v in VARIANTS
    }
    print(f"{args.tokens} tokens, {args.layers} layers, {args.device}, medians of {args.repeats}")
    print("| variant | step s | peak GiB |\n|---|---:|---:|")
    for v in VARIANTS:
        print(f"| {v} | {medians[v]['seconds']:.2f} | {medians[v]['peak_gib']:.2f} |")
    ratio = medians["head"]["peak_gib"] / medians["logits"]["peak_gib"]
    print(f"head/logits peak {ratio:.2f}")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"args": vars(args), "runs": runs, "medians": medians})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
