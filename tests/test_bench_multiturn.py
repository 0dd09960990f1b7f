"""bench/rollout/multiturn_kv.py on CPU: the smoke run (a tiny random model in the built-in
engine, 4 turns in both modes), the requests each mode sends, and the argument errors."""

NUM_GPUS = 0

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "rollout" / "multiturn_kv.py"
sys.path.insert(0, str(SCRIPT.parent))
import multiturn_kv


def test_smoke_run_keeps_sessions_only_in_kept_mode(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--out-dir", str(tmp_path)]
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
    text = (tmp_path / "multiturn_kv_cpu_smoke.md").read_text()
    assert "SMOKE" in text and "commit:" in text and "| tiny |" in text


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
