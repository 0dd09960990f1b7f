"""bench/controller/controller.py --full-step on CPU at tiny size: 2 ranks of each mode, the JSON's fields,
the payload-only section kept beside it, and the CUDA path skipping cleanly without a GPU."""

NUM_GPUS = 0

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "controller" / "controller.py"
OLD_SECTION = "# Controller memory: an earlier payload-only report\n\nits table\n"


def _run(out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(BENCH), "--full-step", "--out-dir", str(out_dir), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("controller")
    # An earlier payload-only run's results: the full-step run adds its section beside them.
    (out / "controller_cpu.json").write_text(json.dumps({"results": ["old"], "passed": True}))
    (out / "controller_cpu.md").write_text(OLD_SECTION)
    _run(out, "--ranks", "2", "--prompts-per-rank", "2", "--steps", "1", "--max-new-tokens", "4")
    return out


def test_full_step_json_has_both_modes_at_two_ranks(out_dir):
    summary = json.loads((out_dir / "controller_cpu.json").read_text())
    assert summary["results"] == ["old"] and summary["passed"] is True  # untouched
    full = summary["full_step"]
    assert full["device"] == "cpu" and full["commit"]
    config = full["config"]
    assert config["prompts_per_rank"] == 2 and config["timed_steps"] == 1
    assert config["warmup_steps"] == 1 and config["group_size"] == 2
    # The processor's tensors outweigh the decoded image: the tiny VLM takes real patches.
    assert 0.5 < config["image_mib"] < config["pixel_values_mib"]
    assert [(r["mode"], r["ranks"]) for r in full["results"]] == [
        ("yatt-step", 2),
        ("driver-step", 2),
    ]
    for result in full["results"]:
        assert len(result["per_rank_peak_mib"]) == 2
        assert result["busiest_peak_mib"] == max(result["per_rank_peak_mib"])
        assert result["step_s"] > 0
        assert 0.0 <= result["reward"] <= 1.0
        assert "per_rank_gpu_peak_mib" not in result  # CPU: no GPU memory to report
        assert 0 <= result["max_moved_in_per_step"] <= 4  # of 2 prompts x 2 samples
        assert result["num_cut_responses"] >= 0
    share = config["prompts_per_rank"] * (config["image_mib"] + config["pixel_values_mib"])
    assert full["payload_share_mib"] == pytest.approx(share)
    # One rank count: no slope to judge.
    assert full["passed"] is None
    assert set(full["peak_slope_mib_per_rank"]) == {"yatt-step", "driver-step"}


def test_full_step_markdown_section_follows_the_old_report(out_dir):
    text = (out_dir / "controller_cpu.md").read_text()
    assert text.startswith(OLD_SECTION)
    assert "## Full step with a vision-language model (commit " in text
    assert "| 2 |" in text


def test_cuda_path_skips_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the CUDA path would run, not skip")
    done = _run(tmp_path, "--device", "cuda", "--ranks", "2")
    assert "skipped" in done.stdout
    assert not list(tmp_path.iterdir())  # nothing written
