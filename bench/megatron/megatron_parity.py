"""Megatron backend on GPU: parity with HF and TorchPolicy, TP=2 vs TP=1, weight sync, sleep, ckpt.

    bash gpu_checks/gpu_checks.sh megatron        # or directly, with megatron-core importable:
    PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':') python3 bench/megatron/megatron_parity.py --out-dir $OUT

Saves three small HF checkpoints (Llama, Qwen2 with q/k/v bias, Qwen3 with qk-norm), then runs
packages/yatt-core/tests/megatron/_gpu_workers.py under torchrun: TP=1 on one GPU (with a
TorchPolicy reference), and on two or more GPUs TP=2 and TP=1 x DP=2. Prints a table of
what it checked and writes bench/results/megatron_parity_<gpu>.json (or --out-dir).
Pass criteria (bf16 weights vs a float32 HF model): mean |dlogprob| < 2e-2 and max < 0.25;
TP=2 vs TP=1 mean < 1e-2; first-step loss vs TorchPolicy within 2e-2 absolute; exported
weights, post-wake logprobs and checkpoint round trip bitwise; sleep frees >= 95% of what the
policy added to the process; the two steps after loading a checkpoint give the losses of the two
steps taken from the saved state (within 1e-4: the second one depends on the optimizer state).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "packages/yatt-core/tests/megatron/_gpu_workers.py"


def _run(
    nproc: int, tp: int, model_dirs: dict, out: Path, *, torch_ref: bool, attention: str
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKER),
        "--tp",
        str(tp),
        "--model-dirs",
        json.dumps(model_dirs),
        "--out",
        str(out),
        "--attention",
        attention,
    ]
    if torch_ref:
        cmd.append("--torch-ref")
    print("$", " ".join(cmd[3:6]), f"tp={tp}", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def _compare_logprobs(a: dict, b: dict) -> dict:
    diffs = []
    for sid, values in a.items():
        if sid in b:
            diffs += [abs(x - y) for x, y in zip(values[1:], b[sid][1:], strict=True)]
    return {"max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs), "num_tokens": len(diffs)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default=str(ROOT / "bench/results"))
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "megatron"))
    args = parser.parse_args()
    from yatt.testing import make_tiny_causal_lm

    tmp = Path(tempfile.mkdtemp(prefix="yatt-mg-parity-"))
    model_dirs = {}
    for arch in ("llama", "qwen2", "qwen3"):
        path = tmp / arch
        # 8 heads in 4 groups (TP=2 splits whole groups); tied embeddings on Qwen2, as its small
        # checkpoints have them.
        make_tiny_causal_lm(
            path,
            arch=arch,
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=512,
            tie_word_embeddings=arch == "qwen2",
            seed=3,
        )
        model_dirs[arch] = str(path)
    num_gpus = torch.cuda.device_count()
    runs = {
        "tp1": _run(1, 1, model_dirs, tmp / "tp1.json", torch_ref=True, attention=args.attention)
    }
    if num_gpus >= 2:
        runs["tp2"] = _run(
            2, 2, model_dirs, tmp / "tp2.json", torch_ref=False, attention=args.attention
        )
        runs["tp1dp2"] = _run(
            2, 1, model_dirs, tmp / "tp1dp2.json", torch_ref=False, attention=args.attention
        )

    checks: dict[str, bool] = {}
    summary: dict = {
        "device": torch.cuda.get_device_name(0),
        "num_gpus": num_gpus,
        "attention": args.attention,
    }
    for name, run in runs.items():
        for arch, fam in run["families"].items():
            key = f"{name}/{arch}"
            lp = fam["logprobs_vs_hf"]
            checks[f"{key} logprobs~hf"] = lp["mean_abs"] < 2e-2 and lp["max_abs"] < 0.25
            checks[f"{key} weights bitwise"] = fam["weights_bitwise_equal"]
            checks[f"{key} wake bitwise"] = fam["sleep"]["logprobs_bitwise_after_wake"]
            sleep = fam["sleep"]
            base = sleep.get("allocated_baseline_bytes", 0)
            checks[f"{key} sleep frees"] = (
                sleep["allocated_asleep_bytes"] - base
                < (sleep["allocated_awake_bytes"] - base) / 20
            )
            checks[f"{key} ckpt bitwise"] = fam["ckpt_weights_bitwise"]
            resumed, continued = fam["ckpt_loss_resumed_vs_continued"]
            checks[f"{key} ckpt resume loss"] = all(
                abs(r - c) < 1e-4 for r, c in zip(resumed, continued, strict=True)
            )
            if "torch_losses" in fam:
                checks[f"{key} step1 loss~torch"] = (
                    abs(fam["megatron_losses"][0] - fam["torch_losses"][0]) < 2e-2
                )
            summary[key] = {k: v for k, v in fam.items() if k != "logprobs"}
    for other in ("tp2", "tp1dp2"):
        if other in runs:
            for arch in runs["tp1"]["families"]:
                cmp = _compare_logprobs(
                    runs[other]["families"][arch]["logprobs"],
                    runs["tp1"]["families"][arch]["logprobs"],
                )
                summary[f"{other}_vs_tp1/{arch}"] = cmp
                checks[f"{other}/{arch} logprobs~tp1"] = cmp["mean_abs"] < 1e-2
                l_other = runs[other]["families"][arch]["megatron_losses"][0]
                l_ref = runs["tp1"]["families"][arch]["megatron_losses"][0]
                checks[f"{other}/{arch} step1 loss~tp1"] = abs(l_other - l_ref) < 1e-2
    summary["checks"] = checks
    width = max(len(k) for k in checks)
    for key, ok in checks.items():
        print(f"{key:<{width}}  {'ok' if ok else 'FAIL'}")
    for key, value in summary.items():
        if isinstance(value, dict) and "megatron_losses" in value:
            print(
                key,
                "losses",
                value["megatron_losses"],
                "torch",
                value.get("torch_losses"),
                "lp",
                value["logprobs_vs_hf"],
            )
    gpu = summary["device"].replace(" ", "_").lower()
    out = Path(args.out_dir) / f"megatron_parity_{gpu}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print("wrote", out)
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
