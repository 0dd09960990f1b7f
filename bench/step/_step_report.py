"""bench/step/step.py --report: combine the per-run JSONs into one JSON, a Markdown table (medians
of the timed steps with their min and max), the ratios against their bars (pass/fail, _step_bars.py) and a
stacked-bar plot of the phases.

Runs are keyed by variant (_step_setup.variant_key): the layout, then what differs from the
defaults ("-auto" for Plan(offload="auto"), "-p<N>" for --prompts N, "-defer", "-vllm", ...).
Each run records its wall-clock interval and host, so the report can refuse ratios between
runs that shared a host at the same time (_step_bars.apply_guard), and whether its first timed
step was an outlier (first-touch host memory the warm-up missed: the "1st/median" column).
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
from pathlib import Path
from typing import Any

import _step_memory
from _step_bars import (
    Stat,
    compute_ratios,
    label_of,
    overlaps,
    phase_metric,
    rollout_genrm,
    rollout_genrm_per_kept_group,
    run_key,
    run_order,
    sampling_metric,
    stat,
    step_per_kept_group,
    step_time,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from report import write_report as write_files

PHASES = ("rollout", "genrm", "rollout+genrm", "train", "sync", "ckpt")
COLORS = {
    "rollout": "#4c72b0",
    "genrm": "#dd8452",
    "rollout+genrm": "#8172b3",
    "train": "#55a868",
    "sync": "#c44e52",
    "ckpt": "#937860",
    "other": "#bbbbbb",
}
# A first timed step this much slower than the median is reported as an outlier.
OUTLIER = 1.25


def write_run(
    out_dir: str | Path,
    *,
    layout: str,
    variant: str | None = None,
    num_ranks: int,
    tiny: bool,
    workload: dict,
    ckpt_root: str,
    by_mix: dict[str, list[list[dict]]],
    started_at: float | None = None,
    ended_at: float | None = None,
    judge_pool: list[dict] | None = None,
) -> Path:
    """One run's JSON (step_<layout>_<n>gpu.json): every rank's rows per mix, summarised.

    started_at/ended_at: the run's wall-clock interval (time.time(), from before its models
    load to after its last step), with this host's name: the report refuses ratios between
    runs whose intervals overlapped on one host (_step_bars.apply_guard).
    judge_pool: the dedicated layout's servers (GPU, URL, the load each served).
    """
    from _step_setup import device_name

    # dedicated: the judge pool's GPUs count (on CPU runs its processes stand for them).
    judge_gpus = sorted({s["gpu"] for s in judge_pool or []})
    num_gpus = num_ranks + len(judge_gpus)
    variant = variant or layout
    run = {
        "layout": variant,
        "base_layout": layout,
        "label": label_of(variant),
        "num_gpus": num_gpus,
        "num_ranks": num_ranks,
        "num_judge_gpus": len(judge_gpus),
        "judge_pool": judge_pool,
        "device": device_name(),
        "tiny": tiny,
        "workload": workload,
        "ckpt_root": ckpt_root,
        "host": socket.gethostname(),
        "started_at": started_at,
        "ended_at": ended_at,
        "mixes": {mix: summarize_mix(ranks) for mix, ranks in by_mix.items()},
    }
    out = Path(out_dir) / f"step_{variant}_{num_gpus}gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(run, indent=1))
    print(f"wrote {out}", flush=True)
    return out


def summarize_mix(ranks: list[list[dict]]) -> dict:
    """Per timed step: phase = max over ranks; GPUs = every rank's; then medians, min and
    max, and the first timed step against the median (an outlier: the warm-up missed some
    first-touch memory). The warm-up steps' times are kept too."""
    steps, warmup_s = [], []
    for i, row in enumerate(ranks[0]):
        if row["is_warmup"]:
            warmup_s.append(max(r[i]["t1"] for r in ranks) - min(r[i]["t0"] for r in ranks))
            continue
        rows = [r[i] for r in ranks]
        names = sorted({k for r in rows for k in r["phases"]})
        steps.append(
            {
                "step_s": max(r["t1"] for r in rows) - min(r["t0"] for r in rows),
                "phases": {k: max(r["phases"].get(k, 0.0) for r in rows) for k in names},
                "switch_s": max(r["switch_s"] for r in rows),
                # Into which phase the time went (sleep/wake of the roles), slowest rank's.
                "switches": {
                    k: max(r.get("switches", {}).get(k, 0.0) for r in rows)
                    for k in sorted({k for r in rows for k in r.get("switches", {})})
                },
                # The weight sync's call alone (its phase less the switch and the plan's
                # bookkeeping), slowest rank's.
                "sync_call_s": max(r.get("sync_call_s", 0.0) for r in rows),
                "gpus": sorted((g for r in rows for g in r["gpus"]), key=lambda g: g["gpu"]),
                "bad_lengths": sum(r["bad_lengths"] for r in rows),
                "num_completions": sum(r["num_completions"] for r in rows),
                "response_tokens": sum(r["response_tokens"] for r in rows),
                "judge_prompt_tokens": sum(r["judge_prompt_tokens"] for r in rows),
                "num_unparsable": sum(r["num_unparsable"] for r in rows),
                # partial colocation: judge calls, and how many joined a running decode loop
                "judge_batches": sum(r.get("judge_batches", 0) for r in rows),
                "judge_joined_calls": sum(r.get("judge_joined_calls", 0) for r in rows),
                "max_reserved_gib": [r["max_reserved_gib"] for r in rows],
                # The plan's memory timeline, rank 0's (_step_memory).
                "memory": rows[0].get("memory"),
            }
        )
        if any("sampling" in r for r in rows):  # the seed mix: dynamic sampling's counts
            steps[-1]["sampling"] = sampling_over_ranks([r["sampling"] for r in rows])
    med = statistics.median
    gpu_ids = [g["gpu"] for g in steps[0]["gpus"]]
    gpus = []
    for k, gpu in enumerate(gpu_ids):
        busy = [s["gpus"][k]["busy"] for s in steps if s["gpus"][k]["busy"] is not None]
        peak = [s["gpus"][k]["peak_used_gib"] for s in steps if s["gpus"][k]["busy"] is not None]
        gpus.append(
            {
                "gpu": gpu,
                "busy": med(busy) if busy else None,
                "peak_used_gib": max(peak, default=None),
            }
        )
    summary = {
        name: {
            "step_s": fn(s["step_s"] for s in steps),
            # TRL saves no checkpoint in its steps: the like-for-like yatt step leaves ours out.
            "step_without_ckpt_s": fn(s["step_s"] - s["phases"].get("ckpt", 0.0) for s in steps),
            "phases": {k: fn(s["phases"][k] for s in steps) for k in steps[0]["phases"]},
            "switch_s": fn(s["switch_s"] for s in steps),
        }
        for name, fn in (("median", med), ("min", min), ("max", max))
    }
    summary["median"]["gpus"] = gpus
    return {
        **summary,
        "num_timed": len(steps),
        "first_over_median": steps[0]["step_s"] / summary["median"]["step_s"],
        "warmup_step_s": warmup_s,
        "steps": steps,
        "all_lengths_forced": all(s["bad_lengths"] == 0 for s in steps),
    }


def sampling_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, Any]:
    """One step's dynamic-sampling stats over all ranks: counts summed ("num_*"), the keep
    rate over them, the rest (factor, split, filled) rank 0's, and every rank's own."""
    out: dict[str, Any] = {
        k: sum(r[k] for r in per_rank) for k in per_rank[0] if k.startswith("num_")
    }
    judged = out.get("num_groups_generated", 0.0)
    out["keep_rate"] = (out.get("num_groups_kept", 0.0) + out.get("num_groups_surplus", 0.0)) / (
        judged or 1.0
    )
    for k, v in per_rank[0].items():
        out.setdefault(k, v)
    out["is_filled_all_ranks"] = min(r["is_filled"] for r in per_rank)
    if len(per_rank) > 1:
        out["ranks"] = per_rank
    return out


def load_runs(results_dir: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(results_dir.glob("step_*gpu.json")):
        run = json.loads(path.read_text())
        run["file"] = path.name
        runs.append(run)
    return runs


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def _cell(value: Stat | dict | None) -> str:
    """ "1.77 (1.37-6.24)": median (min-max) of the timed steps; the median alone if that is
    all a run kept."""
    if value is None:
        return ""
    if isinstance(value, dict):
        value = Stat(**value)
    if value.min is None or value.max is None:
        return _fmt(value.median)
    return f"{_fmt(value.median)} ({_fmt(value.min)}-{_fmt(value.max)})"


def first_over_median(run: dict, mix: str) -> float | None:
    """The first timed step's time over the median of all timed steps."""
    steps = run["mixes"][mix].get("steps", [])
    med = stat(run, mix, step_time)
    if not steps or med is None or not med.median or steps[0].get("step_s") is None:
        return None
    return steps[0]["step_s"] / med.median


def _switches(s: dict) -> float | None:
    return s.get("switch_s")


def models_of(run: dict) -> str:
    """ "1.5b/1.5b": the policy's and the judge's shapes (older runs: 0.5B, or tiny)."""
    work = run.get("workload", {})
    default = "tiny" if run.get("tiny") else "0.5b"
    return f"{work.get('policy_shape', default)}/{work.get('judge_shape', default)}"


def markdown(runs: list[dict], ratios: list[dict], device: str) -> str:
    lines = [
        f"# GRPO step by placement on {device}",
        "",
        "`bash bench/step/step_gpu.sh` or `bench/step/step_gpu8.sh` (bench/step/step.py, bench/step/step_trl.py): "
        "median (min-max) of the "
        "timed steps (after warm-up); phase times are the slowest rank's; busy = mean NVML "
        "utilization over the step; peak = NVML used memory; 1st/median = the first timed "
        f"step over the median (over {OUTLIER} where every step does the same work: an "
        "outlier, the warm-up missed something; the longtail mix's lengths differ per step).",
        "",
        "| layout | GPUs | models | mix | timed steps | step s | "
        + " | ".join(PHASES)
        + " | genrm tail | switches s | busy per GPU | peak GiB per GPU | lengths forced"
        + " | 1st/median |",
        "|---|---:|---|---|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|---|---|---|---:|",
    ]
    outliers = []
    for run in sorted(runs, key=lambda r: (r["num_gpus"], r["layout"])):
        for mix, res in run["mixes"].items():
            med = res["median"]
            phases = [_cell(stat(run, mix, phase_metric(p))) for p in PHASES]
            busy = ", ".join(_fmt(g["busy"]) for g in med.get("gpus", []))
            peak = ", ".join(_fmt(g["peak_used_gib"], ".1f") for g in med.get("gpus", []))
            first = first_over_median(run, mix)
            flag = ""
            # Only steps of equal work compare (longtail lengths differ from step to step).
            same_work = len({s.get("response_tokens") for s in res.get("steps", [])}) == 1
            if first is not None and first > OUTLIER and same_work:
                flag = " (outlier)"
                outliers.append(f"{run_key(run)} {mix}: first timed step {first:.2f}x the median")
            lines.append(
                f"| {run['label']} | {run['num_gpus']} | {models_of(run)} | {mix} | "
                + f"{len(res.get('steps', []))} | "
                + _cell(stat(run, mix, step_time))
                + " | "
                + " | ".join(phases)
                + f" | {_cell(stat(run, mix, phase_metric('genrm_tail')))}"
                + f" | {_cell(stat(run, mix, _switches))}"
                + f" | {busy or 'n/a'} | {peak or 'n/a'} | {res.get('all_lengths_forced')}"
                + f" | {_fmt(first)}{flag} |"
            )
    lines += seed_table(runs)
    lines += [
        "",
        "## Bars",
        "",
        "Ratios of medians; numerator and denominator as median (min-max) seconds.",
        "",
        "| ratio | value | numerator s | denominator s | bar | result |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in ratios:
        verdict = r.get("verdict") or (
            "not measured" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        )
        bar = "none" if r["bar"] is None else f"<= {r['bar']}"
        lines.append(
            f"| {r['what']} | {_fmt(r['value'], '.3f')} | {_cell(r.get('num'))} | "
            f"{_cell(r.get('den'))} | {bar} | {verdict} |"
        )
    notes = [run["note"] for run in runs if run.get("note")]
    for run in runs:
        if run.get("judge_pool"):
            served = ", ".join(
                f"GPU {s['gpu']}"
                + (f" ({s['url']})" if s.get("url") else "")
                + f": {s['num_samples']}"
                for s in run["judge_pool"]
            )
            notes.append(f"{run_key(run)}: samples judged per judge server over the run: {served}.")
    for key, others in sorted(overlaps(runs).items()):
        notes.append(
            f"{key} ran while {', '.join(others)} ran on the same host: ratios using it are "
            "refused (run them one after another)."
        )
    unchecked = [run_key(r) for r in runs if r.get("started_at") is None]
    if unchecked:
        notes.append(
            f"{', '.join(unchecked)}: no wall-clock interval recorded, so whether another run "
            "shared the host meanwhile is unchecked."
        )
    notes += [f"{o} (the warm-up missed some first-touch memory)." for o in outliers]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def judge_tail(s: dict) -> float | None:
    """The judge's work after the rollout stopped: partial's tail, full's GenRM phases."""
    p = s.get("phases", {})
    return p.get("genrm_tail", p.get("genrm"))


SEED_COLUMNS = (
    ("step s", step_time),
    ("rollout+GenRM s", rollout_genrm),
    ("per kept group s", rollout_genrm_per_kept_group),
    ("step per kept group s", step_per_kept_group),
    ("judge tail s", judge_tail),
    ("groups kept", sampling_metric("num_groups_kept")),
    ("groups judged", sampling_metric("num_groups_generated")),
    ("rounds (stream: draws)", sampling_metric("num_rounds")),
    ("tokens generated", sampling_metric("num_tokens_generated")),
    ("tokens aborted", sampling_metric("num_tokens_aborted")),
    ("groups aborted", sampling_metric("num_groups_aborted")),
    ("rollout memory share", sampling_metric("split_rollout_fraction")),
    ("stream: rollout end s", sampling_metric("stream_rollout_end_s")),
    (
        "stream: judge after the last kept response s",
        sampling_metric("stream_judge_after_last_kept_s"),
    ),
)


def seed_table(runs: list[dict]) -> list[str]:
    """The seed mix: dynamic sampling's work per layout and sampler."""
    seeded = [r for r in sorted(runs, key=run_order) if "seed" in r.get("mixes", {})]
    if not seeded:
        return []
    lines = [
        "",
        "## Seed mix: dynamic sampling",
        "",
        "Medians (min-max) over the timed steps; per kept group = rollout+GenRM time / groups "
        "kept over all ranks; judge tail = the judge's work after the rollout stopped (partial: "
        "after the abort or the last response; full: its GenRM phases); rollout memory share = "
        "the split after the step (partial colocation; the live queues' pending tokens); "
        "stream: rollout end = its last response or the abort, from the stream's start; judge "
        "after the last kept response = from the last response of a kept group to the target "
        "reached (that response's whole verdict: the stream's floor on one GPU).",
        "",
        "| layout | GPUs | models | "
        + " | ".join(name for name, _ in SEED_COLUMNS)
        + " | busy per GPU |",
        "|---|---:|---|" + "---:|" * len(SEED_COLUMNS) + "---|",
    ]
    for run in seeded:
        med = run["mixes"]["seed"]["median"]
        busy = ", ".join(_fmt(g["busy"]) for g in med.get("gpus", []))
        cells = [_cell(stat(run, "seed", metric)) for _, metric in SEED_COLUMNS]
        lines.append(
            f"| {run['label']} | {run['num_gpus']} | {models_of(run)} | "
            + " | ".join(cells)
            + f" | {busy or 'n/a'} |"
        )
    return lines


def _bar_name(run: dict) -> str:
    layout, _, settings = run["layout"].partition("-")
    return "\n".join(x for x in (layout, settings, f"{run['num_gpus']} GPU") if x)


def setup_mixes() -> tuple[str, ...]:
    from _step_setup import MIXES

    return MIXES


def plot(runs: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    mixes = [m for m in setup_mixes() if any(m in r["mixes"] for r in runs)]
    if not mixes:
        return None
    most = max((sum(m in r["mixes"] for r in runs) for m in mixes), default=1)  # fullest panel
    width = max(6.0, 1.0 * most)
    fig, axes = plt.subplots(1, len(mixes), figsize=(width * len(mixes), 5), squeeze=False)
    for ax, mix in zip(axes[0], mixes, strict=True):
        # By GPU count, then (a), (b), (c), as the bars name them.
        bars = [
            r
            for r in sorted(runs, key=lambda r: (r["num_gpus"], run_order(r)))
            if mix in r["mixes"]
        ]
        # "dedicated\n6+2-pr64-1.5b\n8 GPU": the variant over two lines, then the GPU count.
        names = [_bar_name(r) for r in bars]
        bottoms = [0.0] * len(bars)
        for phase in (*PHASES, "other"):
            heights = []
            for r in bars:
                med = r["mixes"][mix]["median"]
                known = sum(med["phases"].get(p, 0.0) for p in PHASES)
                value = med["phases"].get(phase, 0.0) if phase != "other" else med["step_s"] - known
                heights.append(max(value, 0.0))
            if any(heights):
                ax.bar(names, heights, bottom=bottoms, label=phase, color=COLORS[phase])
                bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        # Whiskers: the fastest and the slowest timed step.
        spreads = [stat(r, mix, step_time) for r in bars]
        low = [s.median - s.min if s and s.min is not None else 0.0 for s in spreads]
        high = [s.max - s.median if s and s.max is not None else 0.0 for s in spreads]
        ax.errorbar(names, bottoms, yerr=[low, high], fmt="none", ecolor="black", capsize=3)
        ax.set_title(f"{mix} lengths")
        ax.set_ylabel("median step time (s), whiskers min-max")
        ax.tick_params(axis="x", labelsize=8)
    return _step_memory.save_with_legend_above(fig, axes[0], path, top=0.93)


def write_report(results_dir: Path, device: str | None = None) -> dict[str, Any]:
    runs = load_runs(results_dir)
    if not runs:
        raise ValueError(f"no step_*gpu.json runs in {results_dir}; run bench/step/step.py first")
    device = device or runs[0]["device"]
    ratios = compute_ratios(runs)
    ooms = _step_memory.load_ooms(results_dir)
    combined = {"device": device, "runs": runs, "ratios": ratios, "ooms": ooms}
    stem = results_dir / f"step_{device}"
    memory_md = _step_memory.markdown(runs, ooms)
    write_files(stem.with_suffix(".md"), markdown(runs, ratios, device) + memory_md, data=combined)
    png = plot(runs, stem.with_suffix(".png"))
    memory_png = _step_memory.plot(runs, results_dir / f"step_memory_{device}.png")
    print(markdown(runs, ratios, device) + memory_md, flush=True)
    pngs = ", ".join(str(x) for x in (png, memory_png) if x)
    print(f"wrote {stem}.json, {stem}.md" + (f", {pngs}" if pngs else ""), flush=True)
    return combined
