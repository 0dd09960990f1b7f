"""bench/step.py on CPU: tiny models, every layout's JSON, forced lengths and the report's ratios."""

NUM_GPUS = 0

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _step_report
import _step_setup

PHASES = {
    "full": {"rollout", "genrm", "train", "sync", "ckpt"},
    "partial": {"rollout+genrm", "genrm_tail", "train", "sync", "ckpt"},
    "dedicated": {"rollout", "genrm", "train", "sync", "ckpt"},
}


def _run_step(out_dir: Path, model_dir: Path, layout: str, mixes: str, *extra: str) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "step.py"), "--layout", layout, "--tiny"]
    cmd += ["--steps", "1", "--warmup", "1", "--mix", mixes, "--out-dir", str(out_dir)]
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
        "full": _run_step(out, models, "full", "fixed,longtail"),
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
    for mix, result in run["mixes"].items():
        (step,) = result["steps"]  # one timed step after one warm-up
        assert set(step["phases"]) == PHASES[run["base_layout"]]
        assert step["step_s"] > 0 and all(v >= 0 for v in step["phases"].values())
        assert step["step_s"] >= max(step["phases"].values())
        # Timed step index 1 (after the warm-up): every response has exactly its forced length.
        expected = _step_setup.response_lengths(mix, work, 1)
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
    assert ratio["value"] == pytest.approx(expected)
    assert ratio["pass"] == (expected <= 0.75)
    assert ratios["full_vs_dedicated_2gpu_longtail"]["value"] is None  # no 2-rank full run
    assert ratios["yatt_full_vs_trl_1gpu_fixed"]["pass"] is None
    md = (out / "step_cpu.md").read_text()
    assert "(b) partial colocation" in md and "not measured" in md


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


def _fake_run(variant: str, num_gpus: int, step_s: float, phases: dict) -> dict:
    median = {"step_s": step_s, "phases": phases}
    return {"layout": variant, "num_gpus": num_gpus, "mixes": {"longtail": {"median": median}}}


def test_variants_are_named_and_get_their_own_ratio_rows():
    args = type("Args", (), {"offload": "auto", "prompts": 64})()
    assert _step_setup.variant_key("full", args) == "full-auto-p64"
    args.ckpt_when_busy = "defer"
    assert _step_setup.variant_key("full", args) == "full-auto-p64-defer"
    assert _step_report.label_of("full-defer").endswith("waits for a later step")
    assert _step_report.label_of("full-auto-p64") == (
        "(a) full colocation, offload only when short of memory, 64 prompts"
    )
    runs = [
        _fake_run("full", 1, 10.0, {"rollout": 4.0, "genrm": 2.0}),
        _fake_run("full-auto", 1, 8.0, {"rollout": 3.0, "genrm": 1.0}),
        _fake_run("partial-auto", 1, 7.0, {"rollout+genrm": 3.0}),
        _fake_run("full-p64", 2, 6.0, {}),
        _fake_run("dedicated-p64", 2, 10.0, {}),
    ]
    ratios = {r["name"]: r for r in _step_report.compute_ratios(runs)}
    # The seed's comparison (offload every switch) and the like-for-like one, side by side.
    assert ratios["partial-auto_vs_full_rollout_genrm_1gpu_longtail"]["value"] == 0.5
    assert ratios["partial-auto_vs_full-auto_rollout_genrm_1gpu_longtail"]["value"] == 0.75
    assert ratios["full-p64_vs_dedicated-p64_2gpu_longtail"]["value"] == 0.6
    # The bars' own rows stay, unmeasured; absent variant pairs get no row.
    assert ratios["full_vs_dedicated_2gpu_longtail"]["value"] is None
    assert "full-auto_vs_dedicated-auto_2gpu_longtail" not in ratios
    assert ratios["yatt_full-auto_vs_trl_1gpu_fixed"]["value"] is None
    # Against TRL, whose steps save no checkpoint, a second row leaves yatt's checkpoint out.
    fixed = {"step_s": 5.0, "step_without_ckpt_s": 4.0, "phases": {"ckpt": 1.0}}
    runs[1]["mixes"]["fixed"] = {"median": fixed}
    trl = {"step_s": 10.0, "phases": {}}
    runs.append({"layout": "trl", "num_gpus": 1, "mixes": {"fixed": {"median": trl}}})
    ratios = {r["name"]: r for r in _step_report.compute_ratios(runs)}
    assert ratios["yatt_full-auto_vs_trl_1gpu_fixed"]["value"] == 0.5
    assert ratios["yatt_full-auto_without_ckpt_vs_trl_1gpu_fixed"]["value"] == 0.4
