"""bench/rollout/engines_overlap.py on the CPU: the overlap formula on hand-built times, its
argument errors before any model is built, and a --tiny run end to end."""

NUM_GPUS = 0

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "rollout"))
import engines_overlap as overlap
from _rollout_checks import RUN


@pytest.mark.parametrize(
    ("alone_a", "alone_b", "together", "expected"),
    [
        # sum 5, max 3: together 4 saves 1 of the 2 that perfect overlap would save.
        (2.0, 3.0, 4.0, 0.5),
        (3.0, 2.0, 4.0, 0.5),  # the order of the phases does not matter
        (2.0, 3.0, 3.0, 1.0),  # together takes the longer one's time: perfect overlap
        (2.0, 3.0, 5.0, 0.0),  # together takes the sum: none
        (2.0, 3.0, 6.0, -0.5),  # 1 s worse than one after the other, over the 2 s at stake
        (1.0, 1.0, 1.5, 0.5),  # sum 2, max 1
    ],
)
def test_overlap_from_its_definition(alone_a, alone_b, together, expected):
    assert overlap.overlap_fraction(alone_a, alone_b, together) == pytest.approx(expected)


def test_overlap_is_undefined_when_a_phase_takes_no_time():
    assert math.isnan(overlap.overlap_fraction(0.0, 3.0, 3.0))


def test_summary_of_one_round():
    row = overlap.summarize(2.0, 3.0, 4.0)
    assert row == pytest.approx(
        {"sum_s": 5.0, "max_s": 3.0, "overlap": 0.5, "together_over_sum": 0.8}
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--repeats", "0"], "--repeats=0: must be >= 1"),
        (["--judge-tokens", "0"], "--judge-tokens=0: must be >= 1"),
        (["--mix", "seed"], "--mix='seed': use one of"),
    ],
)
def test_bad_arguments_fail_before_any_model(monkeypatch, argv, says):
    def no_models(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(overlap, "make_models", no_models)
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        overlap.main(["--tiny", *argv])


def test_tiny_run_writes_the_timings_and_their_overlap(tmp_path, monkeypatch):
    monkeypatch.setattr(RUN, "device", RUN.device)  # main sets these module-wide; put them back
    monkeypatch.setattr(RUN, "smoke", RUN.smoke)
    out = tmp_path / "overlap.json"
    argv = ["--tiny", "--repeats", "2", "--out", str(out), "--model-dir", str(tmp_path / "m")]
    overlap.main(argv)
    result = json.loads(out.read_text())
    # --tiny: bench/step's tiny workload, 4 prompts x 4 samples, one judge prompt per sample.
    assert result["workload"]["policy_samples"] == 16
    assert result["workload"]["judge_samples"] == 16
    assert result["workload"]["judge_new_tokens"] == overlap.TINY_JUDGE_TOKENS
    assert result["engine_configs"]["policy"]["max_batch_size"] == 16
    assert len(result["rounds"]) == 2
    for row in [*result["rounds"], result["median"]]:
        for key in ("alone_policy_s", "alone_judge_s", "together_s", "overlap"):
            assert key in row
        a, b, both = row["alone_policy_s"], row["alone_judge_s"], row["together_s"]
        assert row["sum_s"] == pytest.approx(a + b)
        assert row["max_s"] == pytest.approx(max(a, b))
        assert row["overlap"] == pytest.approx((a + b - both) / (a + b - max(a, b)))
        assert row["together_over_sum"] == pytest.approx(both / (a + b))
        # Each engine's own end lies inside `together`.
        assert 0 < row["together_policy_done_s"] <= both
        assert 0 < row["together_judge_done_s"] <= both
    for round_row in result["rounds"]:
        assert round_row["alone_policy_busy"] is None  # no NVML on the CPU
    median = result["median"]
    times = [r["together_s"] for r in result["rounds"]]
    assert median["together_s"] == pytest.approx(sorted(times)[0] / 2 + sorted(times)[1] / 2)
    md = out.with_suffix(".md").read_text()
    assert "| median |" in md and f"overlap {median['overlap']:.2f}" in md
