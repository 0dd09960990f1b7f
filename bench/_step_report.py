"""bench/step.py --report: combine the per-run JSONs into one JSON, a Markdown table, the
issue's ratios (pass/fail) and a stacked-bar plot of the phases.

Ratios (issue #8's bars), each computed only when both runs are present:
  full_vs_dedicated_2gpu[mix]   (a) step / (c) step on 2 GPUs               bar <= 0.55
  partial_vs_full_rollout_genrm (b) rollout+genrm / (a) rollout+genrm,
                                 longtail, per GPU count                    bar <= 0.75
  yatt_vs_trl_1gpu              yatt (a) fixed step / TRL step, 1 GPU       bar <= 0.5

Runs are keyed by variant (_step_setup.variant_key): the layout, "-auto" for Plan(offload=
"auto"), "-p<N>" for --prompts N. The bars use the seed's setting (offload every switch, 16
prompts); every variant present gets its own rows next to them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

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


LABELS = {
    "full": "(a) full colocation",
    "partial": "(b) partial colocation",
    "dedicated": "(c) dedicated GenRM GPU",
    "separate": "(c) 1 GPU: judge + policy resident, fixed shares (nothing to dedicate)",
}


ENGINE_NAMES = {"vllm": "vLLM 0.26.0", "sglang": "SGLang 0.5.17"}


def label_of(variant: str) -> str:
    """`(a) full colocation, offload when short of memory, 64 prompts` for "full-auto-p64"."""
    layout, *rest = variant.split("-")
    parts = [LABELS[layout]]
    for part in rest:
        if part == "auto":
            parts.append("offload only when short of memory")
        elif part in ("vllm", "sglang"):
            parts.append(f"{ENGINE_NAMES[part]} as the rollout engine")
        elif part == "defer":
            parts.append("a save finding the writer busy waits for a later step")
        elif part.startswith("p"):
            parts.append(f"{part[1:]} prompts")
    return ", ".join(parts)


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
) -> Path:
    """One run's JSON (step_<layout>_<n>gpu.json): every rank's rows per mix, summarised."""
    from _step_setup import device_name

    # dedicated: the judge's GPU counts (on CPU smoke runs its process stands for that GPU).
    num_gpus = num_ranks + int(layout == "dedicated")
    variant = variant or layout
    run = {
        "layout": variant,
        "base_layout": layout,
        "label": label_of(variant),
        "num_gpus": num_gpus,
        "num_ranks": num_ranks,
        "device": device_name(),
        "tiny": tiny,
        "workload": workload,
        "ckpt_root": ckpt_root,
        "mixes": {mix: summarize_mix(ranks) for mix, ranks in by_mix.items()},
    }
    out = Path(out_dir) / f"step_{variant}_{num_gpus}gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(run, indent=1))
    print(f"wrote {out}", flush=True)
    return out


def summarize_mix(ranks: list[list[dict]]) -> dict:
    """Per timed step: phase = max over ranks; GPUs = every rank's; then medians."""
    steps = []
    for i, row in enumerate(ranks[0]):
        if row["is_warmup"]:
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
                "gpus": [g for r in rows for g in r["gpus"]],
                "bad_lengths": sum(r["bad_lengths"] for r in rows),
                "num_completions": sum(r["num_completions"] for r in rows),
                "response_tokens": sum(r["response_tokens"] for r in rows),
                "judge_prompt_tokens": sum(r["judge_prompt_tokens"] for r in rows),
                "num_unparsable": sum(r["num_unparsable"] for r in rows),
                # partial colocation: judge calls, and how many joined a running decode loop
                "judge_batches": sum(r.get("judge_batches", 0) for r in rows),
                "judge_joined_calls": sum(r.get("judge_joined_calls", 0) for r in rows),
                "max_reserved_gib": [r["max_reserved_gib"] for r in rows],
            }
        )
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
    return {
        "median": {
            "step_s": med(s["step_s"] for s in steps),
            # TRL saves no checkpoint in its steps: the like-for-like yatt step leaves ours out.
            "step_without_ckpt_s": med(s["step_s"] - s["phases"].get("ckpt", 0.0) for s in steps),
            "phases": {k: med(s["phases"][k] for s in steps) for k in steps[0]["phases"]},
            "switch_s": med(s["switch_s"] for s in steps),
            "gpus": gpus,
        },
        "steps": steps,
        "all_lengths_forced": all(s["bad_lengths"] == 0 for s in steps),
    }


def load_runs(results_dir: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(results_dir.glob("step_*gpu.json")):
        run = json.loads(path.read_text())
        run["file"] = path.name
        runs.append(run)
    return runs


def _find(runs, layout: str, num_gpus: int) -> dict | None:
    for run in runs:
        if run["layout"] == layout and run["num_gpus"] == num_gpus:
            return run
    return None


def _median(run: dict | None, mix: str) -> dict | None:
    if run is None or mix not in run.get("mixes", {}):
        return None
    return run["mixes"][mix]["median"]


def _rollout_genrm(med: dict) -> float:
    p = med["phases"]
    return p.get("rollout+genrm", p.get("rollout", 0.0) + p.get("genrm", 0.0))


def _ratio(name: str, num: float | None, den: float | None, bar: float, what: str) -> dict:
    if num is None or den is None or den <= 0:
        return {"name": name, "what": what, "bar": bar, "value": None, "pass": None}
    value = num / den
    return {"name": name, "what": what, "bar": bar, "value": value, "pass": value <= bar}


def _suffixes(runs: list[dict], layout: str) -> list[str]:
    """The variant suffixes ("", "-auto", "-p64", ...) present for `layout`, "" first."""
    found = {r["layout"][len(layout) :] for r in runs if r["layout"].split("-")[0] == layout}
    return ["", *sorted(found - {""})]


def compute_ratios(runs: list[dict]) -> list[dict]:
    out = []
    for suffix in _suffixes(runs, "full"):
        a_run, c_run = _find(runs, "full" + suffix, 2), _find(runs, "dedicated" + suffix, 2)
        if suffix and not (a_run and c_run):
            continue
        for mix in ("fixed", "longtail"):
            a, c = _median(a_run, mix), _median(c_run, mix)
            if suffix and not (a and c):
                continue
            out.append(
                _ratio(
                    f"full{suffix}_vs_dedicated{suffix}_2gpu_{mix}",
                    a and a["step_s"],
                    c and c["step_s"],
                    0.55,
                    f"{label_of('full' + suffix)} step / (c) step, 2 GPUs, {mix}",
                )
            )
    for n in (1, 2):
        for b_suffix in _suffixes(runs, "partial"):
            for a_suffix in ("", "-auto"):
                a = _median(_find(runs, "full" + a_suffix, n), "longtail")
                b = _median(_find(runs, "partial" + b_suffix, n), "longtail")
                if (a_suffix or b_suffix) and not (a and b):
                    continue
                out.append(
                    _ratio(
                        f"partial{b_suffix}_vs_full{a_suffix}_rollout_genrm_{n}gpu_longtail",
                        b and _rollout_genrm(b),
                        a and _rollout_genrm(a),
                        0.75,
                        f"{label_of('partial' + b_suffix)} rollout+genrm / "
                        f"{label_of('full' + a_suffix)} rollout+genrm, {n} GPU(s), longtail",
                    )
                )
    out += _engine_ratios(runs)
    trl = _median(_find(runs, "trl", 1), "fixed")
    others = {r["layout"] for r in runs if r["num_gpus"] == 1} - {"full", "partial", "trl"}
    yatt = ["full", "partial", *sorted(others)]
    for variant in yatt:
        y = _median(_find(runs, variant, 1), "fixed")
        what = f"yatt {label_of(variant)} step / TRL GRPOTrainer step, 1 GPU, fixed 256 tokens"
        out.append(
            _ratio(
                f"yatt_{variant}_vs_trl_1gpu_fixed",
                y and y["step_s"],
                trl and trl["step_s"],
                0.5,
                what,
            )
        )
        if y and "step_without_ckpt_s" in y:
            out.append(
                _ratio(
                    f"yatt_{variant}_without_ckpt_vs_trl_1gpu_fixed",
                    y["step_without_ckpt_s"],
                    trl and trl["step_s"],
                    0.5,
                    what + " (yatt without its per-step checkpoint; TRL saves none)",
                )
            )
    return out


def _engine_ratios(runs: list[dict]) -> list[dict]:
    """yatt's built-in engine against vLLM/SGLang as the rollout backend, same layout, GPU count
    and mix: step time and rollout time. Bar 1.0: the built-in engine stays the default only
    where it is no slower."""
    out = []
    for run in runs:
        layout, _, engine = run["layout"].partition("-")
        if engine not in ENGINE_NAMES:
            continue
        builtin = _find(runs, layout, run["num_gpus"])
        for mix in run.get("mixes", {}):
            mine, theirs = _median(builtin, mix), _median(run, mix)
            where = f"{LABELS[layout]}, {run['num_gpus']} GPU(s), {mix}"
            for what, value_of in (("step", lambda m: m["step_s"]), ("rollout", _rollout_phase)):
                out.append(
                    _ratio(
                        f"builtin_vs_{engine}_{what}_{layout}_{run['num_gpus']}gpu_{mix}",
                        mine and value_of(mine),
                        theirs and value_of(theirs),
                        1.0,
                        f"built-in engine {what} / {ENGINE_NAMES[engine]} {what}, {where}",
                    )
                )
    return out


def _rollout_phase(med: dict) -> float:
    """The rollout's own time: partial colocation times rollout and judge together."""
    return med["phases"].get("rollout", med["phases"].get("rollout+genrm", 0.0))


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(runs: list[dict], ratios: list[dict], device: str) -> str:
    lines = [
        f"# GRPO step by placement on {device}",
        "",
        "`bash bench/step_gpu.sh` (bench/step.py, bench/step_trl.py): medians of the timed steps "
        "(after warm-up); phase times are the slowest rank's; busy = mean NVML utilization "
        "over the step; peak = NVML used memory.",
        "",
        "| layout | GPUs | mix | step s | "
        + " | ".join(PHASES)
        + " | genrm tail | switches s | busy per GPU | peak GiB per GPU | lengths forced |",
        "|---|---:|---|---:|" + "---:|" * len(PHASES) + "---:|---:|---|---|---|",
    ]
    for run in sorted(runs, key=lambda r: (r["num_gpus"], r["layout"])):
        for mix, res in run["mixes"].items():
            med = res["median"]
            phases = [_fmt(med["phases"].get(p)) if p in med["phases"] else "" for p in PHASES]
            busy = ", ".join(_fmt(g["busy"]) for g in med.get("gpus", []))
            peak = ", ".join(_fmt(g["peak_used_gib"], ".1f") for g in med.get("gpus", []))
            lines.append(
                f"| {run['label']} | {run['num_gpus']} | {mix} | {_fmt(med['step_s'])} | "
                + " | ".join(phases)
                + f" | {_fmt(med['phases'].get('genrm_tail'))} | {_fmt(med.get('switch_s'))}"
                + f" | {busy or 'n/a'} | {peak or 'n/a'} | {res.get('all_lengths_forced')} |"
            )
    lines += ["", "## Bars", "", "| ratio | value | bar | result |", "|---|---:|---:|---|"]
    for r in ratios:
        verdict = "not measured" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        lines.append(f"| {r['what']} | {_fmt(r['value'], '.3f')} | <= {r['bar']} | {verdict} |")
    notes = [run["note"] for run in runs if run.get("note")]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    mixes = [m for m in ("fixed", "longtail") if any(m in r["mixes"] for r in runs)]
    fig, axes = plt.subplots(1, len(mixes), figsize=(6 * len(mixes), 4.5), squeeze=False)
    for ax, mix in zip(axes[0], mixes, strict=True):
        bars = [
            r for r in sorted(runs, key=lambda r: (r["num_gpus"], r["layout"])) if mix in r["mixes"]
        ]
        names = [f"{r['layout']}\n{r['num_gpus']} GPU" for r in bars]
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
        ax.set_title(f"{mix} lengths")
        ax.set_ylabel("median step time (s)")
        ax.tick_params(axis="x", labelsize=8)
    labels = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labels.setdefault(label, handle)
    # Above the panels: inside them the legend hides the tallest bars.
    fig.legend(labels.values(), labels.keys(), loc="upper center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(results_dir: Path, device: str | None = None) -> dict[str, Any]:
    runs = load_runs(results_dir)
    if not runs:
        raise ValueError(f"no step_*gpu.json runs in {results_dir}; run bench/step.py first")
    device = device or runs[0]["device"]
    ratios = compute_ratios(runs)
    combined = {"device": device, "runs": runs, "ratios": ratios}
    stem = results_dir / f"step_{device}"
    stem.with_suffix(".json").write_text(json.dumps(combined, indent=1))
    stem.with_suffix(".md").write_text(markdown(runs, ratios, device))
    png = plot(runs, stem.with_suffix(".png"))
    print(markdown(runs, ratios, device), flush=True)
    print(f"wrote {stem}.json, {stem}.md" + (f", {png}" if png else ""), flush=True)
    return combined
