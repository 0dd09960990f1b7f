"""bench/step/step.py on CPU: tiny models, every layout's JSON, forced lengths and the report's ratios."""

NUM_GPUS = 0

import itertools
import json
import math
import os
import resource
import socket
import subprocess
import sys
import types
from fractions import Fraction
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "step"))
import _step_bars
import _step_report
import _step_sampling
import _step_setup
import step as step_cli

PHASES = {
    "full": {"rollout", "genrm", "train", "sync", "ckpt"},
    "partial": {"rollout+genrm", "genrm_tail", "train", "sync", "ckpt"},
    "dedicated": {"rollout", "genrm", "train", "sync", "ckpt"},
}


def _run_step(
    bench, out_dir: Path, model_dir: Path, layout: str, mixes: str, *extra: str, steps: int = 1
) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "step" / "step.py"), "--layout", layout, "--tiny"]
    cmd += ["--steps", str(steps), "--warmup", "1", "--mix", mixes, "--out-dir", str(out_dir)]
    cmd += ["--model-dir", str(model_dir), "--ckpt-dir", str(out_dir / "ckpt"), *extra]
    done = bench.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    num_gpus = 2 if "--judge-gpu" in extra else 1
    variant = layout + "".join(f"-{x}" for x in ("auto", "defer") if x in extra)
    return json.loads((out_dir / f"step_{variant}_{num_gpus}gpu.json").read_text())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("step-models")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, models, step_bench):
    out = tmp_path_factory.mktemp("step-runs")
    return out, {
        "full": _run_step(step_bench, out, models, "full", "fixed,longtail", steps=2),
        "partial": _run_step(step_bench, out, models, "partial", "fixed,longtail", "--profile"),
        # The judge in its own process (the dedicated GPU's stand-in on CPU), over HTTP.
        "dedicated": _run_step(
            step_bench, out, models, "dedicated", "longtail", "--judge-gpu", "1"
        ),
        # On CPU offload="auto" has no memory reading and runs as "always"; a run of its own,
        # which also saves through the checkpoint writer process, deferring when it is busy.
        "full-auto-defer": _run_step(
            step_bench,
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
        # the sync's call alone: inside its phase, which also holds the switch and bookkeeping
        assert 0 < step["sync_call_s"] <= step["phases"]["sync"]
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
    args.compile_scope = "layers"  # the engines' compile scope, when not the default
    assert _step_setup.variant_key("full", args) == "full-auto-p64-defer-clayers"
    args.compile_scope = "step"
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
    """Runs all named with a suffix (-defer, as bench/step/step_gpu.sh's YATT_EXTRA makes them):
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


# -- the dedicated judge pool --------------------------------------------------------------------
def _free_port_pair() -> int:
    """A port p with p and p + 1 free (the pool's servers listen on --judge-port + k)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def pool_run(tmp_path_factory, models):
    """2 policy ranks (torchrun, gloo) + a judge pool of 2 servers (stand-ins for GPUs 1, 2),
    2 prompts per GPU of the run: 4 GPUs, 8 prompts a step."""
    out = tmp_path_factory.mktemp("step-pool")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master_port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(master_port), str(ROOT / "bench" / "step" / "step.py")]
    cmd += ["--layout", "dedicated", "--judge-gpus", "1,2", "--tiny", "--prompts-per-rank", "2"]
    cmd += ["--steps", "1", "--warmup", "1", "--mix", "longtail", "--out-dir", str(out)]
    cmd += ["--model-dir", str(models), "--ckpt-dir", str(out / "ckpt")]
    cmd += ["--judge-port", str(_free_port_pair())]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "step_dedicated-2+2-pr2_4gpu.json").read_text())


def test_dedicated_pool_spreads_every_rank_s_verdicts_over_every_server(pool_run):
    run = pool_run
    assert run["layout"] == "dedicated-2+2-pr2" and run["base_layout"] == "dedicated"
    assert (run["num_gpus"], run["num_ranks"], run["num_judge_gpus"]) == (4, 2, 2)
    assert (
        run["label"] == "(c) dedicated GenRM GPU, 2 policy GPUs + 2 judge GPUs, 2 prompts per GPU"
    )
    work = run["workload"]
    assert work["prompts_per_rank"] == 2 and work["num_prompts"] == 2 * 4
    assert (work["policy_shape"], work["judge_shape"]) == ("tiny", "tiny")
    pool = run["judge_pool"]
    assert [s["gpu"] for s in pool] == [1, 2]
    assert len({s["url"] for s in pool}) == 2
    samples = work["num_prompts"] * work["group_size"]  # a step's, over both ranks
    # Every server judged a share of each step (1 warm-up + 1 timed): rank 0 sent each server
    # half of its samples, and the servers together judged all of both ranks' samples.
    assert all(s["num_samples"] > 0 and s["num_prompt_tokens"] > 0 for s in pool)
    per_rank_and_server = samples // 2 // 2
    assert [s["sent_by_rank0"] for s in pool] == [2 * per_rank_and_server] * 2
    assert sum(s["num_samples"] for s in pool) == 2 * samples
    step = run["mixes"]["longtail"]["steps"][0]  # step index 1 (after the warm-up)
    assert set(step["phases"]) == PHASES["dedicated"]
    assert step["num_completions"] == samples
    work_of_run = _step_setup.Workload(num_prompts=8, group_size=4)
    assert step["response_tokens"] == sum(_step_setup.response_lengths("longtail", work_of_run, 1))
    assert run["mixes"]["longtail"]["all_lengths_forced"] is True
    # Both ranks' judge tokens of this step, each rank counting its own verdicts' (the servers'
    # totals also hold the warm-up step's).
    total = sum(s["num_prompt_tokens"] for s in pool)
    assert step["response_tokens"] < step["judge_prompt_tokens"] < total


def test_pool_options_parse_and_name_the_run():
    args = step_cli.parse_args(["--layout", "dedicated", "--judge-gpu", "1"])
    assert args.judge_gpus == [1]  # a pool of one
    args = step_cli.parse_args(["--layout", "dedicated", "--judge-gpus", "6,7", "--shape", "1.5b"])
    assert args.judge_gpus == [6, 7] and args.judge_shape is None
    assert args.model_dir.endswith("yatt-step-1.5b-1.5b")
    for bad in (
        ["--layout", "dedicated", "--judge-gpu", "1", "--judge-gpus", "1"],
        ["--layout", "full", "--judge-gpus", "1"],
        ["--layout", "full", "--prompts", "8", "--prompts-per-rank", "2"],
        ["--layout", "full", "--prompts-per-rank", "0"],
        ["--layout", "dedicated", "--judge-gpus", "a,b"],
        ["--layout", "full", "--shape", "99b"],  # no such shape
    ):
        with pytest.raises(SystemExit):
            step_cli.parse_args(bad)
    key = _step_setup.variant_key
    pool = ["--layout", "dedicated", "--judge-gpus", "6,7", "--shape", "1.5b"]
    pool = step_cli.parse_args([*pool, "--prompts-per-rank", "64"])
    assert key("dedicated", pool, num_ranks=6) == "dedicated-6+2-pr64-1.5b"
    assert key("full", step_cli.parse_args(["--layout", "full", "--shape", "1.5b"]), 8) == (
        "full-1.5b"
    )
    one = step_cli.parse_args(["--layout", "dedicated", "--judge-gpu", "1"])
    assert key("dedicated", one, num_ranks=1) == "dedicated"  # the 2-GPU runs keep their name
    shared = step_cli.parse_args(["--layout", "dedicated", "--judge-gpus", "1,1"])
    assert key("dedicated", shared, num_ranks=1) == "dedicated-s2"
    mixed = step_cli.parse_args(["--layout", "full", "--shape", "1.5b", "--judge-shape", "0.5b"])
    assert key("full", mixed) == "full-1.5b-j0.5b"
    assert _step_bars.label_of("dedicated-s2-1.5b-j0.5b") == (
        "(c) dedicated GenRM GPU, 2 judge servers, Qwen2.5-1.5B shape, judge Qwen2.5-0.5B shape"
    )


def test_prompts_per_rank_scale_with_every_gpu_of_the_run():
    args = step_cli.parse_args(["--layout", "full", "--prompts-per-rank", "64"])
    assert _step_setup.workload(args, num_gpus=8).num_prompts == 512
    assert _step_setup.workload(args, num_gpus=8).num_samples == 4096
    # 6 policy ranks share the same 512 prompts, contiguous, sizes within one of each other.
    ranges = [_step_setup.prompt_range(512, 6, r) for r in range(6)]
    assert [len(r) for r in ranges] == [85, 85, 86, 85, 85, 86]
    assert [p for r in ranges for p in r] == list(range(512))
    assert _step_setup.workload(step_cli.parse_args(["--layout", "full"])).num_prompts == 16


def test_15b_shape_is_qwen25_15b_and_is_counted_without_allocating():
    shape = _step_setup.SHAPES["1.5b"]
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]) == (
        1536,
        28,
        8960,
    )
    assert (shape["num_attention_heads"], shape["num_key_value_heads"]) == (12, 2)
    assert shape["vocab_size"] == 151936 and shape["tie_word_embeddings"] is True
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    n = _step_setup.count_parameters("1.5b")
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    assert grown_gib < 1.0  # 1.54B float32 parameters would be 5.8 GiB
    # Qwen2.5-1.5B: 1.54B parameters, 1.31B without the (tied) embedding.
    h, kv, layers = 1536, 2 * 128, 28
    layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * 8960 + 2 * h
    assert n == 151936 * h + layers * layer + h == 1_543_714_304
    assert _step_setup.count_parameters("0.5b") == 494_032_768  # Qwen2.5-0.5B: 0.49B


def _fake_8gpu_runs(suffix: str = "") -> list[dict]:
    phases = {"rollout": 6.0, "genrm": 2.0, "train": 4.0}
    return [
        _fake_run(f"full{suffix}", 8, 14.0, phases),
        _fake_run(f"partial{suffix}", 8, 12.0, {"rollout+genrm": 6.0, "train": 4.0}),
        _fake_run(f"dedicated-6+2{suffix}", 8, 30.0, {"rollout": 9.0, "genrm": 1.0}),
        _fake_run(f"dedicated-4+4{suffix}", 8, 20.0, {"rollout": 12.0, "genrm": 0.5}),
    ]


@pytest.mark.parametrize("suffix", ["", "-pr64-1.5b", "-pr64-1.5b-defer"])
def test_full_vs_dedicated_ratios_at_8gpus_whatever_the_suffixes(suffix):
    ratios = {r["name"]: r for r in _step_bars.compute_ratios(_fake_8gpu_runs(suffix))}
    a_c = ratios[f"full{suffix}_vs_dedicated-6+2{suffix}_8gpu_longtail"]
    assert a_c["value"] == pytest.approx(14.0 / 30.0) and a_c["bar"] == 0.5
    assert a_c["verdict"] == "PASS" and a_c["runs"] == [
        f"full{suffix}/8gpu",
        f"dedicated-6+2{suffix}/8gpu",
    ]
    a_c2 = ratios[f"full{suffix}_vs_dedicated-4+4{suffix}_8gpu_longtail"]
    assert a_c2["value"] == pytest.approx(14.0 / 20.0)
    assert a_c2["bar"] is None and a_c2["pass"] is None and a_c2["verdict"] == "reported (no bar)"
    b_a = ratios[f"partial{suffix}_vs_full{suffix}_rollout_genrm_8gpu_longtail"]
    assert b_a["value"] == pytest.approx(6.0 / 8.0) and b_a["bar"] == 0.80
    assert b_a["verdict"] == "PASS"
    if "1.5b" in suffix:
        assert "Qwen2.5-1.5B shape" in a_c["what"] and "64 prompts per GPU" in a_c["what"]
    assert "6 policy GPUs + 2 judge GPUs" in a_c["what"] and "8 GPUs" in a_c["what"]
    # Nothing at 8 GPUs is left unmeasured; the 2-GPU bars with no runs still get their row.
    assert all(
        r["value"] is not None for n, r in ratios.items() if "_8gpu_" in n and "longtail" in n
    )
    assert ratios["full_vs_dedicated_2gpu_longtail"]["verdict"] == "not measured"


def test_full_vs_dedicated_ratios_at_8gpus_missing_runs_and_a_failing_bar(tmp_path):
    runs = _fake_8gpu_runs()
    runs[2]["mixes"]["longtail"]["median"]["step_s"] = 20.0  # (a)/(c) = 0.7: over the bar
    runs[2]["mixes"]["longtail"]["steps"][0]["step_s"] = 20.0
    ratios = {r["name"]: r for r in _step_bars.compute_ratios(runs)}
    assert ratios["full_vs_dedicated-6+2_8gpu_longtail"]["verdict"] == "FAIL"
    # Without (c') and (b) at 8 GPUs: their rows say so.
    ratios = {r["name"]: r for r in _step_bars.compute_ratios([runs[0], runs[2]])}
    assert ratios["full_vs_dedicated-4+4_8gpu_longtail"]["verdict"] == "not measured"
    assert ratios["partial_vs_full_rollout_genrm_8gpu_longtail"]["verdict"] == "not measured"
    assert ratios["full_vs_dedicated-6+2_8gpu_fixed"]["verdict"] == "not measured"
    # A (c) of other settings is no pair for (a): like for like only.
    other = _fake_run("dedicated-6+2-auto", 8, 10.0, {"rollout": 5.0})
    ratios = {r["name"]: r for r in _step_bars.compute_ratios([runs[0], other])}
    assert ratios["full_vs_dedicated-6+2_8gpu_longtail"]["verdict"] == "not measured"
    # The report: the bars, a ratio without one, the pool's load, the plot with every layout.
    runs = _fake_8gpu_runs("-pr64-1.5b")
    for run in runs:
        run["label"] = _step_bars.label_of(run["layout"])
        run["workload"] = {"policy_shape": "1.5b", "judge_shape": "1.5b"}
    runs[2]["judge_pool"] = [{"gpu": 6, "num_samples": 10}, {"gpu": 7, "num_samples": 12}]
    ratios = _step_bars.compute_ratios(runs)
    md = _step_report.markdown(runs, ratios, "nvidia_h200")
    assert "| <= 0.5 | PASS |" in md and "| none | reported (no bar) |" in md
    assert "| 8 | 1.5b/1.5b | longtail |" in md
    assert "dedicated-6+2-pr64-1.5b/8gpu: samples judged per judge server" in md
    assert "GPU 6: 10, GPU 7: 12" in md
    png = _step_report.plot(runs, tmp_path / "bars.png")
    if png is not None:  # matplotlib installed
        assert png.stat().st_size > 10_000
    assert [_step_report._bar_name(r) for r in runs][2] == "dedicated\n6+2-pr64-1.5b\n8 GPU"


# -- the seed mix: dynamic sampling ----------------------------------------------------------
def test_seed_groups_have_the_asked_share_without_variance_and_are_the_same_everywhere():
    work = _step_setup.Workload(group_size=8, no_variance_share=0.5)
    groups = [_step_setup.seed_group(work, 3, 0, k) for k in range(2000)]
    assert groups[7] == _step_setup.seed_group(work, 3, 0, 7)  # every layout draws the same
    assert groups[7] != _step_setup.seed_group(work, 4, 0, 7)
    assert groups[7].key != _step_setup.seed_group(work, 3, 1, 7).key  # ranks differ
    share = sum(not g.has_variance for g in groups) / len(groups)
    assert 0.46 < share < 0.54  # binomial(2000, 0.5): 4.5 standard deviations
    for g in groups:
        assert len(g.labels) == len(g.lengths) == 8 and set(g.labels) <= {0, 1}
        assert all(64 <= n <= 192 or 512 <= n <= 1024 for n in g.lengths)
    # A group with variance holds both verdicts (else DAPO would drop it as well).
    assert all(len(set(g.labels)) == 2 for g in groups if g.has_variance)
    none = _step_setup.Workload(no_variance_share=0.0)
    assert all(_step_setup.seed_group(none, 0, 0, k).has_variance for k in range(200))


def test_seed_mix_defaults_and_bad_options():
    args = step_cli.parse_args(["--layout", "partial", "--mix", "seed"])
    assert (args.judge_tokens, args.judge_shape, args.sampler) == (384, "1.5b", "new")
    assert step_cli.parse_args(["--layout", "full"]).judge_tokens == 8  # the other mixes
    args = step_cli.parse_args(["--layout", "full", "--mix", "seed", "--sampler", "old"])
    assert _step_setup.variant_key("full", args) == "full-j1.5b-old"
    for bad in (
        ["--layout", "full", "--mix", "seed", "--keep-partial"],  # no stream, nothing cut
        ["--layout", "partial", "--mix", "seed", "--sampler", "old", "--keep-partial"],
        ["--layout", "partial", "--mix", "seed", "--no-variance-share", "1.0"],
    ):
        with pytest.raises(SystemExit):
            step_cli.parse_args(bad)


def test_judge_batch_window_names_the_run_and_reaches_the_judge_batching():
    args = step_cli.parse_args(
        ["--layout", "partial", "--mix", "seed", "--judge-batch-window-ms", "200"]
    )
    assert _step_setup.variant_key("partial", args) == "partial-j1.5b-jw200"
    assert _step_bars.label_of("partial-auto-j1.5b-jw200").endswith("judge batch window 200 ms")
    # a windowed partial run is compared like for like with the old partial, as -fill<q> is
    assert _step_bars._new_matches(
        frozenset({"auto", "j1.5b", "jw200"}), frozenset({"auto", "j1.5b"}), frozenset()
    )
    for bad in (
        ["--layout", "partial", "--mix", "seed", "--judge-batch-window-ms", "-1"],
        ["--layout", "dedicated", "--judge-batch-window-ms", "200"],
    ):
        with pytest.raises(SystemExit):
            step_cli.parse_args(bad)


def test_judge_batch_window_reaches_the_judges_batching_config(monkeypatch, tmp_path):
    from yatt import genrm, rollout

    made = {}
    monkeypatch.setattr(rollout, "BuiltinEngine", lambda *a, **k: "engine")
    monkeypatch.setattr(
        genrm, "GenRM", lambda engine, **k: made.setdefault("batching", k["batching"])
    )
    work = _step_setup.Workload()
    _step_setup.build_judge(
        tmp_path, device="cpu", tiny=True, work=work, slots=8, batch_window_ms=250.0
    )
    assert made.pop("batching").batch_window_millis == 250.0
    _step_setup.build_judge(tmp_path, device="cpu", tiny=True, work=work, slots=8)
    assert made["batching"].batch_window_millis == genrm.BatchingConfig().batch_window_millis


def test_fill_probability_names_the_run_and_reaches_the_sampler():
    args = step_cli.parse_args(
        ["--layout", "partial", "--mix", "seed", "--fill-probability", "0.9"]
    )
    assert _step_setup.variant_key("partial", args) == "partial-j1.5b-fill0.9"
    assert _step_bars.label_of("partial-auto-j1.5b-fill0.9") == (
        "(b) partial colocation, offload only when short of memory, judge Qwen2.5-1.5B shape, "
        "fill probability 0.9"
    )
    default = step_cli.parse_args(["--layout", "partial", "--mix", "seed"])
    assert _step_setup.variant_key("partial", default) == "partial-j1.5b"  # as before
    for bad in (
        ["--layout", "partial", "--mix", "seed", "--fill-probability", "1.0"],
        ["--layout", "partial", "--mix", "seed", "--fill-probability", "0"],
        ["--layout", "partial", "--mix", "seed", "--sampler", "old", "--fill-probability", "0.9"],
        ["--layout", "partial", "--fill-probability", "0.9"],  # no dynamic sampling
    ):
        with pytest.raises(SystemExit):
            step_cli.parse_args(bad)
    # The stream keeps in flight the fewest groups of which 16 have reward variance with
    # probability 0.9 at last step's keep rate 1/2: 1 - P(Binomial(n, 1/2) <= 15) >= 0.9.
    ctx = types.SimpleNamespace(
        prompts=[None] * 16,
        args=args,
        layout="partial",
        runtime=types.SimpleNamespace(dp_group=None),
    )
    sampler = _step_sampling.make_sampler(ctx)
    sampler.last_keep_rate = 0.5
    fill = next(
        n
        for n in range(16, 65)
        if 1 - Fraction(sum(math.comb(n, i) for i in range(16)), 2**n) >= Fraction(9, 10)
    )
    assert fill > 32  # more than the mean, 16 / 0.5
    assert (sampler.mode, sampler.num_to_draw()) == ("stream", fill)
    ctx.args = default
    assert _step_sampling.make_sampler(ctx).fill_probability is None


def test_a_fill_runs_out_of_memory_record_carries_its_suffix(tmp_path):
    """oom_<variant>.json is named like the run's JSON: a fill run's record is its own."""
    import _step_memory

    args = step_cli.parse_args(
        ["--layout", "partial", "--mix", "seed", "--fill-probability", "0.9"]
    )
    ctx = types.SimpleNamespace(
        layout="partial",
        args=args,
        runtime=types.SimpleNamespace(world_size=1),
        plan=types.SimpleNamespace(current_phase="rollout", phases=(), metrics=dict),
    )
    exc = RuntimeError("CUDA error: out of memory")
    path = _step_memory.write_oom(tmp_path, ctx, "seed", 3, exc)
    assert path.name == "oom_partial-j1.5b-fill0.9.json"
    assert json.loads(path.read_text())["layout"] == "partial-j1.5b-fill0.9"
    ctx.args = step_cli.parse_args(["--layout", "partial", "--mix", "seed"])
    assert _step_memory.write_oom(tmp_path, ctx, "seed", 3, exc).name == "oom_partial-j1.5b.json"


def _seed_run(variant: str, rollout_genrm_s: float, kept: int) -> dict:
    phases = (
        {"rollout+genrm": rollout_genrm_s}
        if variant.startswith("partial")
        else {"rollout": rollout_genrm_s / 2, "genrm": rollout_genrm_s / 2}
    )
    run = _fake_run(variant, 1, rollout_genrm_s + 1.0, phases, "seed")
    for s in run["mixes"]["seed"]["steps"]:
        s["sampling"] = {"num_groups_kept": kept}
    return run


def test_seed_bars_are_rollout_genrm_time_per_kept_group():
    runs = [
        _seed_run("full-auto", 12.0, 16),  # 0.75 s per kept group
        _seed_run("full-auto-old", 14.0, 14),  # unfilled: 1.0 s per kept group
        _seed_run("partial-auto", 6.0, 16),  # 0.375
        _seed_run("partial-auto-keep", 4.8, 16),  # 0.3
        _seed_run("partial-auto-old", 10.5, 14),  # 0.75
    ]
    ratios = {r["name"]: r for r in _step_bars.compute_ratios(runs)}
    row = ratios["partial-auto_vs_full-auto_1gpu_seed"]
    assert row["value"] == pytest.approx(0.375 / 0.75) and row["pass"] is True  # bar 0.75
    assert ratios["partial-auto-keep_vs_full-auto_1gpu_seed"]["value"] == pytest.approx(0.4)
    row = ratios["full-auto_vs_full-auto-old_1gpu_seed"]
    assert row["value"] == pytest.approx(0.75) and row["pass"] is True  # bar 0.80
    row = ratios["partial-auto_vs_partial-auto-old_1gpu_seed"]
    assert row["value"] == pytest.approx(0.5) and row["pass"] is True  # bar 0.65
    assert ratios["partial-auto-keep_vs_partial-auto-old_1gpu_seed"]["value"] == pytest.approx(0.4)
    # The old sampler is never the "new" side of a bar.
    assert "partial-auto-old_vs_full-auto-old_1gpu_seed" not in ratios
    # Without the baseline runs the two new/old bars say "not measured".
    ratios = {r["name"]: r for r in _step_bars.compute_ratios(runs[:1] + runs[2:3])}
    assert ratios["seed_full_new_vs_old_1gpu"]["verdict"] == "not measured"
    assert ratios["seed_partial_new_vs_old_1gpu"]["verdict"] == "not measured"


def test_a_fill_run_gets_its_own_seed_bar_rows():
    """Hand-made runs; each expected value is (seconds / kept groups) / (seconds / kept groups)
    of the two runs, worked out by hand."""
    runs = [
        _seed_run("full-auto", 12.0, 16),  # 12 / 16 = 0.75 s per kept group
        _seed_run("full-auto-old", 14.0, 14),  # 1.0
        _seed_run("full-auto-fill0.9", 9.6, 16),  # 0.6
        _seed_run("partial-auto", 6.0, 16),  # 0.375
        _seed_run("partial-auto-old", 10.5, 14),  # 0.75
        _seed_run("partial-auto-fill0.9", 4.5, 16),  # 0.28125
    ]
    ratios = {r["name"]: r for r in _step_bars.compute_ratios(runs)}
    expected = {
        # (b) partial new / (b) partial old <= 0.65
        "partial-auto-fill0.9_vs_partial-auto-old_1gpu_seed": (0.28125 / 0.75, 0.65),
        # (a) full new / (a) full old <= 0.8
        "full-auto-fill0.9_vs_full-auto-old_1gpu_seed": (0.6 / 1.0, 0.80),
        # (b) stream + abort / (a) rounds, new sampler <= 0.75: against (a) without a fill
        # probability and against (a) with the same one
        "partial-auto-fill0.9_vs_full-auto_1gpu_seed": (0.28125 / 0.75, 0.75),
        "partial-auto-fill0.9_vs_full-auto-fill0.9_1gpu_seed": (0.28125 / 0.6, 0.75),
    }
    for name, (value, bar) in expected.items():
        row = ratios[name]
        assert row["value"] == pytest.approx(value), name
        assert (row["bar"], row["pass"]) == (bar, value <= bar), name
        assert "fill probability 0.9" in row["what"], name
    # The runs without a fill probability keep their rows, unchanged.
    assert ratios["partial-auto_vs_partial-auto-old_1gpu_seed"]["value"] == pytest.approx(0.5)
    assert ratios["full-auto_vs_full-auto-old_1gpu_seed"]["value"] == pytest.approx(0.75)
    assert ratios["partial-auto_vs_full-auto_1gpu_seed"]["value"] == pytest.approx(0.5)
    # A run without a fill probability is not compared with one that has it.
    assert "partial-auto_vs_full-auto-fill0.9_1gpu_seed" not in ratios
    # The report's bar table shows the fill run's row with its value.
    for run in runs:
        run["label"] = _step_bars.label_of(run["layout"])
    md = _step_report.markdown(runs, list(ratios.values()), "cpu")
    (line,) = [
        line
        for line in md.splitlines()
        if line.startswith(
            "| (b) partial colocation, offload only when short of memory, "
            "fill probability 0.9 / (b) partial colocation, offload only when short of memory, "
            "round-based"
        )
    ]
    assert line.split(" | ")[1] == "0.375"


def _hand_kept_by_old_rule(work, step: int, target: int, max_rounds: int) -> tuple[int, int]:
    """DAPO's rounds without over-sampling, stated by hand: each round draws the missing
    number of groups, in order; a group is kept when its labels differ. (kept, rounds)."""
    kept = drawn = rounds = 0
    while kept < target and rounds < max_rounds:
        missing = target - kept
        rounds += 1
        for k in range(drawn, drawn + missing):
            kept += _step_setup.seed_group(work, step, 0, k).has_variance
        drawn += missing
    return min(kept, target), rounds


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory, models, step_bench):
    out = tmp_path_factory.mktemp("seed-runs")
    fast = ("--mix", "seed", "--judge-tokens", "8")
    return out, {
        # The stream: abort once full, cut groups resumed in the next step.
        "partial-keep": _seed_step(
            step_bench, out, models, "partial", *fast, "--keep-partial", steps=2
        ),
        "full-old": _seed_step(step_bench, out, models, "full", *fast, "--sampler", "old"),
        # Profiled too: its profile is named like its JSON.
        "partial-fill": _seed_step(
            step_bench, out, models, "partial", *fast, "--fill-probability", "0.9", "--profile"
        ),
    }


def _seed_step(bench, out_dir, model_dir, layout, *extra, steps=1) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "step" / "step.py"), "--layout", layout, "--tiny"]
    cmd += ["--steps", str(steps), "--warmup", "1", "--out-dir", str(out_dir)]
    cmd += ["--model-dir", str(model_dir), "--ckpt-dir", str(out_dir / "ckpt"), *extra]
    done = bench.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    variant = layout + ("-keep" if "--keep-partial" in extra else "")
    variant += "-old" if "old" in extra else ""
    if "--fill-probability" in extra:
        variant += f"-fill{float(extra[extra.index('--fill-probability') + 1]):g}"
    return json.loads((out_dir / f"step_{variant}_1gpu.json").read_text())


def test_old_sampler_keeps_what_the_rounds_rule_keeps(seed_runs):
    _, runs = seed_runs
    work = _step_setup.Workload(num_prompts=4, group_size=4)
    (step,) = runs["full-old"]["mixes"]["seed"]["steps"]  # step index 1 (after one warm-up)
    kept, rounds = _hand_kept_by_old_rule(work, 1, target=4, max_rounds=3)
    s = step["sampling"]
    assert (s["num_groups_kept"], s["num_rounds"]) == (kept, rounds)
    assert s["oversample_factor"] == 1.0 and s["num_groups_aborted"] == 0
    assert set(step["phases"]) == PHASES["full"]
    assert step["bad_lengths"] == 0  # every response its forced length


def test_stream_fills_aborts_the_tail_and_resumes_cut_groups(seed_runs):
    _, runs = seed_runs
    run = runs["partial-keep"]
    steps = run["mixes"]["seed"]["steps"]
    assert len(steps) == 2
    for s in steps:
        assert set(s["phases"]) == PHASES["partial"]
        m = s["sampling"]
        assert m["num_groups_kept"] == 4 and m["is_filled_all_ranks"] == 1.0
        # Every judged group is kept, dropped for no variance, or surplus.
        judged = m["num_groups_kept"] + m["num_groups_dropped"] + m["num_groups_surplus"]
        assert judged == m["num_groups_generated"]
        assert 0 <= m["num_tokens_aborted"] <= m["num_tokens_generated"]
        assert m["num_groups_kept_partial"] == m["num_groups_aborted"]  # all kept to resume
        assert 0.3 <= m["split_rollout_fraction"] <= 0.8  # MemorySplit's default bounds
        assert m["split_rollout_pending_tokens"] > 0 and m["split_genrm_pending_tokens"] > 0
        # Resumed responses are the old part + the continuation: still their forced length.
        assert s["bad_lengths"] == 0
        # The timeline: a kept group's last response, then the target, then the end; the judge
        # fed sample by sample joined its running decode.
        assert 0 <= m["stream_last_kept_response_s"] <= m["stream_full_s"] <= m["stream_end_s"]
        assert m["stream_judge_after_last_kept_s"] >= 0
        assert m["stream_rollout_end_s"] <= m["stream_end_s"]
        assert s["judge_batches"] > 0
    # The second timed step resumes what the first cut (at most: older ones are dropped).
    first, second = (s["sampling"] for s in steps)
    assert 0 < second["num_groups_resumed"] <= first["num_groups_kept_partial"]


def test_a_fill_probability_stream_fills_and_has_its_own_run(seed_runs):
    out, runs = seed_runs
    # Its JSON (read by _seed_step) and its profile both carry "-fill0.9".
    assert (out / "profile_partial-fill0.9_1x_seed.txt").is_file()
    assert not list(out.glob("profile_partial_1x_*"))
    (step,) = runs["partial-fill"]["mixes"]["seed"]["steps"]
    m = step["sampling"]
    assert m["num_groups_kept"] == 4 and m["is_filled_all_ranks"] == 1.0
    assert (
        m["num_groups_kept"] + m["num_groups_dropped"] + m["num_groups_surplus"]
        == (m["num_groups_generated"])
    )
    assert m["num_groups_drawn"] >= m["num_groups_generated"] + m["num_groups_aborted"]
    assert step["bad_lengths"] == 0


def test_report_has_the_seed_table_and_bars(seed_runs):
    out, _ = seed_runs
    _step_report.write_report(out, device="cpu")
    md = (out / "step_cpu.md").read_text()
    assert "## Seed mix: dynamic sampling" in md and "per kept group s" in md
    assert "cut groups resumed next step" in md  # the partial-keep row's label
    assert "round-based sampler" in md
    assert "| (b) partial colocation, fill probability 0.9 |" in md  # the fill run's own row


# -- the stream's top-ups, timeline and the run budget (the seed mix's H200 run) --------------------
def _flat_or_varied(*has_variance: bool):
    from yatt.core import Batch

    rows = [
        {"input_ids": [1, 2], "group_id": g, "reward": float(r)}
        for g, varied in enumerate(has_variance)
        for r in ((0.0, 1.0) if varied else (1.0, 1.0))
    ]
    return Batch.from_samples(rows)


def _stream_sampler(last_keep_rate: float):
    from yatt import core

    sampler = core.DynamicSampler(target_groups=16, max_oversample=4.0, mode="stream")
    sampler.last_keep_rate = last_keep_rate  # as a previous step over all ranks left it
    return sampler


def test_one_dropped_group_does_not_draw_four_times_the_missing_groups():
    sampler = _stream_sampler(0.5)
    assert sampler.num_to_draw(in_flight=0) == 32  # 16 / 0.5
    sampler.add(_flat_or_varied(False))  # the first group judged: no variance
    # Last step's 0.5 weighs as 16 groups: (0 + 8) / (1 + 16), ceil(16 * 17 / 8) - 31 = 3
    # (the step's own rate, 0/1, would make the factor 4: 16 * 4 - 31 = 33 at once).
    assert sampler.num_to_draw(in_flight=31) == 3


def test_a_lucky_start_does_not_starve_the_stream():
    sampler = _stream_sampler(0.5)
    assert sampler.num_to_draw(in_flight=0) == 32
    sampler.add(_flat_or_varied(True, True, True, True))  # 4 of 4 kept: the step's rate is 1
    # (4 + 8) / (4 + 16) = 0.6: ceil(12 / 0.6) = 20 wanted, 10 in flight: 10 more (the
    # step's own rate, 1.0, would want 12 and draw 2).
    assert sampler.num_to_draw(in_flight=10) == 10


def test_stream_stats_time_the_judge_after_the_last_kept_response():
    timeline = {"first_judged": 5.0, "last_kept_response": 6.5, "full": 11.25}
    timeline |= {"rollout_end": 11.3, "end": 11.4}
    stats = _step_sampling.stream_stats(timeline)
    assert stats["stream_judge_after_last_kept_s"] == pytest.approx(4.75)
    assert stats["stream_rollout_end_s"] == 11.3 and stats["stream_end_s"] == 11.4
    never_full = _step_sampling.stream_stats({"rollout_end": None, "end": 3.0})
    assert never_full == {"stream_end_s": 3.0}


@pytest.mark.parametrize("layout", ["full", "partial", "dedicated"])
def test_the_benchs_round_is_the_trainers_generate_and_judge(monkeypatch, layout):
    """The adapter passes the layout's overlap through (no bench-only timer: the trainer times
    its own phases), adds the phases to the step's, and hands the judge's tail back (not into
    phases: callers put it)."""
    from types import SimpleNamespace

    calls = []

    def generate_and_judge(requests, sampling, to_sample, *, timings, **kwargs):
        calls.append((requests, sampling, to_sample, kwargs))
        if kwargs["should_overlap"]:
            timings |= {"rollout+genrm": 2.0, "genrm_tail": 0.5}
        else:
            timings |= {"rollout": 2.0, "genrm": 1.0}
        return ["c"], ["v"]

    from yatt import genrm

    monkeypatch.setattr(genrm, "generate_and_judge", generate_and_judge)
    ctx = SimpleNamespace(layout=layout, engine="E", judge="J", plan="P")
    phases = {"rollout": 1.0, "rollout+genrm": 1.0}
    out = _step_sampling.generate_and_score(ctx, phases, ["r"], "s", str)
    ((requests, sampling, to_sample, kwargs),) = calls
    assert (requests, sampling, to_sample) == (["r"], "s", str)
    engine, scorer = kwargs.pop("engine"), kwargs.pop("scorer")
    assert kwargs == {"plan": "P", "should_overlap": layout == "partial"}
    if layout == "partial":  # the whole call in one profiler range
        assert (engine, scorer) == ("E", "J")
    else:  # the engine's generate and the judge's score each in their phase's range
        assert (engine.target, engine.method, engine.name) == ("E", "generate", "rollout")
        assert (scorer.target, scorer.method, scorer.name) == ("J", "score", "genrm")
    if layout == "partial":
        assert out == (["c"], ["v"], 0.5) and phases == {"rollout": 1.0, "rollout+genrm": 3.0}
    else:
        assert out == (["c"], ["v"], None)
        assert phases == {"rollout": 3.0, "rollout+genrm": 1.0, "genrm": 1.0}


def test_the_bench_runs_the_trainers_own_generate_and_judge():
    import inspect

    from yatt import genrm

    trainer = _step_sampling.trainer()
    assert trainer.__file__ == str(ROOT / "examples" / "train_grpo.py")
    assert callable(trainer.train_on_batch)
    # the trainer's round calls the library's generate_and_judge, which the bench drives too
    assert "genrm.judge_prompts(" in inspect.getsource(trainer.generate_and_score)
    assert "timer" not in inspect.signature(genrm.generate_and_judge).parameters
    for name, function in inspect.getmembers(trainer, inspect.isfunction):
        if function.__module__ == "train_grpo":  # no bench-only timer in the trainer
            assert "timer" not in inspect.signature(function).parameters, name
    # the stream is the package's: no second copy of its loop in the bench
    source = (ROOT / "bench" / "step" / "_step_sampling.py").read_text()
    assert "genrm.JudgedStream(" in source and "GroupJudging(" not in source


def test_run_budget_leaves_out_steps_that_would_end_past_it():
    warm = {"is_warmup": True, "t0": 0.0, "t1": 45.0}
    timed = {"is_warmup": False, "t0": 45.0, "t1": 65.0}  # 20 s
    assert not step_cli.past_budget(60.0, 70.0, [warm])  # no timed step yet: one runs
    assert not step_cli.past_budget(90.0, 66.0, [warm, timed])  # 66 + 20 <= 90
    assert step_cli.past_budget(85.0, 66.0, [warm, timed])
    assert not step_cli.past_budget(None, 1e6, [warm, timed])
    with pytest.raises(SystemExit):
        step_cli.parse_args(["--layout", "full", "--run-budget-s", "0"])


def test_judge_slots_size_the_colocated_judge_and_name_the_run():
    args = step_cli.parse_args(["--layout", "partial", "--mix", "seed", "--judge-slots", "320"])
    assert _step_setup.variant_key("partial", args) == "partial-j1.5b-js320"
    default = step_cli.parse_args(["--layout", "partial", "--mix", "seed"])
    assert _step_setup.variant_key("partial", default) == "partial-j1.5b"
    with pytest.raises(SystemExit):
        step_cli.parse_args(["--layout", "full", "--judge-slots", "0"])
