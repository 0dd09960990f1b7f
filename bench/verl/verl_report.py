"""yatt beside verl and TRL + vLLM on one GPU: bench/results/verl_<gpu>.md and .json.

    python3 bench/verl/verl_report.py --results-dir RUNS --out-dir bench/results

Reads, from RUNS: yatt's runs (bench/step/step.py: step_<variant>_1gpu.json), TRL + vLLM colocate
(bench/step/step_trl.py --use-vllm: trl_vllm_1gpu.json), TRL with HF generate if present
(step_trl_1gpu.json), and verl's (bench/verl/verl_step.py: verl_<variant>_1gpu.json). Every run holds
per-mix medians, min and max over its timed steps (>= 5 after warm-up); this report puts them in
one table per mix and judge shape and computes two ratios:

  yatt / verl      longtail mix: the best (lowest median step) 1-GPU yatt run over verl's run
                   with the same judge shape;
  yatt / TRL+vLLM  fixed mix: the best 1-GPU yatt run over TRL + vLLM colocate.

yatt's step time is taken without its checkpoint phase (step_without_ckpt_s): neither verl
(save_freq=-1) nor TRL (save_strategy="no") saves during the timed steps. A ratio between two
runs whose wall-clock intervals overlapped on one host is refused (they shared the GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from measured_commit import measured_commit
from report import write_report as write_files

BARS = {"yatt_vs_verl": 0.41, "yatt_vs_trl_vllm": 0.5}


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max over timed steps of the step time and each phase, and the median GPU
    busy fraction of each GPU (steps without NVML samples left out)."""
    if not steps:
        raise ValueError("summarize: no timed steps (were all steps warm-up?)")
    names = sorted({k for s in steps for k in s["phases"]})
    out: dict[str, Any] = {}
    for label, fn in (("median", statistics.median), ("min", min), ("max", max)):
        out[label] = {
            "step_s": fn(s["step_s"] for s in steps),
            "phases": {k: fn(s["phases"].get(k, 0.0) for s in steps) for k in names},
        }
    gpus = []
    for k, gpu in enumerate(g["gpu"] for g in steps[0].get("gpus", [])):
        busy = [s["gpus"][k]["busy"] for s in steps if s["gpus"][k].get("busy") is not None]
        peak = [
            s["gpus"][k]["peak_used_gib"] for s in steps if s["gpus"][k].get("busy") is not None
        ]
        gpus.append(
            {
                "gpu": gpu,
                "busy": statistics.median(busy) if busy else None,
                "peak_used_gib": max(peak, default=None),
            }
        )
    out["median"]["gpus"] = gpus
    out["num_timed"] = len(steps)
    return out


# -- loading -----------------------------------------------------------------------------------
def framework_of(run: dict[str, Any]) -> str:
    if run.get("framework"):
        return run["framework"]
    layout = run.get("layout", "")
    if layout == "trl-vllm":
        return "trl-vllm"
    if layout.split("-")[0] == "trl":
        return "trl-hf"
    return "yatt"


def load_runs(results_dir: Path) -> list[dict[str, Any]]:
    runs = []
    for pattern in ("step_*_1gpu.json", "trl_vllm_1gpu.json", "verl_*_1gpu.json"):
        for path in sorted(results_dir.glob(pattern)):
            run = json.loads(path.read_text())
            if run.get("tiny"):
                continue
            run["file"] = path.name
            run["framework"] = framework_of(run)
            runs.append(run)
    return runs


def judge_shape(run: dict[str, Any]) -> str:
    work = run.get("workload", {})
    return work.get("judge_shape") or work.get("policy_shape") or "0.5b"


def step_time(run: dict[str, Any], mix: str, which: str = "median") -> float | None:
    """The run's step time for `mix`: yatt's without its checkpoint phase."""
    result = run.get("mixes", {}).get(mix, {})
    stats = result.get(which)
    if not stats:
        # TRL's JSON keeps the median and the timed steps only: min and max from the steps
        steps = [s["step_s"] for s in result.get("steps", []) if "step_s" in s]
        if which in ("min", "max") and steps:
            return (min if which == "min" else max)(steps)
        return None
    return stats.get("step_without_ckpt_s", stats["step_s"])


def overlaps(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two runs ran at once on one host (their wall-clock intervals intersect)."""
    if a.get("host") != b.get("host"):
        return False
    if None in (a.get("started_at"), a.get("ended_at"), b.get("started_at"), b.get("ended_at")):
        return False
    return a["started_at"] < b["ended_at"] and b["started_at"] < a["ended_at"]


def best_yatt(
    runs: list[dict[str, Any]], mix: str, shape: str, like: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The 1-GPU yatt run with the lowest median step for `mix` and judge `shape` (among those
    doing the same work as `like`, when given)."""
    candidates = [
        r
        for r in runs
        if r["framework"] == "yatt"
        and r.get("num_gpus") == 1
        and judge_shape(r) == shape
        and step_time(r, mix) is not None
        and (like is None or not different_work(r, like))
    ]
    return min(candidates, key=lambda r: step_time(r, mix), default=None)


SAME_WORK = ("num_prompts", "group_size", "prompt_tokens", "judge_tokens")


def different_work(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The workload fields (SAME_WORK) in which two runs differ."""
    wa, wb = a.get("workload", {}), b.get("workload", {})
    return [k for k in SAME_WORK if wa.get(k) != wb.get(k)]


def ratio(num: dict | None, den: dict | None, mix: str) -> dict[str, Any]:
    if num is None or den is None:
        missing = "yatt" if num is None else "the anchor"
        return {"value": None, "why": f"not measured ({missing} has no {mix} run)"}
    if fields := different_work(num, den):
        return {
            "value": None,
            "why": f"refused: {num['file']} and {den['file']} differ in {fields}",
        }
    if overlaps(num, den):
        return {"value": None, "why": f"refused: {num['file']} and {den['file']} overlapped"}
    return {
        "value": step_time(num, mix) / step_time(den, mix),
        "num": num["file"],
        "den": den["file"],
    }


def ratios(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for shape in sorted({judge_shape(r) for r in runs}):
        # verl at its best: the fastest of its runs on this judge (default or fused log-prob
        # head), with the old log-probs taken from the rollout as yatt's are
        verl = min(
            (
                r
                for r in runs
                if r["framework"] == "verl"
                and judge_shape(r) == shape
                and step_time(r, "longtail") is not None
                and r.get("config", {}).get("old_log_prob", "bypass") == "bypass"
            ),
            key=lambda r: step_time(r, "longtail"),
            default=None,
        )
        key = "yatt_vs_verl" + ("" if shape == "0.5b" else f"_j{shape}")
        yatt = best_yatt(runs, "longtail", shape, like=verl) or best_yatt(runs, "longtail", shape)
        out[key] = ratio(yatt, verl, "longtail") | {
            "bar": BARS["yatt_vs_verl"],
            "mix": "longtail",
        }
    trl = next((r for r in runs if r["framework"] == "trl-vllm"), None)
    yatt = best_yatt(runs, "fixed", "0.5b", like=trl) or best_yatt(runs, "fixed", "0.5b")
    out["yatt_vs_trl_vllm"] = ratio(yatt, trl, "fixed") | {
        "bar": BARS["yatt_vs_trl_vllm"],
        "mix": "fixed",
    }
    return out


# -- output ------------------------------------------------------------------------------------
def _cell(run: dict[str, Any], mix: str) -> str:
    med, lo, hi = (step_time(run, mix, w) for w in ("median", "min", "max"))
    if med is None:
        return ""
    return f"{med:.2f} ({lo:.2f}-{hi:.2f})" if lo is not None and hi is not None else f"{med:.2f}"


def _phases(run: dict[str, Any], mix: str) -> str:
    med = run["mixes"][mix]["median"]
    parts = [f"{k} {v:.2f}" for k, v in med.get("phases", {}).items() if v]
    if med.get("switch_s"):
        parts.append(f"switch {med['switch_s']:.2f}")
    return ", ".join(parts)


def _busy(run: dict[str, Any], mix: str) -> str:
    gpus = run["mixes"][mix]["median"].get("gpus") or []
    busy = [g["busy"] for g in gpus if g.get("busy") is not None]
    return f"{100 * statistics.mean(busy):.0f}%" if busy else "n/a"


def write_report(runs: list[dict[str, Any]], out_dir: Path, *, commit: str | None) -> Path:
    if not runs:
        raise ValueError("no runs: pass --results-dir with step_*/trl_vllm/verl_* JSONs")
    device = runs[0].get("device", "cuda")
    table = ratios(runs)
    lines = [f"# yatt beside verl and TRL + vLLM, one GPU ({device})", ""]
    lines.append(f"yatt commit: {commit or 'unknown'}")
    for run in runs:
        if run.get("versions"):
            pairs = ", ".join(f"{k} {v}" for k, v in run["versions"].items() if v)
            lines.append(f"{run['file']}: {pairs}")
    lines += ["", "| ratio | mix | value | bar | runs |", "|---|---|---:|---:|---|"]
    for name, r in table.items():
        value = f"{r['value']:.2f}" if r.get("value") is not None else r.get("why", "")
        runs_cell = f"{r.get('num', '')} / {r.get('den', '')}" if r.get("value") else ""
        lines.append(f"| {name} | {r['mix']} | {value} | <= {r['bar']} | {runs_cell} |")
    for mix in ("fixed", "longtail"):
        for shape in sorted({judge_shape(r) for r in runs}):
            rows = [r for r in runs if mix in r.get("mixes", {}) and judge_shape(r) == shape]
            if not rows:
                continue
            lines += ["", f"## {mix} mix, judge {shape}", ""]
            lines += ["| run | step s, median (min-max) | phases (median s) | GPU busy |"]
            lines += ["|---|---|---|---:|"]
            for r in sorted(rows, key=lambda r: step_time(r, mix) or 0.0):
                label = r.get("label", r["layout"])
                lines.append(
                    f"| {label} ({r['file']}) | {_cell(r, mix)} | {_phases(r, mix)} | "
                    f"{_busy(r, mix)} |"
                )
    md = out_dir / f"verl_{device}.md"
    summary = {
        "device": device,
        "yatt_commit": commit,
        "ratios": table,
        "runs": [
            {k: r.get(k) for k in ("file", "framework", "layout", "label", "versions", "workload")}
            | {
                "mixes": {
                    m: {k: v for k, v in s.items() if k != "steps"} for m, s in r["mixes"].items()
                }
            }
            for r in runs
        ],
    }
    write_files(md, "\n".join(lines), data=summary)
    print("\n".join(lines))
    return md


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", required=True)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument(
        "--commit", default=None, help="yatt's commit (default: $YATT_COMMIT, else HEAD)"
    )
    args = p.parse_args(argv)
    runs = load_runs(Path(args.results_dir))
    write_report(runs, Path(args.out_dir), commit=args.commit or measured_commit())


if __name__ == "__main__":
    main()
