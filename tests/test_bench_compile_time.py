"""bench/rollout/compile_time.py on CPU: one measurement's plumbing, and the report's rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "rollout"))
sys.path.insert(0, str(ROOT / "bench" / "_common"))
import compile_time


def test_a_layer_compiled_forward_is_measured_in_its_own_process(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(ROOT / "bench" / "rollout" / "compile_time.py")]
    cmd += ["--layers", "2", "--kinds", "layers", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "compile_time_cpu.json").read_text())
    (row,) = results["rows"]
    assert (row["model"], row["kind"]) == ("2", "layers") and "error" not in row, row
    # a first call that compiled (one graph for both layers) and a second one that did not
    assert row["unique_graphs"] == 1
    assert row["first_s"] > row["second_s"] > 0


def test_report_rows_name_the_model_and_its_decode_speed():
    results = {
        "device": "nvidia_h200",
        "commit": "abc1234",
        "command": "x",
        "decode": [64, 256],
        "rows": [
            {"model": "28", "kind": "engine", "first_s": 300.0, "second_s": 0.5,
             "unique_graphs": 2},
            {"model": "0.5b", "kind": "engine-layers", "first_s": 40.0, "second_s": 0.25,
             "unique_graphs": 3, "decode_tok_s": 12345.6},
            {"model": "0.5b", "kind": "engine", "error": "CUDA out of memory"},
        ],
    }  # fmt: skip
    text = compile_time.markdown(results)
    assert "decode: 64 rows x 256 forced tokens" in text
    assert "| 28 layers | engine | 300.0 | 0.50 | 2 |  |" in text
    assert "| 0.5b | engine-layers | 40.0 | 0.25 | 3 | 12,346 |" in text
    assert "| 0.5b | engine | error | | | |" in text
