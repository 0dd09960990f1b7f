"""bench/step.py on CPU: tiny models, every layout's JSON, forced lengths and the report's ratios."""

NUM_GPUS = 0

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _step_bars
import _step_report
import _step_setup
import step as step_cli

PHASES = {
    "full": {"rollout", "genrm", "train", "sync", "ckpt"},
    "partial": {"rollout+genrm", "genrm_tail", "train", "sync", "ckpt"},
    "dedicated": {"rollout", "genrm", "train", "sync", "ckpt"},
}


def _run_step(
    out_dir: Path, model_dir: Path, layout: str, mixes: str, *extra: str, steps: int = 1
) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "step.py"), "--layout", layout, "--tiny"]
    cmd += ["--steps", str(steps), "--warmup", "1", "--mix", mixes, "--out-dir", str(out_dir)]
    cmd += ["--model-dir", str(model_dir), "--ckpt-dir", str(out_dir / "ckpt"), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    num_gpus = 2 if "--judge-gpu" in extra else 1
    variant = layout + "".join(f"-{x}" for x in ("auto", "defer") if x in extra)
    return json.loads((out_dir / f"step_{variant}_{num_gpus}gpu.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("step-runs")
    models = tmp_path_factory.mktemp("step-models")
    return out, {
        "full": _run_step(out, models, "full", "fixed,longtail", steps=2),
        "partial": _run_step(out, models, "partial", "fixed,longtail", "--profile"),
        # The judge in its own process (the dedicated GPU's stand-in on CPU), over HTTP.
        "dedicated": _run_step(out, models, "dedicated", "longtail", "--judge-gpu", "1"),
        # On CPU offload="auto" has no memory reading and runs as "always"; a run of its own,
        # which also saves through the checkpoint writer process, deferring when it is busy.
        "full-auto-defer": _run_step(
            out,
            models,
            "full",
            "fixed",
            "--offload",
            "auto",
            "--ckpt-writer",
            "process",
            "--ckpt-when-busy",
            "defer",
        ),
    }


@pytest.mark.parametrize("layout", ["full", "partial", "dedicated", "full-auto-defer"])
def test_run_json_has_phases_and_forced_lengths(runs, layout):
    _, by_layout = runs
    run = by_layout[layout]
    work = _step_setup.Workload(num_prompts=4, group_size=4)
    assert run["layout"] == layout and run["tiny"] is True
    is_variant = layout == "full-auto-defer"
    assert run["workload"]["offload"] == ("auto" if is_variant else "always")
    assert run["workload"]["ckpt_writer"] == ("process" if is_variant else "thread")
    assert run["workload"]["ckpt_when_busy"] == ("defer" if is_variant else "wait")
    assert run["workload"]["ckpt_deferred"] >= 0
    # The run's wall-clock interval and host: the report's guard against concurrent runs.
    assert run["started_at"] < run["ended_at"] and run["host"]
    for mix, result in run["mixes"].items():
        num_timed = 2 if layout == "full" else 1
        assert len(result["steps"]) == result["num_timed"] == num_timed
        assert len(result["warmup_step_s"]) == 1
        times = [s["step_s"] for s in result["steps"]]
        assert result["min"]["step_s"] == min(times) and result["max"]["step_s"] == max(times)
        assert result["first_over_median"] == pytest.approx(times[0] / result["median"]["step_s"])
        step = result["steps"][-1]  # timed step index `warmup + num_timed - 1`
        assert set(step["phases"]) == PHASES[run["base_layout"]]
        assert step["step_s"] > 0 and all(v >= 0 for v in step["phases"].values())
        assert step["step_s"] >= max(step["phases"].values())
        # The last timed step: every response has exactly its forced length.
        expected = _step_setup.response_lengths(mix, work, num_timed)
        assert step["response_tokens"] == sum(expected)
        assert step["num_completions"] == work.num_samples
        assert result["all_lengths_forced"] is True
        assert step["judge_prompt_tokens"] > step["response_tokens"]  # judge reads them all
        if run["base_layout"] == "partial":  # streamed batches, later ones joining the first
            assert step["judge_batches"] >= 1
            assert step["judge_joined_calls"] < step["judge_batches"]


def test_report_computes_the_ratios(runs):
    out, by_layout = runs
    combined = _step_report.write_report(out, device="cpu")
    ratios = {r["name"]: r for r in combined["ratios"]}
    full = by_layout["full"]["mixes"]["longtail"]["median"]["phases"]
    partial = by_layout["partial"]["mixes"]["longtail"]["median"]["phases"]
    expected = partial["rollout+genrm"] / (full["rollout"] + full["genrm"])
    ratio = ratios["partial_vs_full_rollout_genrm_1gpu_longtail"]
    assert ratio["value"] == pytest.approx(expected)  # one timed step: medians are the values
    assert ratio["pass"] == (expected <= 0.80)
    assert ratio["runs"] == ["partial/1gpu", "full/1gpu"]
    # The runs ran one after another: nothing refused, nothing flagged.
    assert ratio["verdict"] == ("PASS" if ratio["pass"] else "FAIL")
    assert ratios["full_vs_dedicated_2gpu_longtail"]["value"] is None  # no 2-rank full run
    assert ratios["yatt_full_vs_trl_1gpu_fixed"]["pass"] is None
    md = (out / "step_cpu.md").read_text()
    assert "(b) partial colocation" in md and "not measured" in md
    assert "REFUSED" not in md and "1st/median" in md
    # The full run's two timed steps: its step cell is "median (min-max)".
    full = by_layout["full"]["mixes"]["fixed"]
    cell = f"{full['median']['step_s']:.2f} ({full['min']['step_s']:.2f}-"
    assert cell in md


def test_defaults_time_five_steps_after_two_warmup_steps():
    args = step_cli.parse_args(["--layout", "full"])
    assert (args.steps, args.warmup) == (5, 2)


def test_longtail_mix_is_seeded_and_long_tailed():
    work = _step_setup.Workload()
    a = _step_setup.response_lengths("longtail", work, 3)
    assert a == _step_setup.response_lengths("longtail", work, 3)
    assert a != _step_setup.response_lengths("longtail", work, 4)
    assert all(64 <= n <= 192 or 512 <= n <= 1024 for n in a)
    share_long = sum(n >= 512 for n in a) / len(a)
    assert 0.03 < share_long < 0.2
    assert _step_setup.response_lengths("fixed", work, 0) == [256] * work.num_samples
    with pytest.raises(ValueError, match="mix"):
        _step_setup.response_lengths("uniform", work, 0)


def test_profile_step_is_extra_and_names_the_phases(runs):
    out, by_layout = runs
    for mix in ("fixed", "longtail"):
        # The profiled step runs after the timed ones and is not among them.
        assert len(by_layout["partial"]["mixes"][mix]["steps"]) == 1
        text = (out / f"profile_partial_1x_{mix}.txt").read_text()
        phases = text.split("\n\n")[0].splitlines()[1:]
        assert {line.split()[0] for line in phases} == PHASES["partial"] - {"genrm_tail"}


_HOURS = itertools.count()


def _fake_run(
    variant: str,
    num_gpus: int,
    step_s: float,
    phases: dict,
    mix: str = "longtail",
    *,
    interval: tuple[float, float] | None = (0.0, 1.0),
    host: str = "h",
) -> dict:
    steps = [{"step_s": step_s, "phases": phases}]
    median = {"step_s": step_s, "phases": phases}
    run = {"layout": variant, "num_gpus": num_gpus, "mixes": {mix: {"median": median}}}
    run["mixes"][mix]["steps"] = steps
    if interval is not None:  # apart by default: each fake run gets an hour of its own
        offset = 3600.0 * next(_HOURS)
        run["started_at"], run["ended_at"] = (offset + interval[0], offset + interval[1])
    run["host"] = host
    return run


def test_variants_are_named_and_get_their_own_ratio_rows():
    args = type("Args", (), {"offload": "auto", "prompts": 64})()
    assert _step_setup.variant_key("full", args) == "full-auto-p64"
    args.ckpt_when_busy = "defer"
    assert _step_setup.variant_key("full", args) == "full-auto-p64-defer"
    assert _step_bars.label_of("full-defer").endswith("waits for a later step")
    assert _step_bars.label_of("full-auto-p64") == (
        "(a) full colocation, offload only when short of memory, 64 prompts"
    )
    runs = [
        _fake_run("full", 1, 10.0, {"rollout": 4.0, "genrm": 2.0}),
        _fake_run("full-auto", 1, 8.0, {"rollout": 3.0, "genrm": 1.0}),
        _fake_run("partial-auto", 1, 7.0, {"rollout+genrm": 3.0}),
        _fake_run("full-p64", 2, 6.0, {}),
        _fake_run("dedicated-p64", 2, 10.0, {}),
    ]
    ratios = {r["name"]: r for r in _step_bars.compute_ratios(runs)}
    # The seed's comparison (offload every switch) and the like-for-like one, side by side.
    assert ratios["partial-auto_vs_full_rollout_genrm_1gpu_longtail"]["value"] == 0.5
    assert ratios["partial-auto_vs_full-auto_rollout_genrm_1gpu_longtail"]["value"] == 0.75
    # A bar's pairs are found whatever the runs are named: only the variant's row, no empty one.
    assert ratios["full-p64_vs_dedicated-p64_2gpu_longtail"]["value"] == 0.6
    assert "full_vs_dedicated_2gpu_longtail" not in ratios
    assert ratios["full_vs_dedicated_2gpu_fixed"]["verdict"] == "not measured"  # no pair at all
    assert "full-auto_vs_dedicated-auto_2gpu_longtail" not in ratios
    # Without TRL's run: a row per yatt run with a fixed mix, unmeasured.
    assert ratios["yatt_full_vs_trl_1gpu_fixed"]["value"] is None
    # Against TRL, whose steps save no checkpoint, a second row leaves yatt's checkpoint out.
    fixed = {"step_s": 5.0, "phases": {"ckpt": 1.0}}
    runs[1]["mixes"]["fixed"] = {"median": fixed, "steps": [fixed]}
    runs.append(_fake_run("trl", 1, 10.0, {}, "fixed"))
    ratios = {r["name"]: r for r in _step_bars.compute_ratios(runs)}
    assert ratios["yatt_full-auto_vs_trl_1gpu_fixed"]["value"] == 0.5
    assert ratios["yatt_full-auto_without_ckpt_vs_trl_1gpu_fixed"]["value"] == 0.4
    assert ratios["yatt_full-auto_vs_trl_1gpu_fixed"]["pass"] is False  # bar 0.3


def test_suffixed_runs_still_meet_every_bar():
    """Runs all named with a suffix (-defer, as bench/step_gpu.sh's YATT_EXTRA makes them):
    each bar is computed from them and names the variant, none left "not measured"."""
    long = {"rollout": 4.0, "genrm": 2.0, "train": 2.0}
    runs = [
        _fake_run("full-defer", 1, 10.0, long),
        _fake_run("partial-defer", 1, 9.0, {"rollout+genrm": 4.5, "train": 2.0}),
        _fake_run("full-defer", 2, 6.0, dict(long, train=1.0)),
        _fake_run("dedicated-defer", 2, 10.0, {"rollout": 4.0, "genrm": 1.0}),
        _fake_run("partial-defer", 2, 6.0, {"rollout+genrm": 3.0, "train": 1.5}),
        _fake_run("full-vllm-defer", 1, 12.5, {"rollout": 5.0, "genrm": 2.0}),
    ]
    ratios = {r["name"]: r for r in _step_bars.compute_ratios(runs)}
    assert ratios["full-defer_vs_dedicated-defer_2gpu_longtail"]["value"] == 0.6
    assert ratios["partial-defer_vs_full-defer_rollout_genrm_1gpu_longtail"]["value"] == 0.75
    assert ratios["partial-defer_vs_full-defer_rollout_genrm_1gpu_longtail"]["pass"] is True
    assert ratios["partial-defer_vs_full-defer_rollout_genrm_2gpu_longtail"]["value"] == 0.5
    assert ratios["train_full-defer_2gpu_vs_1gpu_longtail"]["value"] == 0.5
    assert ratios["train_partial-defer_2gpu_vs_1gpu_longtail"]["value"] == 0.75
    assert ratios["builtin_vs_vllm_step_full-defer_1gpu_longtail"]["value"] == 0.8
    assert ratios["builtin_vs_vllm_rollout_full-defer_1gpu_longtail"]["value"] == 0.8
    row = ratios["full-defer_vs_dedicated-defer_2gpu_longtail"]
    assert "a save finding the writer busy waits" in row["what"]
    assert row["verdict"] == "FAIL" and row["runs"] == ["full-defer/2gpu", "dedicated-defer/2gpu"]
    # The runs hold the longtail mix only: every longtail row has its value.
    assert all(r["value"] is not None for r in ratios.values() if r["name"].endswith("longtail"))


def test_ratios_from_runs_that_overlapped_on_one_host_are_refused():
    long = {"rollout": 4.0, "genrm": 2.0}
    full = _fake_run("full", 1, 10.0, long, interval=(0.0, 100.0))
    partial = _fake_run("partial", 1, 9.0, {"rollout+genrm": 4.5}, interval=(50.0, 150.0))
    full["started_at"], full["ended_at"] = 0.0, 100.0
    partial["started_at"], partial["ended_at"] = 50.0, 150.0
    ratios = {r["name"]: r for r in _step_bars.compute_ratios([full, partial])}
    row = ratios["partial_vs_full_rollout_genrm_1gpu_longtail"]
    assert row["value"] == 0.75 and row["pass"] is None  # the value is kept, it passes nothing
    assert row["verdict"].startswith("REFUSED: partial/1gpu overlapped full/1gpu")
    # One after another on the host: no refusal.
    partial["started_at"], partial["ended_at"] = 100.0, 200.0
    ratios = {r["name"]: r for r in _step_bars.compute_ratios([full, partial])}
    assert ratios["partial_vs_full_rollout_genrm_1gpu_longtail"]["verdict"] == "PASS"
    # At once on two hosts (two device calls): not refused, but flagged.
    partial["started_at"], partial["host"] = 50.0, "other"
    ratios = {r["name"]: r for r in _step_bars.compute_ratios([full, partial])}
    assert ratios["partial_vs_full_rollout_genrm_1gpu_longtail"]["verdict"] == (
        "PASS (runs on different hosts)"
    )
    # A run that recorded no interval (an older JSON, TRL's): the check is flagged undone.
    del partial["started_at"]
    partial["host"] = "h"
    ratios = {r["name"]: r for r in _step_bars.compute_ratios([full, partial])}
    assert (
        "overlap unchecked: partial/1gpu"
        in ratios["partial_vs_full_rollout_genrm_1gpu_longtail"]["verdict"]
    )


def test_markdown_shows_spread_outliers_and_refusals(tmp_path):
    full = _fake_run("full", 1, 10.0, {"rollout": 4.0, "genrm": 2.0})
    full["label"] = "(a) full colocation"
    times = [20.0, 10.0, 9.0, 11.0, 10.5]  # the first timed step twice the median
    full["mixes"]["longtail"]["steps"] = [
        {"step_s": t, "phases": {"rollout": t / 2, "genrm": 2.0}} for t in times
    ]
    partial = _fake_run("partial", 1, 9.0, {"rollout+genrm": 4.5})
    partial["label"] = "(b) partial colocation"
    partial["started_at"], partial["ended_at"] = full["started_at"], full["ended_at"]
    ratios = _step_bars.compute_ratios([full, partial])
    md = _step_report.markdown([full, partial], ratios, "cpu")
    assert "| 5 | 10.50 (9.00-20.00) | 5.25 (4.50-10.00) | 2.00 (2.00-2.00) |" in md
    assert "1.90 (outlier)" in md and "full/1gpu longtail: first timed step 1.90x" in md
    assert "full/1gpu ran while partial/1gpu ran on the same host" in md
    assert "REFUSED: partial/1gpu overlapped full/1gpu" in md
    # Steps of unequal work (the longtail mix: lengths differ per step) are never flagged.
    for k, s in enumerate(full["mixes"]["longtail"]["steps"]):
        s["response_tokens"] = 1000 + k
    md = _step_report.markdown([full, partial], ratios, "cpu")
    assert "1.90 |" in md and "(outlier)" not in md
