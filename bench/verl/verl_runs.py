"""verl's metrics log -> the per-step phases and the run JSON that bench/verl/verl_report.py reads.

verl_step.py starts verl and times each line of its metrics JSONL as it lands (LineClock); this
module turns those timed lines into yatt's step rows (parse_steps: t0/t1, verl's raw timing_s,
the phases in yatt's names) and writes the run's verl_<variant>_1gpu.json (write_run). It is apart
from the driver because it needs neither verl nor a GPU: the tests feed it hand-written lines,
and the JSON's format is the contract with verl_report.py, which reads it beside yatt's and TRL's.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))  # bench/step: _step_setup
import _step_setup as setup  # bench/ is not a package

# A run's config is a verl_step.VerlBenchConfig; this module reads its fields but does not
# import it (verl_step imports this one: no circle).
VerlBenchConfig = Any

# verl's timing_raw names -> yatt's phase names. `train` sums what yatt's train phase does (the
# old-log-prob pass only exists with --old-log-prob recompute); the rest of the step is `other`.
PHASES = {
    "rollout": ("gen",),
    "genrm": ("reward",),
    "train": ("old_log_prob", "ref", "adv", "update_actor"),
    "sync": ("update_weights",),
}


def parse_steps(lines: list[tuple[float, str]]) -> list[dict[str, Any]]:
    """verl's JSONL lines ({"step": n, "data": metrics}) -> one row per step: t0/t1 on this
    process's clock, the raw timing_s, the phases in yatt's names, the response lengths."""
    rows = []
    last_arrival = None
    for arrived, line in lines:
        record = json.loads(line)
        data = record["data"]
        timing = {
            k.split("/", 1)[1]: float(v) for k, v in data.items() if k.startswith("timing_s/")
        }
        if "step" not in timing:
            continue  # validation-only lines
        rows.append(
            {
                "step": int(record["step"]),
                "t0": arrived - timing["step"],
                "t1": arrived,
                "step_s": timing["step"],
                # line to line: verl's step plus what its loop does outside the step timer
                # (metrics, TransferQueue clean-up, logging, the next batch's loading)
                "wall_s": None if last_arrival is None else arrived - last_arrival,
                "phases": phases_of(timing),
                "timing_s": timing,
                "response_length": {
                    k: float(data[f"response_length/{k}"])
                    for k in ("mean", "max", "min")
                    if f"response_length/{k}" in data
                },
            }
        )
        last_arrival = arrived
    return rows


def phases_of(timing: dict[str, float]) -> dict[str, float]:
    """verl's timing_raw -> yatt's phases (PHASES); `other` = the step minus them all."""
    phases = {name: sum(timing.get(k, 0.0) for k in keys) for name, keys in PHASES.items()}
    phases["other"] = max(0.0, timing.get("step", 0.0) - sum(phases.values()))
    return phases


def lengths_forced(rows: list[dict[str, Any]], cfg: VerlBenchConfig, work) -> bool:
    """Whether every step's responses had the forced lengths (mean, min and max agree)."""
    for row in rows:
        want = setup.response_lengths(cfg.mix, work, row["step"] - 1)  # verl counts from 1
        got = row["response_length"]
        expected = {"mean": sum(want) / len(want), "max": max(want), "min": min(want)}
        if not got or any(abs(got[k] - v) > 1e-6 for k, v in expected.items() if k in got):
            return False
    return True


def write_run(
    cfg: VerlBenchConfig,
    rows: list[dict[str, Any]],
    out_dir: Path,
    work,
    *,
    started_at: float | None = None,
) -> Path:
    from verl_report import summarize

    timed = [r for r in rows if not r["is_warmup"]]
    run = {
        "layout": cfg.variant,
        "label": f"verl {verl_version()} colocate, vLLM {package_version('vllm')} x2",
        "framework": "verl",
        "versions": {k: package_version(k) for k in ("verl", "vllm", "ray", "transformers")},
        "num_gpus": 1,
        "device": setup.device_name(),
        "host": socket.gethostname(),
        "started_at": started_at,
        "ended_at": time.time(),
        "config": asdict(cfg),
        "workload": {**vars(work), "policy_shape": "0.5b", "judge_shape": cfg.judge_shape},
        "mixes": {
            cfg.mix: {
                **summarize(timed),
                "warmup_step_s": [r["step_s"] for r in rows if r["is_warmup"]],
                "median_wall_s": _median([r["wall_s"] for r in timed if r["wall_s"] is not None]),
                "steps": timed,
                "all_lengths_forced": lengths_forced(rows, cfg, work),
            }
        },
    }
    out = out_dir / f"{cfg.variant}_1gpu.json"
    out.write_text(json.dumps(run, indent=1))
    print(f"[{cfg.variant}] steps {[round(r['step_s'], 2) for r in rows]}; wrote {out}")
    return out


def _median(values: list[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def verl_version() -> str | None:
    return package_version("verl")
