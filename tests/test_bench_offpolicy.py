"""bench/train/offpolicy_gpu.py's --smoke on CPU: the trainer at rollout.max_staleness 0, 1, 2
on the embedded task, each its own process, the report's numbers read from their metrics."""

NUM_GPUS = 0

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "train"))
import offpolicy_gpu


def test_smoke_runs_every_bound_and_reports_ages_within_it(tmp_path, embedded_task):
    # The session's embedded task where the bench builds its own (OUT/work/build/embedded):
    # its `num_steps=0` then finds the task built, as a second run in one out_dir does, and
    # skips the minute the same build (same code, same seed) takes. Copied: runs only read it.
    shutil.copytree(embedded_task["prompts"].parent, tmp_path / "work" / "build" / "embedded")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(ROOT / "bench" / "train" / "offpolicy_gpu.py"), "--smoke"]
    cmd += ["--steps", "3", "--warmup", "0", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "offpolicy_cpu_smoke.json").read_text())
    assert (tmp_path / "offpolicy_cpu_smoke.md").read_text().startswith("# Off-policy steps")
    for s in (0, 1, 2):
        run = results["runs"][str(s)]
        assert run["rc"] == 0 and run["num_steps"] == 3, run
        assert run["tokens_over_bound"] == 0
        assert len(run["reward_curve"]) == 3
        assert run["gpu_busy"] is None  # no GPU: no fraction
        # JSON keys are strings: ages 0..s exactly
        assert sorted(int(a) for a in run["tokens_by_age"]) == list(range(s + 1))
    assert sum(results["runs"]["0"]["tokens_by_age"].values()) == 0  # s = 0 logs no ages
    assert results["runs"]["1"]["tokens_by_age"]["1"] > 0  # s = 1 ran ahead
    assert set(results["ratios"]) == {"step_s_s1_over_s0", "step_s_s2_over_s0"}


def test_summary_reads_step_time_ages_and_weights_from_metric_lines():
    rows = [
        {"time/train_s": 1.0, "time/rollout_wait_s": 0.5, "time/genrm_tail_s": 9.0,
         "offpolicy/tokens_age_0": 4.0, "offpolicy/tokens_age_1": 0.0,
         "offpolicy/is_weight_mean_age_0": 1.0, "offpolicy/is_weight_mean_age_1": 0.0,
         "offpolicy/take_wait_s": 0.5, "reward/mean": -0.5},
        {"time/train_s": 2.0, "time/rollout_wait_s": 0.0, "offpolicy/tokens_age_0": 1.0,
         "offpolicy/tokens_age_1": 3.0, "offpolicy/is_weight_mean_age_0": 0.5,
         "offpolicy/is_weight_mean_age_1": 1.5, "offpolicy/take_wait_s": 0.0, "reward/mean": 0.5},
    ]  # fmt: skip
    out = offpolicy_gpu.summarize(rows, 1, warmup=0)
    # genrm_tail is inside the rollout+genrm phase: not added again
    assert out["step_s_median"] == 1.75  # median of 1.5 and 2.0
    assert out["tokens_by_age"] == {0: 5.0, 1: 3.0}
    assert out["is_weight_mean_by_age"] == {0: 0.75, 1: 1.5}  # steps with tokens of that age
    assert out["reward_curve"] == [-0.5, 0.5]
    assert offpolicy_gpu.ratios({0: {"step_s_median": 2.0}, 1: {"step_s_median": 1.0}}) == {
        "step_s_s1_over_s0": 0.5
    }
