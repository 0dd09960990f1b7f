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
import _longtail_policy as longtail
import offpolicy_gpu
import pytest
import torch


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
        lengths = run["lengths"]["run"]  # the trainer's own length metrics, read back
        assert 1 <= lengths["median"] <= lengths["p90"] <= lengths["max"] <= 4  # task's cap: 4
        assert 0.0 <= lengths["at_cap"] <= 1.0
        if s == 0:  # today's on-policy step logs no ages: said, not an empty histogram
            assert run["tokens_by_age"] is None
            continue
        # JSON keys are strings: ages 0..s exactly
        assert sorted(int(a) for a in run["tokens_by_age"]) == list(range(s + 1))
    assert results["runs"]["1"]["tokens_by_age"]["1"] > 0  # s = 1 ran ahead
    assert set(results["ratios"]) == {"step_s_s1_over_s0", "step_s_s2_over_s0"}
    report = (tmp_path / "offpolicy_cpu_smoke.md").read_text()
    assert "Response lengths" in report
    assert "on-policy: all age 0" in report  # the s = 0 row


LENGTHS = [  # two steps' length metrics: median, p90, max, at-cap fraction
    {"response/length_p50": 70.0, "response/length_p90": 512.0, "response/length_max": 512.0,
     "response/truncated_frac": 0.125},
    {"response/length_p50": 80.0, "response/length_p90": 400.0, "response/length_max": 512.0,
     "response/truncated_frac": 0.0625},
]  # fmt: skip


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
    rows = [row | lengths for row, lengths in zip(rows, LENGTHS, strict=True)]
    out = offpolicy_gpu.summarize(rows, 1, warmup=0)
    # genrm_tail is inside the rollout+genrm phase: not added again
    assert out["step_s_median"] == 1.75  # median of 1.5 and 2.0
    assert out["tokens_by_age"] == {0: 5.0, 1: 3.0}
    assert out["is_weight_mean_by_age"] == {0: 0.75, 1: 1.5}  # steps with tokens of that age
    assert out["reward_curve"] == [-0.5, 0.5]
    assert offpolicy_gpu.ratios({0: {"step_s_median": 2.0}, 1: {"step_s_median": 1.0}}) == {
        "step_s_s1_over_s0": 0.5
    }
    # lengths: median of the steps' medians (70, 80) and p90s (512, 400), largest max, mean
    # at-cap fraction; the first and the last step as logged
    assert out["lengths"]["run"] == {"median": 75.0, "p90": 456.0, "max": 512.0, "at_cap": 0.09375}
    assert out["lengths"]["first"] == {"median": 70.0, "p90": 512.0, "max": 512.0, "at_cap": 0.125}
    assert out["lengths"]["last"]["p90"] == 400.0


def test_report_prints_the_lengths_asked_and_got():
    run = {"rc": 0, "num_steps": 2, "step_s_median": 1.0, "take_wait_s_median": 0.0,
           "gpu_busy": None, "tokens_by_age": {0: 1.0}, "tokens_over_bound": 0.0,
           "is_weight_mean_by_age": {}, "is_resident": None, "reward_curve": [0.0, 0.0],
           "lengths": {"run": {"median": 75.0, "p90": 456.0, "max": 512.0, "at_cap": 0.09375},
                       "first": {"median": 70.0, "p90": 512.0, "max": 512.0,
                                                "at_cap": 0.125},
                       "last": {"median": 80.0, "p90": 400.0, "max": 512.0, "at_cap": 0.0625}}}  # fmt: skip
    results = {"device": "cpu", "args": {"length_mix": "longtail"}, "runs": {0: run},
               "ratios": {}, "length_mix": longtail.LengthMix(cap=512).summary()}  # fmt: skip
    text = offpolicy_gpu.markdown(results)
    assert "| asked (longtail) | 75 / 512 / 512 / 10.3% | | |" in text
    assert "| 0 | 75 / 456 / 512 / 9.4% | 70 / 512 / 512 / 12.5% | 80 / 400 / 512 / 6.2% |" in text


def test_the_long_tail_mix_has_its_stated_quantiles():
    # Hand computation, cap 512: short hazard p = ln 2 / 64 = 0.010830, ln(1 - p) = -0.010889;
    # P(len <= n) = 0.9 (1 - (1 - p)^n) below the cap. Median: (1 - p)^n <= 4/9, n >= 74.47;
    # p80: (1 - p)^n <= 1/9, n >= 201.78; p90 would need (1 - p)^n <= 0: only the cap. At the
    # cap: 0.1 + 0.9 (1 - p)^511 = 0.1 + 0.9 e^-5.5645 = 0.10345.
    mix = longtail.LengthMix(cap=512)
    assert mix.short_hazard == pytest.approx(0.0108304, rel=1e-5)
    assert (mix.quantile(0.5), mix.quantile(0.8), mix.quantile(0.9)) == (75, 202, 512)
    assert mix.fraction_at_cap == pytest.approx(0.10345, abs=1e-5)
    assert mix.summary() == {"median": 75, "p90": 512, "max": 512, "at_cap": mix.fraction_at_cap}
    with pytest.raises(ValueError, match="--max-new-tokens=4"):
        longtail.LengthMix(cap=4)


def test_shaping_writes_the_two_channels_and_keeps_layers_off_them():
    torch.manual_seed(0)
    hidden, vocab, eos = 8, 40, 2
    state = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(hidden, hidden),
        "model.layers.0.mlp.down_proj.weight": torch.randn(hidden, 16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, hidden),
    }
    shaping = longtail.Shaping(bias=2.0, eos_gain=12.0, mode_gain=5.0)
    out = longtail.shape_state(state, eos_id=eos, num_tokenizer_ids=11, shaping=shaping)
    embed = out["model.embed_tokens.weight"]
    assert embed[:, 0].tolist() == [2.0, 2.0, 4.0] + [2.0] * (vocab - 3)  # EOS: twice the bias
    # ids 0..10 neutral, then every 10th id long (+1), the rest and EOS short (-1)
    expected = [0.0] * 11 + [1.0 if i % 10 == 0 else -1.0 for i in range(11, vocab)]
    expected[eos] = -1.0
    assert embed[:, 1].tolist() == expected
    assert torch.equal(embed[:, 2:], state["model.embed_tokens.weight"][:, 2:])
    # EOS's extra logit over any token: norm weight x bias x (2 bias - bias) = eos_gain
    assert out["model.norm.weight"][0] * 2.0 * (4.0 - 2.0) == 12.0
    assert out["model.norm.weight"][1] == 5.0
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        weight = out[f"model.layers.0.{name}.weight"]
        assert not weight[:2].any() and torch.equal(
            weight[2:], state[f"model.layers.0.{name}.weight"][2:]
        )
    assert torch.equal(
        out["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    )
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        longtail.shape_state(state | {"lm_head.weight": torch.zeros(1)}, eos_id=eos,
                             num_tokenizer_ids=11, shaping=shaping)  # fmt: skip


def test_the_gpu_run_writes_its_prompts_without_building_the_embedded_task(tmp_path, monkeypatch):
    """On a GPU the runs' data are addition prompts written by the bench ("a+b=", a and b
    digits, answer a + b): no trainer build (it would fit the embedded task's tiny models on the
    CPU first)."""
    import _step_setup

    monkeypatch.setattr(
        _step_setup, "make_models", lambda root, **_: (root / "policy", root / "judge")
    )
    args = offpolicy_gpu.parse_args(["--out-dir", str(tmp_path), "--length-mix", "cap"])
    overrides = dict(o.split("=", 1) for o in offpolicy_gpu.prepare(args))
    assert not (tmp_path / "work" / "build").exists()  # no trainer build ran
    rows = [json.loads(line) for line in Path(overrides["data.path"]).read_text().splitlines()]
    assert len(rows) == 2048 >= 100 * 16  # a 100-step run of 16 prompts never repeats one
    for row in rows:
        a, b = int(row["prompt"][0]), int(row["prompt"][2])
        assert row["prompt"] == f"{a}+{b}=" and row["answer"] == str(a + b)
    assert len({r["prompt"] for r in rows}) > 90  # most of the 100 digit pairs
    assert overrides["data.answer_key"] == "answer"
    assert overrides["policy.model_dir"].endswith("policy")
