"""bench/rollout/multiturn_kv.py and multiturn_judge.py on CPU: the smoke runs (tiny random
models in the built-in engine), the requests each mode sends, the workload's plan, the
markdown verdicts and the argument errors."""

NUM_GPUS = 0

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "rollout" / "multiturn_kv.py"
sys.path.insert(0, str(SCRIPT.parent))
import multiturn_judge
import multiturn_kv

JUDGE_SCRIPT = SCRIPT.parent / "multiturn_judge.py"


def test_smoke_run_keeps_sessions_only_in_kept_mode(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--profile", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "multiturn_kv_cpu_smoke.json").read_text())
    row = results["shapes"]["tiny"]
    w = results["workload"]
    assert (w["trajectories"], w["turns"]) == (4, 4)
    # kept: every trajectory's KV stays after each turn (released only after the round);
    # prefill: the engine keeps nothing.
    assert row["kept_sessions_after_turn"] == {"prefill": [0, 0, 0, 0], "kept": [4, 4, 4, 4]}
    assert row["bad_lengths"] == 0
    assert row["ratio"] == pytest.approx(row["seconds"]["kept"] / row["seconds"]["prefill"])
    for mode in multiturn_kv.MODES:
        assert len(row["turn_s_median"][mode]) == 4
        # the round's time is the sum of its turns' generate calls
        rnd = row["rounds"][mode][0]
        assert rnd["seconds"] == pytest.approx(sum(rnd["turn_s"]))
    # --profile: each mode's last turn once more, one token sampled, its forward profiled
    for mode in multiturn_kv.MODES:
        last = row["last_forward"][mode]
        assert last["seconds"] > 0 and last["wall_ms"] > 0
    text = (tmp_path / "multiturn_kv_cpu_smoke.md").read_text()
    assert "SMOKE" in text and "commit:" in text and "| tiny |" in text
    assert "| tiny | kept |" in text and "| tiny | prefill |" in text


def test_context_holds_the_last_turn():
    args = multiturn_kv.parse_args(["--smoke"])
    args.prompt_tokens, args.response_tokens, args.observation_tokens, args.turns = 256, 64, 1024, 4
    # 256 + 3 x (64 + 1024) of history, then the last turn's 64 response tokens
    assert multiturn_kv.context_tokens(args) == 256 + 3 * 1088 + 64


def test_observations_are_the_same_in_both_modes_and_differ_by_turn():
    args = multiturn_kv.parse_args(["--smoke"])
    assert multiturn_kv.observations(args, 512, 0) == multiturn_kv.observations(args, 512, 0)
    assert multiturn_kv.observations(args, 512, 0) != multiturn_kv.observations(args, 512, 1)
    assert all(len(o) == args.observation_tokens for o in multiturn_kv.observations(args, 512, 2))


def test_markdown_verdicts():
    results = {
        "commit": "abc1234",
        "device": "nvidia_h200",
        "smoke": False,
        "command": "x",
        "workload": dict(
            trajectories=64,
            turns=4,
            prompt_tokens=256,
            response_tokens=64,
            observation_tokens=1024,
            repeats=3,
            seed=0,
        ),
        "shapes": {
            "0.5b": {
                "shape": "0.5b",
                "seconds": {"prefill": 2.0, "kept": 1.0},
                "ratio": 0.5,
                "turn_s_median": {"prefill": [0.5] * 4, "kept": [0.25] * 4},
                "kept_sessions_after_turn": {"prefill": [0] * 4, "kept": [64] * 4},
            },
            "1.5b": {"shape": "1.5b", "error": "OutOfMemoryError: CUDA out of memory"},
        },
    }
    text = multiturn_kv.markdown(results)
    assert "| 0.5b | 2.000 | 1.000 | 0.500 | <= 0.6 PASS |" in text
    assert "| 1.5b | OutOfMemoryError" in text
    assert "commit: abc1234" in text


@pytest.mark.parametrize(
    ("argv", "names"),
    [(["--smoke", "--turns", "1"], "--turns 1"), (["--smoke", "--repeats", "0"], "--repeats 0")],
)
def test_bad_arguments(argv, names, capsys):
    with pytest.raises(SystemExit):
        multiturn_kv.parse_args(argv)
    assert names in capsys.readouterr().err


# -- multiturn_judge.py: rollout + judge per kept group, partial vs full colocation -----------


def test_judge_smoke_run_keeps_its_groups_in_both_modes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(JUDGE_SCRIPT), "--smoke", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "multiturn_judge_cpu_smoke.json").read_text())
    row = results["row"]
    assert "error" not in row, row
    groups = results["workload"]["groups"]
    for mode in multiturn_judge.MODES:
        (one,) = row["passes"][mode]  # --repeats 1 in smoke
        assert one["kept"] == groups  # both modes fill the batch
        assert row["seconds_per_kept_group"][mode] == pytest.approx(one["seconds"] / groups)
    assert row["ratio"] == pytest.approx(
        row["seconds_per_kept_group"]["partial"] / row["seconds_per_kept_group"]["full"]
    )
    # partial fed oversample x groups rows at once
    assert row["passes"]["partial"][0]["num_rows"] == 2 * groups
    text = (tmp_path / "multiturn_judge_cpu_smoke.md").read_text()
    assert "SMOKE" in text and "commit:" in text and "policy tiny, judge tiny" in text


def test_the_plan_has_a_long_tail_of_turns_and_is_the_same_in_both_modes():
    args = multiturn_judge.parse_args(["--smoke"])
    plans = [multiturn_judge.trajectory_plan(args, row, s) for row in range(200) for s in range(4)]
    assert plans == [
        multiturn_judge.trajectory_plan(args, row, s) for row in range(200) for s in range(4)
    ]
    turns = [t for t, _ in plans]
    assert set(turns) == {1, 2, 3, 4, 5, 6}
    # most end within 2 turns (weights 0.35 + 0.25), a few run all 6 (0.07): 800 draws
    assert 0.5 < sum(t <= 2 for t in turns) / len(turns) < 0.7
    assert 0.03 < turns.count(6) / len(turns) < 0.12
    assert {r for _, r in plans} == {0.0, 1.0}


def test_the_context_holds_the_longest_trajectory():
    args = multiturn_judge.parse_args(["--smoke"])
    args.prompt_tokens, args.response_tokens, args.observation_tokens = 256, 128, 256
    assert multiturn_judge.context_tokens(args) == 256 + 6 * 128 + 5 * 256


def test_judge_markdown_verdict():
    args = multiturn_judge.parse_args(["--smoke"])
    workload = {k: getattr(args, k) for k in vars(args) if k != "out_dir"}
    one = {"seconds": 1.0, "kept": 16, "num_rows": 19, "num_trajectories": 76}
    results = {
        "commit": "abc1234",
        "device": "nvidia_h200",
        "smoke": False,
        "command": "x",
        "workload": workload,
        "row": {
            "seconds_per_kept_group": {"full": 2.0, "partial": 1.5},
            "ratio": 0.75,
            "passes": {"full": [one], "partial": [{**one, "num_rows": 32, "num_groups_cut": 9}]},
        },
    }
    text = multiturn_judge.markdown(results)
    assert "| 2.000 | 1.500 | 0.750 | <= 0.8 PASS | 19 / 32 | 9 |" in text
    results["row"] = {"error": "OutOfMemoryError: CUDA out of memory"}
    assert "error: OutOfMemoryError" in multiturn_judge.markdown(results)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--smoke", "--samples", "1"], "--samples 1"),
        (["--smoke", "--groups", "0"], "--groups 0"),
        (["--smoke", "--tool-s", "-1"], "--tool-s -1"),
    ],
)
def test_judge_bad_arguments(argv, names, capsys):
    with pytest.raises(SystemExit):
        multiturn_judge.parse_args(argv)
    assert names in capsys.readouterr().err


def test_kept_floor_on_a_hand_counted_workload():
    """2 rows, 2 turns: prompt 4, response 2, observation 3, so the prefilled turns feed 4 and
    9 tokens a row; the kept turn 2 feeds 4 (the response's last token + the observation)
    after 5 kept positions. Rates 1 ms a token and 0.1 ms a query-key pair (n^2 / 2 a row in
    a causal prefill, new (start + new / 2) in a continuation), set through the last prefill's
    profile: 2 rows x 9 tokens x 1 ms = 18 ms outside attention, 2 x 81 / 2 x 0.1 ms = 8.1 ms."""
    args = argparse.Namespace(
        trajectories=2, turns=2, prompt_tokens=4, response_tokens=2, observation_tokens=3
    )
    profile = {"kernel_ms": 26.1, "kernel_ms_by_group": {"attention": 8.1, "gemm": 18.0}}
    got = multiturn_kv.kept_floor(args, prefill_s=0.1, prefill_profile=profile)
    # prefilled: 2 x (4 x 1 + 8 x 0.1) ms = 9.6 ms; 2 x (9 x 1 + 40.5 x 0.1) ms = 26.1 ms
    assert got["prefilled_forward_s"] == pytest.approx([0.0096, 0.0261])
    # kept turn 2: 2 x (4 x 1 + 4 x (5 + 2) x 0.1) ms = 13.6 ms
    assert got["kept_forward_s"] == pytest.approx([0.0096, 0.0136])
    # saves at most 35.7 - 23.2 = 12.5 ms of the prefilled 100 ms
    assert got["floor_s"] == pytest.approx(0.0875)
    assert got["floor_ratio"] == pytest.approx(0.875)
