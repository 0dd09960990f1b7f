"""bench/step/step.py --report: the ratios with their bars from the per-run JSONs, whatever the runs
are named, and the guard that refuses ratios taken from runs that shared a host at once.

Bars (a ratio passes when value <= bar), each named by what it divides:
  full_vs_dedicated   (a) step / (c) step, 2 GPUs, per mix                          <= 0.55
                      8 GPUs: (a) / (c) 6 policy + 2 judge GPUs                     <= 0.5
                              (a) / (c') 4 + 4                                  reported
  partial_vs_full     (b) rollout+genrm / (a) rollout+genrm, longtail, 1 and 2 GPUs <= 0.80
                      (and at every other GPU count with a full or partial run: 8)
  train_scaling       train phase on 2 GPUs / on 1 GPU, same layout, longtail      <= 0.6
  yatt_vs_trl         yatt step / TRL GRPOTrainer step, 1 GPU, fixed 256 tokens     <= 0.3
  builtin_vs_engine   built-in engine / vLLM or SGLang, step and rollout time       <= 1.0
  seed_* (the seed mix, DAPO dynamic sampling; rollout+GenRM time per kept group, 1 GPU and
  any other GPU count run):
    partial_vs_full     (b) new sampler, stream + abort / (a) new sampler, rounds        <= 0.75
    full_new_vs_old     (a) new sampler / (a) the round-based sampler before ("-old")    <= 0.80
    partial_new_vs_old  (b) new sampler / (b) the round-based sampler before             <= 0.65
    A run of the new sampler with --fill-probability q ("-fill<q>") gets its own rows in
    each: against the runs without it (the same settings otherwise) and against those with the
    same q.

A run is named by its variant (_step_setup.variant_key): the base layout, then what differs
from the defaults ("full-auto-defer", "partial-vllm", "dedicated-p64", "dedicated-6+2-1.5b").
Every bar pairs runs by base layout and GPU count, like for like: the same settings on both
sides (a dedicated run's GPU split "6+2" and server count "s2" are its layout, not settings;
partial against full may also differ in the offload setting, the seed's comparison next to the
like-for-like one; the engine ratios differ only in the engine). Each pair gets its own row, naming both variants; a bar with
no pair at all gets one "not measured" row.

Values are ratios of medians over the timed steps; each row also carries both sides' median,
min and max. Trust: every run records its wall-clock interval and host (started_at, ended_at,
host). A ratio that uses a run whose interval overlapped another run's on the same host is
REFUSED (its value is kept, it passes nothing); a run without an interval (older JSONs) leaves
the ratio flagged "overlap unchecked"; runs from different hosts are flagged too (one device
call each: their machines may differ).
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

BARS = {
    "full_vs_dedicated": 0.55,  # 2 GPUs; 8 GPUs: FULL_VS_DEDICATED_8GPU
    "partial_vs_full": 0.80,
    "train_scaling": 0.6,
    "yatt_vs_trl": 0.3,
    "builtin_vs_engine": 1.0,
    # the seed mix (DAPO dynamic sampling): rollout+GenRM time per kept group
    "seed_partial_vs_full": 0.75,
    "seed_full_new_vs_old": 0.80,
    "seed_partial_new_vs_old": 0.65,
}

# full_vs_dedicated on 8 GPUs: (c) = 6 policy + 2 judge GPUs, with its bar; (c') = 4 + 4, reported.
FULL_VS_DEDICATED_8GPU: dict[str, float | None] = {"6+2": 0.5, "4+4": None}

LABELS = {
    "full": "(a) full colocation",
    "partial": "(b) partial colocation",
    "dedicated": "(c) dedicated GenRM GPU",
    "separate": "(c) 1 GPU: judge + policy resident, fixed shares (nothing to dedicate)",
    "trl": "(d) TRL GRPOTrainer",
}
ENGINE_NAMES = {"vllm": "vLLM 0.26.0", "sglang": "SGLang 0.5.17"}
# Order of the layouts in the tables and in the rows of a bar.
_LAYOUT_ORDER = ("full", "partial", "dedicated", "separate", "trl")


_GPU_SPLIT = re.compile(r"^(\d+)\+(\d+)$")  # dedicated: policy GPUs + judge GPUs
_SERVERS = re.compile(r"^s(\d+)$")  # dedicated: judge servers, when more than judge GPUs
_SHAPE = re.compile(r"^(j?)(\d+(?:\.\d+)?b)$")  # --shape, --judge-shape


# -- variants -----------------------------------------------------------------------------------
def split_variant(variant: str) -> tuple[str, frozenset[str]]:
    """("full", {"auto", "defer"}) for "full-auto-defer": the base layout and its settings."""
    base, *mods = variant.split("-")
    return base, frozenset(mods)


def settings_of(variant: str) -> frozenset[str]:
    """The settings to match like for like: a dedicated run's GPU split ("6+2") and server
    count ("s2") are its placement, which the bars compare, not a setting."""
    _, mods = split_variant(variant)
    return frozenset(m for m in mods if not (_GPU_SPLIT.match(m) or _SERVERS.match(m)))


def gpu_split(variant: str) -> str | None:
    """ "6+2" for "dedicated-6+2-1.5b"; None where the name has none (the 2-GPU "dedicated":
    1 + 1)."""
    return next((m for m in variant.split("-")[1:] if _GPU_SPLIT.match(m)), None)


def label_of(variant: str) -> str:
    """`(a) full colocation, offload when short of memory, 64 prompts` for "full-auto-p64"."""
    layout, *rest = variant.split("-")
    parts = [LABELS.get(layout, layout)]
    for part in rest:
        if part == "auto":
            parts.append("offload only when short of memory")
        elif part in ENGINE_NAMES:
            parts.append(f"{ENGINE_NAMES[part]} as the rollout engine")
        elif part == "old":
            parts.append("round-based sampler drawing only the missing groups")
        elif part == "keep":
            parts.append("cut groups resumed next step")
        elif part.startswith("fill") and part[4:]:
            parts.append(f"fill probability {part[4:]}")
        elif part.startswith("jw") and part[2:]:
            parts.append(f"judge batch window {part[2:]} ms")
        elif part.startswith("nv") and part[2:]:
            parts.append(f"{part[2:]} of groups without reward variance")
        elif part == "defer":
            parts.append("a save finding the writer busy waits for a later step")
        elif part.startswith("pr") and part[2:].isdigit():
            parts.append(f"{part[2:]} prompts per GPU")
        elif part.startswith("p") and part[1:].isdigit():
            parts.append(f"{part[1:]} prompts")
        elif m := _GPU_SPLIT.match(part):
            parts.append(f"{m[1]} policy GPUs + {m[2]} judge GPUs")
        elif m := _SERVERS.match(part):
            parts.append(f"{m[1]} judge servers")
        elif m := _SHAPE.match(part):
            size = m[2].upper()
            parts.append(f"{'judge ' if m[1] else ''}Qwen2.5-{size} shape")
        else:
            parts.append(part)
    return ", ".join(parts)


def run_key(run: dict) -> str:
    """ "full-auto/1gpu": a run's name in the ratios and the notes."""
    return f"{run['layout']}/{run['num_gpus']}gpu"


def run_order(run: dict) -> tuple:
    base, mods = split_variant(run["layout"])
    rank = _LAYOUT_ORDER.index(base) if base in _LAYOUT_ORDER else len(_LAYOUT_ORDER)
    return (rank, len(mods), run["layout"], run["num_gpus"])


def _runs_of(runs: list[dict], base: str, num_gpus: int | None = None) -> list[dict]:
    found = [
        r
        for r in runs
        if split_variant(r["layout"])[0] == base and num_gpus in (None, r["num_gpus"])
    ]
    return sorted(found, key=run_order)


# -- per-step statistics ------------------------------------------------------------------------
@dataclass(frozen=True)
class Stat:
    """Median, min and max of one metric over a run's timed steps (n of them). A run that kept
    only its medians gives n=0 and no min/max."""

    median: float
    min: float | None
    max: float | None
    n: int


Metric = Callable[[dict], float | None]


def phase_metric(name: str) -> Metric:
    """One phase's time in a step (None where the step has no such phase)."""
    return lambda s: s.get("phases", {}).get(name)


def step_time(s: dict) -> float | None:
    return s.get("step_s")


def step_without_ckpt(s: dict) -> float | None:
    """TRL saves no checkpoint in its steps: the like-for-like yatt step leaves ours out."""
    if "ckpt" not in s.get("phases", {}):
        return None
    return s["step_s"] - s["phases"]["ckpt"]


def rollout_genrm(s: dict) -> float | None:
    p = s.get("phases", {})
    if "rollout+genrm" in p:
        return p["rollout+genrm"]
    if "rollout" in p or "genrm" in p:
        return p.get("rollout", 0.0) + p.get("genrm", 0.0)
    return None


def rollout_only(s: dict) -> float | None:
    """The rollout's own time: partial colocation times rollout and judge together."""
    p = s.get("phases", {})
    return p.get("rollout", p.get("rollout+genrm"))


def sampling_metric(name: str) -> Metric:
    """One of the seed mix's dynamic-sampling stats (over all ranks) in a step."""
    return lambda s: s.get("sampling", {}).get(name)


def _per_kept_group(metric: Metric) -> Metric:
    def per_group(s: dict) -> float | None:
        value, kept = metric(s), s.get("sampling", {}).get("num_groups_kept")
        return None if value is None or not kept else value / kept

    return per_group


# The seed mix's bars: time per group kept (over all ranks), so a sampler that keeps fewer
# groups (an unfilled batch) is not faster for it.
rollout_genrm_per_kept_group = _per_kept_group(rollout_genrm)
step_per_kept_group = _per_kept_group(step_time)


METRICS: dict[str, Metric] = {
    "step": step_time,
    "step_without_ckpt": step_without_ckpt,
    "rollout+genrm": rollout_genrm,
    "rollout": rollout_only,
    "train": phase_metric("train"),
}


def stat(run: dict | None, mix: str, metric: Metric) -> Stat | None:
    """`metric` over the timed steps of `run`'s `mix` (None where the run lacks it)."""
    if run is None or mix not in run.get("mixes", {}):
        return None
    result = run["mixes"][mix]
    values = [v for v in (metric(s) for s in result.get("steps", [])) if v is not None]
    if values:
        return Stat(statistics.median(values), min(values), max(values), len(values))
    value = metric(result.get("median", {}))  # medians only (an older or a partial record)
    return None if value is None else Stat(value, None, None, 0)


# -- the guard ----------------------------------------------------------------------------------
def overlaps(runs: list[dict]) -> dict[str, list[str]]:
    """run_key -> the runs on the same host whose wall-clock interval overlapped its own."""
    out: dict[str, list[str]] = {}
    for a, b in itertools.combinations(runs, 2):
        if not (_interval(a) and _interval(b)) or a.get("host") != b.get("host"):
            continue
        (a0, a1), (b0, b1) = _interval(a), _interval(b)
        if a0 < b1 and b0 < a1:
            out.setdefault(run_key(a), []).append(run_key(b))
            out.setdefault(run_key(b), []).append(run_key(a))
    return out


def _interval(run: dict) -> tuple[float, float] | None:
    if run.get("started_at") is None or run.get("ended_at") is None:
        return None
    return run["started_at"], run["ended_at"]


def apply_guard(ratios: list[dict], runs: list[dict]) -> list[dict]:
    """Set each ratio's verdict: REFUSED where a run of it overlapped another run on its host,
    flagged where that cannot be checked or its runs ran on different hosts."""
    by_key = {run_key(r): r for r in runs}
    concurrent = overlaps(runs)
    for ratio in ratios:
        used = [by_key[k] for k in ratio.get("runs", []) if k in by_key]
        flags = []
        refused = [
            f"{k} overlapped {', '.join(concurrent[k])}" for k in ratio["runs"] if k in concurrent
        ]
        unchecked = [run_key(r) for r in used if _interval(r) is None]
        if unchecked:
            flags.append(f"overlap unchecked: {', '.join(unchecked)} recorded no interval")
        hosts = {r.get("host") for r in used if r.get("host")}
        if len(hosts) > 1:
            flags.append("runs on different hosts")
        ratio["flags"] = flags
        if ratio["value"] is None:
            ratio["verdict"] = "not measured"
        elif refused:
            ratio["pass"] = None
            ratio["verdict"] = "REFUSED: " + "; ".join(refused) + " on the same host"
        elif ratio["bar"] is None:
            ratio["verdict"] = "reported (no bar)"
        else:
            ratio["verdict"] = "PASS" if ratio["pass"] else "FAIL"
        if flags and ratio["value"] is not None:
            ratio["verdict"] += " (" + "; ".join(flags) + ")"
    return ratios


# -- the ratios ---------------------------------------------------------------------------------
def _ratio(
    name: str, what: str, bar: float | None, num: Stat | None, den: Stat | None, runs: list[dict]
) -> dict:
    value = None
    if num is not None and den is not None and den.median > 0:
        value = num.median / den.median
    return {
        "name": name,
        "what": what,
        "bar": bar,  # None: a ratio reported without a bar
        "value": value,
        "pass": None if value is None or bar is None else value <= bar,
        "runs": [run_key(r) for r in runs],
        "num": num and asdict(num),
        "den": den and asdict(den),
    }


def _unmeasured(name: str, what: str, bar: float | None) -> dict:
    return _ratio(name, what, bar, None, None, [])


def compute_ratios(runs: list[dict]) -> list[dict]:
    out = []
    out += _full_vs_dedicated(runs)
    out += _partial_vs_full(runs)
    out += _train_scaling(runs)
    out += _yatt_vs_trl(runs)
    out += _engine_ratios(runs)
    out += _sampling_per_kept_group(runs)
    return apply_guard(out, runs)


def _gpu_counts(runs: list[dict], bases: tuple[str, ...], always: tuple[int, ...]) -> list[int]:
    """`always`, and every GPU count at which a run of one of `bases` exists."""
    found = {r["num_gpus"] for r in runs if split_variant(r["layout"])[0] in bases}
    return sorted(set(always) | found)


def _full_vs_dedicated_bar(num_gpus: int, split: str | None) -> float | None:
    if num_gpus == 8:
        return FULL_VS_DEDICATED_8GPU.get(split)
    return BARS["full_vs_dedicated"] if num_gpus == 2 else None


def _full_vs_dedicated(runs: list[dict]) -> list[dict]:
    """(a) step / (c) step on as many GPUs, per mix: 2 GPUs (1 policy + 1 judge GPU), 8 GPUs
    ((c) 6+2 and (c') 4+4, each its own row), any other count found."""
    out = []
    # A dedicated judge needs a GPU besides the policy's: 2 GPUs at least.
    for n in [n for n in _gpu_counts(runs, ("full", "dedicated"), always=(2,)) if n >= 2]:
        pairs = [
            (a, c)
            for a in _runs_of(runs, "full", n)
            for c in _runs_of(runs, "dedicated", n)
            if settings_of(a["layout"]) == settings_of(c["layout"])
        ]
        # The placements the bar compares, each with its row even when unmeasured.
        expected = list(FULL_VS_DEDICATED_8GPU) if n == 8 else [None]
        for mix in ("fixed", "longtail"):
            rows, covered = [], set()
            for a, c in pairs:
                num, den = stat(a, mix, step_time), stat(c, mix, step_time)
                if num and den:
                    split = gpu_split(c["layout"])
                    covered.add(split)
                    what = (
                        f"{label_of(a['layout'])} step / {label_of(c['layout'])} step, "
                        f"{n} GPUs, {mix}"
                    )
                    name = f"{a['layout']}_vs_{c['layout']}_{n}gpu_{mix}"
                    bar = _full_vs_dedicated_bar(n, split)
                    rows.append(_ratio(name, what, bar, num, den, [a, c]))
            for split in expected:
                if split in covered or (split is None and rows):
                    continue
                layout = "dedicated" + (f"-{split}" if split else "")
                what = f"(a) full colocation step / {label_of(layout)} step, {n} GPUs, {mix}"
                name = f"full_vs_{layout}_{n}gpu_{mix}"
                rows.append(_unmeasured(name, what, _full_vs_dedicated_bar(n, split)))
            out += rows
    return out


def _partial_vs_full(runs: list[dict]) -> list[dict]:
    """Like for like, except that the offload setting may differ (the seed offloaded at every
    switch; Plan(offload="auto") leaves full colocation no switch cost for (b) to save)."""
    bar, out = BARS["partial_vs_full"], []
    for n in _gpu_counts(runs, ("full", "partial"), always=(1, 2)):
        rows = []
        for b in _runs_of(runs, "partial", n):
            for a in _runs_of(runs, "full", n):
                if split_variant(b["layout"])[1] - {"auto"} != split_variant(a["layout"])[1] - {
                    "auto"
                }:
                    continue
                num = stat(b, "longtail", rollout_genrm)
                den = stat(a, "longtail", rollout_genrm)
                if num and den:
                    what = (
                        f"{label_of(b['layout'])} rollout+genrm / {label_of(a['layout'])} "
                        f"rollout+genrm, {n} GPU(s), longtail"
                    )
                    name = f"{b['layout']}_vs_{a['layout']}_rollout_genrm_{n}gpu_longtail"
                    rows.append(_ratio(name, what, bar, num, den, [b, a]))
        what = f"(b) rollout+genrm / (a) rollout+genrm, {n} GPU(s), longtail"
        name = f"partial_vs_full_rollout_genrm_{n}gpu_longtail"
        out += rows or [_unmeasured(name, what, bar)]
    return out


def _train_scaling(runs: list[dict]) -> list[dict]:
    """The train phase of one variant on 2 GPUs (DP, balanced) against the same on 1 GPU."""
    bar, out = BARS["train_scaling"], []
    train = METRICS["train"]
    for base in ("full", "partial"):
        for two in _runs_of(runs, base, 2):
            one = next((r for r in _runs_of(runs, base, 1) if r["layout"] == two["layout"]), None)
            num, den = stat(two, "longtail", train), stat(one, "longtail", train)
            if num and den:
                what = f"{label_of(two['layout'])}: train phase on 2 GPUs / on 1 GPU, longtail"
                name = f"train_{two['layout']}_2gpu_vs_1gpu_longtail"
                out.append(_ratio(name, what, bar, num, den, [two, one]))
    what = "(a) full colocation: train phase on 2 GPUs / on 1 GPU, longtail"
    return out or [_unmeasured("train_full_2gpu_vs_1gpu_longtail", what, bar)]


def _yatt_vs_trl(runs: list[dict]) -> list[dict]:
    bar, out = BARS["yatt_vs_trl"], []
    trl = next(iter(_runs_of(runs, "trl", 1)), None)
    den = stat(trl, "fixed", step_time)
    yatt = [r for r in runs if r["num_gpus"] == 1 and split_variant(r["layout"])[0] != "trl"]
    for run in sorted(yatt, key=run_order):
        variant = run["layout"]
        num = stat(run, "fixed", step_time)
        if num is None:
            continue
        what = f"yatt {label_of(variant)} step / TRL GRPOTrainer step, 1 GPU, fixed 256 tokens"
        name = f"yatt_{variant}_vs_trl_1gpu_fixed"
        out.append(_ratio(name, what, bar, num, den, [run, trl] if trl else [run]))
        bare = stat(run, "fixed", step_without_ckpt)
        if bare is not None:
            what += " (yatt without its per-step checkpoint; TRL saves none)"
            name = f"yatt_{variant}_without_ckpt_vs_trl_1gpu_fixed"
            out.append(_ratio(name, what, bar, bare, den, [run, trl] if trl else [run]))
    what = "yatt (a) full colocation step / TRL GRPOTrainer step, 1 GPU, fixed 256 tokens"
    return out or [_unmeasured("yatt_full_vs_trl_1gpu_fixed", what, bar)]


def _engine_ratios(runs: list[dict]) -> list[dict]:
    """yatt's built-in engine against vLLM/SGLang as the rollout backend, same layout, other
    settings, GPU count and mix: step time and rollout time. Bar 1.0: the built-in engine
    stays the default only where it is no slower."""
    bar, out = BARS["builtin_vs_engine"], []
    for run in sorted(runs, key=run_order):
        base, mods = split_variant(run["layout"])
        for engine in sorted(mods & ENGINE_NAMES.keys()):
            builtin = next(
                (
                    r
                    for r in _runs_of(runs, base, run["num_gpus"])
                    if split_variant(r["layout"])[1] == mods - {engine}
                ),
                None,
            )
            name_of = builtin["layout"] if builtin else run["layout"].replace(f"-{engine}", "")
            n = run["num_gpus"]
            for mix in run.get("mixes", {}):
                where = f"{label_of(name_of)}, {n} GPU(s), {mix}"
                for what in ("step", "rollout"):
                    metric = METRICS[what]
                    out.append(
                        _ratio(
                            f"builtin_vs_{engine}_{what}_{name_of}_{n}gpu_{mix}",
                            f"built-in engine {what} / {ENGINE_NAMES[engine]} {what}, {where}",
                            bar,
                            stat(builtin, mix, metric),
                            stat(run, mix, metric),
                            [builtin, run] if builtin else [run],
                        )
                    )
    return out


def _tuning_markers(settings: frozenset[str]) -> frozenset[str]:
    """{"fill0.9"} for a run of the seed mix with --fill-probability 0.9, {"jw200"} with
    --judge-batch-window-ms 200 (both: the new sampler's tuning); empty without."""
    return frozenset(
        m for m in settings if (m.startswith("fill") and m[4:]) or (m.startswith("jw") and m[2:])
    )


def _new_matches(num: frozenset[str], den: frozenset[str], num_only: frozenset[str]) -> bool:
    """A seed bar's like-for-like rule: the new-sampler side (num) may add `num_only` and a
    fill probability or judge window; the other side has none or the same ones."""
    num_tuned, den_tuned = _tuning_markers(num), _tuning_markers(den)
    if den_tuned and den_tuned != num_tuned:
        return False
    return num - num_only - num_tuned == den - den_tuned


def _sampling_per_kept_group(runs: list[dict]) -> list[dict]:
    """Dynamic sampling's three bars on the seed mix (rollout+GenRM time per kept group), per
    GPU count, like for like except the sampler ("-old") and, on the new sampler's side,
    resuming cut groups ("-keep") and a fill probability ("-fill<q>"): each its own row."""
    metric, out = rollout_genrm_per_kept_group, []

    def seeded(base: str, n: int, old: bool) -> list[dict]:
        return [
            r
            for r in _runs_of(runs, base, n)
            if "seed" in r.get("mixes", {}) and ("old" in settings_of(r["layout"])) == old
        ]

    def pair(name: str, bar: float, num_runs: list, den_runs: list, match) -> list[dict]:
        rows = []
        for num_run in num_runs:
            for den_run in den_runs:
                if not match(settings_of(num_run["layout"]), settings_of(den_run["layout"])):
                    continue
                num, den = stat(num_run, "seed", metric), stat(den_run, "seed", metric)
                if num and den:
                    what = (
                        f"{label_of(num_run['layout'])} / {label_of(den_run['layout'])}: "
                        f"rollout+GenRM s per kept group, {n} GPU(s), seed mix"
                    )
                    key = f"{num_run['layout']}_vs_{den_run['layout']}_{n}gpu_seed"
                    rows.append(_ratio(key, what, bar, num, den, [num_run, den_run]))
        return rows

    for n in _gpu_counts(runs, ("full", "partial"), always=(1,)):
        specs = (
            (
                "seed_partial_vs_full",
                "(b) stream + abort / (a) rounds, new sampler",
                seeded("partial", n, False),
                seeded("full", n, False),
                lambda b, a: _new_matches(b, a, frozenset({"keep"})),
            ),
            (
                "seed_full_new_vs_old",
                "(a) new sampler / (a) round-based sampler before",
                seeded("full", n, False),
                seeded("full", n, True),
                lambda new, old: _new_matches(new | {"old"}, old, frozenset()),
            ),
            (
                "seed_partial_new_vs_old",
                "(b) new sampler / (b) round-based sampler before",
                seeded("partial", n, False),
                seeded("partial", n, True),
                lambda new, old: _new_matches(new | {"old"}, old, frozenset({"keep"})),
            ),
        )
        for name, what, nums, dens, match in specs:
            bar = BARS[name]
            rows = pair(name, bar, nums, dens, match)
            what = f"{what}: rollout+GenRM s per kept group, {n} GPU(s), seed mix"
            out += rows or [_unmeasured(f"{name}_{n}gpu", what, bar)]
    return out
