"""bench/step/step.py's memory timeline (bench/step/_step_memory.py) and the options of its 7B run, on CPU."""

NUM_GPUS = 0

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "step"))
import _step_memory
import _step_setup
import step as step_cli

GIB = 1 << 30


def _metrics() -> dict[str, float]:
    """What Plan.full_colocation(...).metrics() holds for a rollout and a train phase."""
    m = {}
    for phase, awake, peak in (("rollout", "rollout", 30), ("train", "train", 120)):
        m[f"placement/{phase}/peak_bytes"] = peak * GIB
        m[f"placement/{phase}/resident_bytes"] = 20 * GIB
        m[f"placement/{phase}/need_bytes"] = 0.0
        m[f"placement/{phase}/free_bytes"] = 0.0
        m[f"placement/{phase}/switch_s"] = 0.5
        for role in ("rollout", "train"):
            is_awake = role == awake
            m[f"placement/{phase}/role/{role}/resident_bytes"] = 20 * GIB if is_awake else 0.0
            m[f"placement/{phase}/role/{role}/asleep_bytes"] = 0.0 if is_awake else 15 * GIB
            m[f"placement/{phase}/role/{role}/is_awake"] = float(is_awake)
    return m


def test_timeline_reads_each_role_per_phase_from_the_plans_metrics():
    memory = _step_memory.timeline(_metrics(), ("rollout", "train"))
    assert memory["train"]["roles"]["train"] == {
        "resident_gib": 20.0,
        "asleep_gib": 0.0,
        "is_awake": True,
    }
    assert memory["train"]["roles"]["rollout"]["is_awake"] is False
    assert memory["train"]["roles"]["rollout"]["asleep_gib"] == 15.0
    assert memory["train"]["peak_gib"] == 120.0
    assert _step_memory.step_peak_gib(memory) == 120.0


def test_only_phases_that_ran_are_shown():
    # Partial colocation's plan has a genrm phase the step never enters: all zeros, every role
    # "asleep (0.0)" in the table unless left out.
    m = _metrics()
    for key in list(m):
        if key.startswith("placement/train/"):
            m[key.replace("/train/", "/genrm/", 1)] = 0.0
    m["placement/rollout/num_switches"] = m["placement/train/num_switches"] = 3.0
    m["placement/genrm/num_switches"] = 0.0
    memory = _step_memory.timeline(m, ("rollout", "genrm", "train"))
    assert list(memory) == ["rollout", "train"]
    # A result written before: the phase is there, as zeros; the report leaves it out.
    old = _step_memory.timeline(_metrics(), ("rollout", "train"))
    old["genrm"] = {
        "roles": {"rollout": {"resident_gib": 0.0, "asleep_gib": 0.0, "is_awake": False}},
        "resident_gib": 0.0,
        "peak_gib": 0.0,
        "need_gib": 0.0,
        "free_gib": 0.0,
        "switch_s": 0.0,
    }
    run = {"layout": "partial-auto", "num_gpus": 1, "mixes": {"seed": {"steps": []}}}
    run["mixes"]["seed"]["steps"] = [{"step_s": 1.0, "phases": {}, "switches": {}, "memory": old}]
    text = _step_memory.markdown([run], [])
    assert "| rollout |" in text and "| train |" in text and "| genrm |" not in text


def test_switch_share_counts_switches_and_the_sync_phase():
    # Switches 1 + 2 s (rollout, train) and the sync phase (its switch 0.5 s inside its 3 s):
    # (3 + 3) / 60 = 10% per step; the median of the steps.
    steps = [
        {
            "step_s": 60.0,
            "phases": {"sync": 3.0},
            "switches": {"rollout": 1, "train": 2, "sync": 0.5},
        },
        {
            "step_s": 60.0,
            "phases": {"sync": 9.0},
            "switches": {"rollout": 1, "train": 2, "sync": 0.5},
        },
        {
            "step_s": 30.0,
            "phases": {"sync": 0.0},
            "switches": {"rollout": 0, "train": 0, "sync": 0},
        },
    ]
    run = {"mixes": {"longtail": {"steps": steps}}}
    assert _step_memory.switch_share(run, "longtail") == pytest.approx(6 / 60)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RuntimeError("torch_memory_saver: cudaError out of memory, func=resume"), True),
        (type("OutOfMemoryError", (RuntimeError,), {})("CUDA error"), True),
        (RuntimeError("shape mismatch"), False),
    ],
)
def test_out_of_memory_is_recognised_in_every_form(error, expected):
    assert _step_memory.is_out_of_memory(error) is expected


def test_report_section_counts_ooms_and_draws_the_timeline(tmp_path):
    steps = [{"step_s": 10.0, "phases": {"sync": 0.2}, "switches": {}, "memory": None}]
    steps[0]["memory"] = _step_memory.timeline(_metrics(), ("rollout", "train"))
    run = {"layout": "full-auto-7b", "num_gpus": 1, "mixes": {"longtail": {"steps": steps}}}
    oom = {
        "layout": "partial-auto-7b",
        "mix": "longtail",
        "step": 0,
        "phase": "sync",
        "error": "OutOfMemoryError: CUDA out of memory",
    }
    text = _step_memory.markdown([run], [oom])
    assert "Out-of-memory errors: 1" in text and "partial-auto-7b longtail step 0" in text
    assert "| train | asleep (15.0) | 20.0 | 120.0 | - |" in text
    assert "switches + sync 2.0% of the step" in text
    pytest.importorskip("matplotlib")
    assert _step_memory.plot([run], tmp_path / "memory.png").stat().st_size > 0


def test_7b_and_3b_shapes_are_qwen25s_and_options_reach_the_policy():
    # Qwen2.5-3B: 3.09B parameters; Qwen2.5-7B: 7.62B (an untied 152064-row head).
    assert _step_setup.count_parameters("3b") == 3_085_938_688
    assert _step_setup.count_parameters("7b") == 7_615_616_512
    args = step_cli.parse_args(
        [
            "--layout",
            "full",
            "--shape",
            "7b",
            "--judge-shape",
            "3b",
            "--micro-batch-tokens",
            "auto",
            "--activation-checkpointing",
            "--offload-optimizer",
            "--no-ckpt",
        ]
    )
    assert _step_setup.shape_names(args) == ("7b", "3b")
    assert args.micro_batch_tokens is None and args.activation_checkpointing
    assert args.offload_optimizer and not args.ckpt
    with pytest.raises(SystemExit):
        step_cli.parse_args(["--layout", "full", "--micro-batch-tokens", "0"])
