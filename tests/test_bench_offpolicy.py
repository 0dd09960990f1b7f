"""bench/train/offpolicy_gpu.py's --smoke on CPU: the trainer at rollout.max_staleness 0, 1, 2
on the embedded task, each its own process, the report's numbers read from their metrics."""

NUM_GPUS = 0

import json
import math
import os
import shutil
import subprocess
import sys
import time
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
        # the last step's checkpoint was committed, then deleted for the next run's disk
        assert run["checkpoints"] == ["step-00000002"], run["checkpoints"]
        assert not (tmp_path / f"s{s}" / "checkpoints").exists()
        lengths = run["lengths"]["run"]  # the trainer's own length metrics, read back
        assert 1 <= lengths["median"] <= lengths["p90"] <= lengths["max"] <= 4  # task's cap: 4
        assert 0.0 <= lengths["at_cap"] <= 1.0
        if s == 0:  # today's on-policy step logs no ages: said, not an empty histogram
            assert run["tokens_by_age"] is None
            continue
        # JSON keys are strings: ages 0..s exactly
        assert sorted(int(a) for a in run["tokens_by_age"]) == list(range(s + 1))
    assert results["runs"]["1"]["tokens_by_age"]["1"] > 0  # s = 1 ran ahead
    assert set(results["ratios"]) == {
        "step_s_s1_over_s0", "step_s_s2_over_s0", "token_time_s1_over_s0", "token_time_s2_over_s0"
    }  # fmt: skip
    report = (tmp_path / "offpolicy_cpu_smoke.md").read_text()
    assert "Response lengths" in report
    assert "on-policy: all age 0" in report  # the s = 0 row


def test_gpu_setup_at_tiny_shapes_gets_every_verdict_read(tmp_path):
    # The GPU runs' own setup (random models, the shaped judge, its reward overrides) at
    # 2-layer shapes: the judge's verdicts all parse, so the trainer trains instead of stopping
    # at step 0 as the unshaped random judge made it (the H200 run at 8d2b377).
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(ROOT / "bench" / "train" / "offpolicy_gpu.py"), "--tiny"]
    cmd += ["--length-mix", "cap", "--staleness", "1", "--steps", "2", "--warmup", "0"]
    cmd += ["--prompts", "2", "--max-new-tokens", "8", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run = json.loads((tmp_path / "offpolicy_cpu.json").read_text())["runs"]["1"]
    assert run["rc"] == 0 and run["num_steps"] == 2, run.get("log_tail", run)
    rows = [
        json.loads(line) for line in (tmp_path / "s1" / "metrics.jsonl").read_text().splitlines()
    ]
    for row in rows:
        assert row["genrm/verdicts"] > 0
        assert row["genrm/errors"] == 0 and row["genrm/unparsable"] == 0


def test_busy_fraction_leaves_out_the_warm_up_and_survives_in_a_file(tmp_path, monkeypatch):
    # A stand-in nvidia-smi on PATH reading its utilization from a file the test changes: 10%
    # while the trainer has logged fewer than 2 steps (loading, the first step's compiles),
    # 90% after.
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\ncat {tmp_path / 'util'}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}:{os.environ['PATH']}")
    metrics, util = tmp_path / "metrics.jsonl", tmp_path / "util"
    util.write_text("10\n")
    sampler = offpolicy_gpu.BusySampler(
        tmp_path / "gpu_busy.json", metrics=metrics, warmup=2, period_s=0.02
    )
    with sampler:
        time.sleep(0.5)
        util.write_text("90\n")  # first: a sample that counted 2 steps reads 90
        metrics.write_text('{"step": 0}\n{"step": 1}\n')  # the warm-up's two steps logged
        time.sleep(0.5)
    assert {steps for _, steps in sampler.samples} == {0, 2}
    assert sampler.fraction == pytest.approx(0.9)  # the warm-up's 10% samples left out
    saved = json.loads((tmp_path / "gpu_busy.json").read_text())
    assert len(saved["samples"]) == len(sampler.samples) and saved["warmup"] == 2
    # no sample after the warm-up: every sample counts; none at all: no fraction
    assert offpolicy_gpu.busy_fraction([(0.2, 0), (0.4, 1)], warmup=5) == pytest.approx(0.3)
    assert offpolicy_gpu.busy_fraction([], warmup=0) is None


def test_earlier_report_keeps_its_runs_and_names_each_runs_commit(tmp_path, monkeypatch):
    # s = 0 from a committed report (an earlier device call), s = 1 run now at another commit.
    earlier = tmp_path / "earlier.json"
    s0 = {"rc": 1, "commit": "aaaa111"}  # a failed run: kept as it was, its cells empty
    earlier.write_text(json.dumps({"runs": {"0": s0}}))
    monkeypatch.setattr(offpolicy_gpu, "prepare", lambda args: [])
    monkeypatch.setattr(offpolicy_gpu, "device_name", lambda: "NVIDIA H200")
    monkeypatch.setenv("YATT_COMMIT", "bbbb222")
    ran = []

    def fake_run(staleness, base, args):
        ran.append(staleness)
        return {"staleness": staleness, "rc": 1, "commit": os.environ["YATT_COMMIT"]}

    monkeypatch.setattr(offpolicy_gpu, "run_one", fake_run)
    out = tmp_path / "out"
    offpolicy_gpu.main(["--out-dir", str(out), "--earlier", str(earlier), "--staleness", "1"])
    assert ran == [1]  # only the asked s ran again
    report = json.loads((out / "offpolicy_h200.json").read_text())
    assert report["runs"] == {"0": s0, "1": {"staleness": 1, "rc": 1, "commit": "bbbb222"}}
    assert "Commits: s = 0 at aaaa111, s = 1 at bbbb222." in (out / "offpolicy_h200.md").read_text()


def test_separate_placement_reaches_the_trainer_and_writes_its_own_report(tmp_path, monkeypatch):
    # --placement separate: the trainer's placement=separate (the engines on a second GPU), and
    # a report of its own beside the one-GPU runs' (which are not its baseline)
    commands = []

    def fake_trainer(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 1)  # failed: the report keeps its rc

    monkeypatch.setattr(offpolicy_gpu, "prepare", lambda args: ["policy.model_dir=p"])
    monkeypatch.setattr(offpolicy_gpu, "device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(offpolicy_gpu.subprocess, "run", fake_trainer)
    out = tmp_path / "out"
    offpolicy_gpu.main(["--out-dir", str(out), "--placement", "separate", "--staleness", "0", "1"])
    assert [c.count("placement=separate") for c in commands] == [1, 1]
    assert not any("placement=partial" in c for c in commands)
    report = json.loads((out / "offpolicy_h200_separate.json").read_text())
    assert sorted(report["runs"]) == ["0", "1"] and not (out / "offpolicy_h200.json").exists()


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
    rows[0]["train/num_loss_tokens"], rows[1]["train/num_loss_tokens"] = 300.0, 100.0
    out = offpolicy_gpu.summarize(rows, 1, warmup=0)
    # genrm_tail is inside the rollout+genrm phase: not added again
    assert out["step_s_median"] == 1.75  # median of 1.5 and 2.0
    assert (out["step_s_min"], out["step_s_max"]) == (1.5, 2.0)
    # loss tokens per second of each step: 300 / 1.5 and 100 / 2.0
    assert out["loss_tokens_per_s"] == {"median": 125.0, "min": 50.0, "max": 200.0}
    assert out["tokens_by_age"] == {0: 5.0, 1: 3.0}
    assert out["is_weight_mean_by_age"] == {0: 0.75, 1: 1.5}  # steps with tokens of that age
    assert out["reward_curve"] == [-0.5, 0.5]
    assert offpolicy_gpu.ratios({0: {"step_s_median": 2.0}, 1: {"step_s_median": 1.0}}) == {
        "step_s_s1_over_s0": 0.5
    }
    # time per token: s = 1 trains 4x the tokens per second -> a quarter of s = 0's time
    runs = {
        0: {"step_s_median": 2.0, "loss_tokens_per_s": {"median": 100.0}},
        1: {"step_s_median": 3.0, "loss_tokens_per_s": {"median": 400.0}},
    }
    assert offpolicy_gpu.ratios(runs) == {"step_s_s1_over_s0": 1.5, "token_time_s1_over_s0": 0.25}
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
    assert "One-GPU bound for s >= 1" not in text  # s = 0's busy fraction unknown: no bound
    # the reward curve in 10-step means: steps 0..9 of 0.0 and 0.2 alternating, then 1.0 alone
    run["reward_curve"] = [0.0, 0.2] * 5 + [1.0]
    text = offpolicy_gpu.markdown(results)
    assert "| s | 0-9 | 10-10 |" in text
    assert "| 0 | 0.100 | 1.000 |" in text
    run["gpu_busy"] = 0.58  # busy 58% of s = 0's step: filling the rest gives 0.58 of it
    assert "idle GPU time filled (its GPU busy fraction): 0.58 of s = 0's" in (
        offpolicy_gpu.markdown(results)
    )


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
    monkeypatch.setattr(offpolicy_gpu.verdict_judge, "shape_judge", lambda src, dst, **_: dst)
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
    assert overrides["reward.judge_dir"].endswith("judge_verdicts")  # the shaped judge
    # sampled votes read from their text: one greedy vote would give every response the same
    assert overrides["reward.votes"] == "2" and overrides["reward.verdict_from"] == "text"
    assert float(overrides["policy.lr"]) == 1e-7  # holds the length mix (the --lr help)


@pytest.fixture(scope="module")
def verdict_judge(tmp_path_factory):
    """A tiny random Qwen2 judge shaped into the verdict chain (reasoning median 8)."""
    import _verdict_judge as verdict_judge
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from yatt.testing import make_tokenizer

    root = tmp_path_factory.mktemp("judge")
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=320, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "random")
    tokenizer.save_pretrained(root / "random")
    chain = verdict_judge.VerdictChain(reasoning_median=8)
    shaped = verdict_judge.shape_judge(root / "random", root / "shaped", chain=chain)
    model = AutoModelForCausalLM.from_pretrained(shaped).eval()
    return model, AutoTokenizer.from_pretrained(shaped), chain


def _next_token_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float().softmax(-1)


def test_verdict_judge_writes_reasoning_then_yes_or_no(verdict_judge):
    model, tokenizer, chain = verdict_judge
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Question: 1+2=\nResponse: 3\nYes or No?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    one = {t: tokenizer.encode(t, add_special_tokens=False)[0] for t in "\nYesNo"}
    # the byte tokens but the chain's six: 256 - 6 reasoning tokens
    reasoning = [i for i in range(5, 5 + 256) if i not in one.values()]
    h = math.log(2) / 8  # the newline's hazard for a median of 8 reasoning tokens
    probs = _next_token_probs(model, ids)  # after "Reasoning:": the chain of thought
    assert probs[one["\n"]].item() == pytest.approx(h, rel=0.03)
    assert probs[reasoning].sum().item() == pytest.approx(1 - h, rel=0.01)
    assert probs[reasoning].max() / probs[reasoning].min() < 1.05  # uniform
    probs = _next_token_probs(model, ids + reasoning[:3])  # mid-reasoning: the same
    assert probs[one["\n"]].item() == pytest.approx(h, rel=0.03)
    probs = _next_token_probs(model, ids + reasoning[:3] + [one["\n"]])  # the verdict: a coin
    assert probs[one["Y"]].item() == pytest.approx(0.5, abs=0.01)
    assert probs[one["N"]].item() == pytest.approx(0.5, abs=0.01)
    for written, successor in (("Y", "e"), ("Ye", "s"), ("N", "o")):
        tail = [one[c] for c in written]
        probs = _next_token_probs(model, [*ids, one["\n"], *tail])
        assert probs[one[successor]].item() > 0.999
    for written in ("Yes", "No"):
        probs = _next_token_probs(model, ids + [one["\n"]] + [one[c] for c in written])
        assert probs[tokenizer.eos_token_id].item() > 0.999
    assert chain.reasoning_quantile(0.5) in (7, 8)  # geometric median ~ ln 2 / h


def test_verdict_judge_generations_parse_as_genrm_verdicts(verdict_judge):
    from yatt.genrm import YesNoParser

    model, tokenizer, _ = verdict_judge
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is 2+2=5 right?"}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)] * 64)
    torch.manual_seed(1)
    out = model.generate(
        ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=128,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    rewards = [YesNoParser().parse(text) for text in texts]
    assert None not in rewards, [t for t, r in zip(texts, rewards, strict=True) if r is None]
    assert 16 <= rewards.count(1.0) <= 48  # a coin over 64 verdicts (P(outside) < 1e-4)
    lengths = sorted(len(t.split("\n")[0].encode("latin-1", "replace")) for t in texts)
    assert 3 <= lengths[32] <= 14  # reasoning's median near 8 (characters ~ bytes here)
