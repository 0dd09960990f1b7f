"""bench/step/step.py's memory timeline: per phase, what each role holds on the GPU, which
roles are asleep, and the phase's peak, from the plan's metrics (plan.metrics(), which the
trainer logs every step too); a plot beside the step plot, a table, and out-of-memory records.

From the metrics of yatt.placement.Plan: placement/<phase>/role/<role>/resident_bytes (held
once the phase's roles are awake), .../is_awake, .../asleep_bytes (what it would take to wake),
placement/<phase>/peak_bytes (resident + the phase's growth in its latest run: device-wide on
CUDA), need_bytes and free_bytes (offload="auto": what the switch needed and found free).
A phase's peak is measured when the next switch starts, so the last phase of a step (sync)
shows the previous step's peak. Only phases that ran are shown: partial colocation's plan has a
genrm phase that the step never enters (rollout and GenRM run as one phase).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GIB = float(1 << 30)
ROLE_COLORS = {
    "rollout": "#4c72b0",
    "genrm": "#dd8452",
    "train": "#55a868",
    "reference": "#8172b3",
}
PEAK_COLOR = "#c44e52"


def timeline(metrics: dict[str, float], phases: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per phase: {"roles": {role: {"resident_gib", "asleep_gib", "is_awake"}}, "peak_gib",
    "resident_gib", "need_gib", "free_gib"} from a plan's metrics."""
    out: dict[str, dict[str, Any]] = {}
    for phase in phases:
        prefix = f"placement/{phase}/"
        if metrics.get(prefix + "num_switches", 1.0) == 0:  # never entered (partial's genrm)
            continue
        roles: dict[str, dict[str, Any]] = {}
        for key, value in metrics.items():
            if not key.startswith(prefix + "role/"):
                continue
            role, field = key[len(prefix + "role/") :].split("/", 1)
            entry = roles.setdefault(role, {})
            if field == "is_awake":
                entry["is_awake"] = bool(value)
            else:
                entry[field.replace("_bytes", "_gib")] = value / GIB
        out[phase] = {
            "roles": roles,
            "resident_gib": metrics.get(prefix + "resident_bytes", 0.0) / GIB,
            "peak_gib": metrics.get(prefix + "peak_bytes", 0.0) / GIB,
            "need_gib": metrics.get(prefix + "need_bytes", 0.0) / GIB,
            "free_gib": metrics.get(prefix + "free_bytes", 0.0) / GIB,
            "switch_s": metrics.get(prefix + "switch_s", 0.0),
        }
    return out


def phases_that_ran(memory: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The timeline without phases that never ran: results written before timeline() left them
    out hold them as all zeros (no role awake, nothing resident, no peak)."""
    return {
        name: phase
        for name, phase in memory.items()
        if phase["resident_gib"]
        or phase["peak_gib"]
        or any(r.get("is_awake") for r in phase["roles"].values())
    }


def step_peak_gib(memory: dict[str, dict[str, Any]]) -> float | None:
    peaks = [phase["peak_gib"] for phase in memory.values() if phase["peak_gib"]]
    return max(peaks) if peaks else None


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, or a CUDA out-of-memory from an engine (torch_memory_saver's
    resume, vLLM's cumem) that arrives as a plain RuntimeError."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return "outofmemory" in text.replace(" ", "") or "out of memory" in text


def write_oom(out_dir: str | Path, ctx: Any, mix: str, step: int, exc: BaseException) -> Path:
    """oom_<variant>.json: where the run ran out, with the plan's last timeline."""
    from _step_setup import variant_key

    variant = variant_key(ctx.layout, ctx.args, ctx.runtime.world_size)
    record = {
        "layout": variant,
        "mix": mix,
        "step": step,
        "phase": ctx.plan.current_phase,
        "error": f"{type(exc).__name__}: {exc}"[:2000],
        "traceback": traceback.format_exc()[-4000:],
        "memory": timeline(ctx.plan.metrics(), ctx.plan.phases),
        "time": time.time(),
    }
    path = Path(out_dir) / f"oom_{variant}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"out of memory at {mix} step {step}: wrote {path}", flush=True)
    return path


def load_ooms(results_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("oom_*.json"))]


def last_timeline(run: dict) -> tuple[str, dict[str, dict[str, Any]]] | None:
    """(mix, timeline) of a run's last timed step (rank 0), long-tail mix first."""
    for mix in ("longtail", "fixed", *run["mixes"]):
        steps = run["mixes"].get(mix, {}).get("steps") or []
        if steps and steps[-1].get("memory"):
            return mix, phases_that_ran(steps[-1]["memory"])
    return None


def switch_share(run: dict, mix: str) -> float | None:
    """Phase switches + weight sync, as a share of the median step (a bar of the 7B run):
    every switch except sync's, plus the sync phase (its switch and the weight transfer)."""
    steps = run["mixes"].get(mix, {}).get("steps") or []
    shares = []
    for s in steps:
        switches = s.get("switches", {})
        rest = sum(v for k, v in switches.items() if k != "sync")
        shares.append((rest + s["phases"].get("sync", 0.0)) / s["step_s"])
    if not shares:
        return None
    shares.sort()
    return shares[len(shares) // 2]


def markdown(runs: list[dict], ooms: list[dict]) -> str:
    """The memory section of the step report: a table per run, the OOM count, switch shares."""
    lines = ["", "## Memory timeline (last timed step, GiB)", ""]
    lines.append(f"Out-of-memory errors: {len(ooms)}" + (":" if ooms else "."))
    for oom in ooms:
        lines.append(
            f"- {oom['layout']} {oom['mix']} step {oom['step']} in phase "
            f"{oom['phase']!r}: {oom['error'][:200]}"
        )
    for run in runs:
        found = last_timeline(run)
        if found is None:
            continue
        mix, memory = found
        share = switch_share(run, mix)
        shown = f", switches + sync {100 * share:.1f}% of the step" if share is not None else ""
        lines += ["", f"### {run['layout']} ({run['num_gpus']} GPU, {mix}{shown})", ""]
        roles = sorted({r for phase in memory.values() for r in phase["roles"]})
        lines.append("| phase | " + " | ".join(roles) + " | peak | need / free (auto) |")
        lines.append("|---" * (len(roles) + 3) + "|")
        for name, phase in memory.items():
            cells = []
            for role in roles:
                entry = phase["roles"].get(role, {})
                if entry.get("is_awake"):
                    cells.append(f"{entry.get('resident_gib', 0.0):.1f}")
                else:
                    cells.append(f"asleep ({entry.get('asleep_gib', 0.0):.1f})")
            fit = f"{phase['need_gib']:.1f} / {phase['free_gib']:.1f}" if phase["need_gib"] else "-"
            lines.append(
                f"| {name} | " + " | ".join(cells) + f" | {phase['peak_gib']:.1f} | {fit} |"
            )
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> Path | None:
    """One panel per run: per phase, each awake role's GiB stacked, the phase's peak above
    them, and the asleep roles named under the bar."""
    shown = [(run, found) for run in runs if (found := last_timeline(run)) is not None]
    if not shown:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 4.8), squeeze=False)
    for ax, (run, (mix, memory)) in zip(axes[0], shown, strict=True):
        names = list(memory)
        bottoms = [0.0] * len(names)
        roles = sorted({r for phase in memory.values() for r in phase["roles"]})
        for role in roles:
            heights = [
                memory[p]["roles"].get(role, {}).get("resident_gib", 0.0)
                if memory[p]["roles"].get(role, {}).get("is_awake")
                else 0.0
                for p in names
            ]
            color = ROLE_COLORS.get(role, "#999999")
            ax.bar(names, heights, bottom=bottoms, color=color, label=role)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        # The rest of the phase's peak: activations, logits, caches (and what is not a role's).
        above = [max(0.0, memory[p]["peak_gib"] - b) for p, b in zip(names, bottoms, strict=True)]
        ax.bar(
            names,
            above,
            bottom=bottoms,
            color="none",
            edgecolor=PEAK_COLOR,
            hatch="//",
            label="peak above roles",
        )
        labels = []
        for p in names:
            asleep = [r for r in roles if not memory[p]["roles"].get(r, {}).get("is_awake")]
            labels.append(p + ("\nasleep:\n" + "\n".join(asleep) if asleep else ""))
        ax.set_xticks(range(len(names)), labels, fontsize=7)
        ax.set_title(f"{run['layout']} ({mix})", fontsize=9)
        ax.set_ylabel("GiB on the GPU")
    return save_with_legend_above(fig, axes[0], path, top=0.92)


def save_with_legend_above(fig: Any, axes: Sequence[Any], path: Path, *, top: float) -> Path:
    """One legend for all `axes` (each label once), above the panels (inside them it hides the
    tallest bars), the panels below `top` of the figure; saved to `path` and closed."""
    import matplotlib.pyplot as plt

    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
