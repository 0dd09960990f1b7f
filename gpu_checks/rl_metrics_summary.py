"""The RL-fidelity numbers of trainer runs: clip fractions, engine-vs-trainer mismatch, IS weights,
truncation, and the reward's change, per metrics.jsonl given (median, min, max over steps).

    python gpu_checks/rl_metrics_summary.py runs/grpo/metrics.jsonl runs/dapo/metrics.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

KEYS = (
    "train/clip_frac",
    "train/clip_frac_low",
    "train/clip_frac_high",
    "train/clip_frac_dual",
    "train/mismatch_kl",
    "train/is_weight",
    "train/is_weight_max",
    "train/is_capped_frac",
    "train/num_optimizer_steps",
    "response/truncated_frac",
)


def summarize(path: Path) -> list[str]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        return [f"{path}: no records"]
    lines = [f"{path}: {len(records)} steps"]
    for key in KEYS:
        values = [r[key] for r in records if isinstance(r.get(key), int | float)]
        if not values:
            lines.append(f"  {key:28s} not logged")
            continue
        lines.append(
            f"  {key:28s} median {statistics.median(values):.4g}  min {min(values):.4g}  "
            f"max {max(values):.4g}  steps>0 {sum(v > 0 for v in values)}"
        )
    for key in ("reward/mean", "reward/accuracy"):
        values = [r[key] for r in records if key in r]
        if len(values) >= 2:
            k = min(10, len(values) // 2)
            first, last = statistics.fmean(values[:k]), statistics.fmean(values[-k:])
            lines.append(f"  {key:28s} first {k} {first:.3f} -> last {k} {last:.3f}")
    return lines


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        path = Path(arg)
        print("\n".join(summarize(path)) if path.exists() else f"{path}: missing")
