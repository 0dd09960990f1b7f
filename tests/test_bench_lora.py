"""bench/lora/ on CPU: lora_gpu.py's smoke run (tiny shapes: full fine-tuning and LoRA through
bench/step/step.py's step loop, the LoRA sync sending only the adapter), its ratios and report
from hand-built runs; lora_cpu_gain.py's reward gain and ratios."""

NUM_GPUS = 0

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "lora"))
import lora_cpu_gain
import lora_gpu

# bench/step/_step_setup.py's TINY shape, restated: hidden 64, 2 layers, 4 heads of 16, 2 KV
# heads, MLP 128, vocabulary 512, the head tied to the embeddings (Qwen2.5-0.5B's).
HIDDEN, LAYERS, KV_OUT, MLP, VOCAB = 64, 2, 2 * 16, 128, 512


def _linears() -> list[tuple[int, int]]:
    """(in, out) of every linear layer of one tiny decoder layer (q k v o gate up down)."""
    attn = [(HIDDEN, HIDDEN), (HIDDEN, KV_OUT), (HIDDEN, KV_OUT), (HIDDEN, HIDDEN)]
    return [*attn, (HIDDEN, MLP), (HIDDEN, MLP), (MLP, HIDDEN)]


def test_smoke_run_syncs_only_the_adapter(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(ROOT / "bench" / "lora" / "lora_gpu.py"), "--smoke"]
    cmd += ["--warmup", "0", "--steps", "1", "--out-dir", str(tmp_path)]
    cmd += ["--variants", "full-7b", "lora16-7b", "lora16-7b-beside"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "lora_cpu_smoke.json").read_text())
    full, lora = results["variants"]["full-7b"], results["variants"]["lora16-7b"]
    beside = results["variants"]["lora16-7b-beside"]
    assert (full["rc"], lora["rc"], beside["rc"]) == (0, 0, 0), (full, lora, beside)
    # LoRA rank 16 on the 7 linear layers of each of 2 layers: A [16, in], B [out, 16] in
    # float32 (the tiny policy's dtype) and a 0-d float32 scaling each.
    rank = lora_gpu.LORA_RANK
    adapter_bytes = LAYERS * sum(4 * rank * (i + o) + 4 for i, o in _linears())
    for adapter, mode in ((lora, "merge"), (beside, "beside")):
        assert adapter["sync"]["num_tensors"] == LAYERS * 7 * 3
        assert adapter["sync"]["bytes"] == adapter_bytes
        assert all(".lora_" in n for n in adapter["sync"]["first_names"])
        assert adapter["sync"]["engine_lora_mode"] == mode
    assert "engine_lora_mode" not in full["sync"]  # full fine-tuning keeps the plain engine
    # beside: the trainer's sync binds the adapter's parameters once (then refreshes them)
    assert beside["sync"].get("bound") is True
    assert "bound" not in lora["sync"] and "bound" not in full["sync"]
    # Full fine-tuning sends every weight: the embeddings (the head is tied to them), 2 norms
    # per layer and the final one, the linear layers and the q/k/v biases (Qwen2).
    weights = (
        VOCAB * HIDDEN
        + HIDDEN
        + LAYERS * (2 * HIDDEN + sum(i * o for i, o in _linears()) + HIDDEN + 2 * KV_OUT)
    )
    assert full["sync"]["bytes"] == 4 * weights
    assert full["sync"]["num_syncs"] == lora["sync"]["num_syncs"] == 1
    for entry in (full, lora, beside):
        assert entry["summary"]["num_timed_steps"] == 1
        assert entry["summary"]["bad_lengths"] == 0
        assert not entry["oom"]
    assert set(results["ratios"]) == set(lora_gpu.BARS)
    assert results["ratios"]["step_s_beside"] is not None
    text = (tmp_path / "lora_cpu_smoke.md").read_text()
    assert "SMOKE" in text and "commit:" in text
    assert (
        "| weight sync, adapter beside (bound: refreshed in place) | lora16-7b-beside / full-7b |"
        in text
    )


def _run(step_s: list[float], sync: list[float], switch: list[float], peak: float) -> dict:
    steps = [
        {
            "step_s": t,
            "phases": {"rollout": t / 2, "sync": s},
            "switches": {"sync": w},
            "switch_s": w,
            "max_reserved_gib": [peak],
            "bad_lengths": 0,
        }
        for t, s, w in zip(step_s, sync, switch, strict=True)
    ]
    return {"mixes": {lora_gpu.MIX: {"steps": steps}}, "workload": {}}


def test_the_sync_is_the_sync_call_where_the_run_timed_it():
    """step.py's "sync_call_s" (the call alone) is the sync when a run has it; the sync phase
    less its switch also holds the plan's bookkeeping (hand-built: 0.5 s phase, 0.1 s switch,
    0.02 s call)."""
    run = _run([10.0], [0.5], [0.1], 50.0)
    assert lora_gpu.summarize(run)["sync_s"]["median"] == pytest.approx(0.4)
    run["mixes"][lora_gpu.MIX]["steps"][0]["sync_call_s"] = 0.02
    assert lora_gpu.summarize(run)["sync_s"]["median"] == pytest.approx(0.02)


def test_summary_and_ratios_from_hand_built_runs():
    full = lora_gpu.summarize(_run([10.0, 12.0, 30.0], [2.5, 2.0, 2.0], [0.5, 0.0, 0.0], 100.0))
    lora = lora_gpu.summarize(_run([7.0, 9.0, 8.0], [0.15, 0.1, 0.2], [0.05, 0.0, 0.1], 50.0))
    # The sync less the switch into it: full [2.0, 2.0, 2.0], LoRA [0.1, 0.1, 0.1].
    assert full["sync_s"]["median"] == pytest.approx(2.0)
    assert lora["sync_s"]["median"] == pytest.approx(0.1)
    assert (full["step_s"]["median"], full["step_s"]["min"], full["step_s"]["max"]) == (
        12.0,
        10.0,
        30.0,
    )
    # The memory pair at offload always: 40 and 90 GiB; the auto pair's own peaks (50, 100)
    # are reported but not the bar's.
    full_always = lora_gpu.summarize(_run([20.0], [2.0], [0.0], 90.0))
    lora_always = lora_gpu.summarize(_run([15.0], [0.1], [0.0], 40.0))
    results = {
        "variants": {
            "full-7b": {"summary": full},
            "lora16-7b": {"summary": lora},
            "full-7b-always": {"summary": full_always},
            "lora16-7b-always": {"summary": lora_always},
            # beside: a slower step (9.6 s median), a cheaper sync (0.01 s after its switch)
            "lora16-7b-beside": {
                "summary": lora_gpu.summarize(_run([9.6, 9.0, 10.0], [0.01] * 3, [0.0] * 3, 50.0))
            },
        }
    }
    got = lora_gpu.ratios(results)
    assert got["step_s"] == pytest.approx(8.0 / 12.0)
    assert got["peak_gib"] == pytest.approx(40.0 / 90.0)
    assert got["sync_s"] == pytest.approx(0.05)
    assert got["step_s_beside"] == pytest.approx(9.6 / 12.0)
    assert got["step_s_noac"] is None  # not run
    assert got["sync_s_beside"] == pytest.approx(0.01 / 2.0)
    results |= {"device": "nvidia_h200", "commit": "abc1234", "smoke": False}
    results |= {"warmup": 2, "steps": 3, "micro_batch_tokens": 16384, "command": "x"}
    for entry in results["variants"].values():
        entry["rc"] = 0
    results["variants"]["lora16-7b-always"] |= {"warmup": 1, "steps": 1}  # a later call's
    results["variants"]["lora16-14b"] = {"rc": 1, "oom": True, "error": "CUDA out of memory"}
    text = lora_gpu.markdown(results)
    assert "| step time (median) | lora16-7b / full-7b | 0.667 | <= 0.7 | PASS |" in text
    pair = "lora16-7b-always / full-7b-always"
    assert f"| peak GPU memory | {pair} | 0.444 | <= 0.6 | PASS |" in text
    assert "| weight sync (update_weights) | lora16-7b / full-7b | 0.050 | <= 0.05 | PASS |" in text
    beside_row = "| step time (median), adapter beside | lora16-7b-beside / full-7b | 0.800 |"
    assert beside_row + " <= 0.7 | FAIL |" in text
    assert "| lora16-14b | auto | 1 | | CUDA out of memory" in text and "| yes |" in text
    # each row its own warm-up + timed steps: the run's where the variant kept none
    assert "| lora16-7b-always | always | 0 | 1 + 1 | 15.00 (15.00-15.00) |" in text
    assert "| full-7b | auto | 0 | 2 + 3 |" in text
    assert "commit: abc1234" in text


def test_a_variant_starts_only_with_the_time_its_shape_took():
    # session 25: a 7B variant started with 132 s left and was killed while loading
    # none of its shape finished yet: the first's floor (a 14B variant started with 140 s left
    # was cut while saving its models, session 32); a shape without one: the floor
    assert lora_gpu.least_seconds({}, "7b") == 240.0
    assert lora_gpu.least_seconds({}, "14b") == 300.0
    assert lora_gpu.least_seconds({}, "tiny") == lora_gpu.MIN_VARIANT_S
    variants = {
        "full-7b": {"rc": 0, "seconds": 476.0},
        "full-7b-always": {"rc": 0, "seconds": 240.5},
        "lora16-7b": {"rc": 124, "seconds": 132.4},  # cut: says nothing of what 7B needs
        "lora16-14b": {"rc": 0, "seconds": 30.0},  # another shape
    }
    assert lora_gpu.least_seconds(variants, "7b") == 240.5
    assert lora_gpu.least_seconds(variants, "14b") == lora_gpu.MIN_VARIANT_S  # never below
    assert lora_gpu.least_seconds(variants, "32b") == 600.0  # none of its shape finished


def test_ratios_missing_variant_are_none():
    full = lora_gpu.summarize(_run([10.0], [1.0], [0.0], 80.0))
    got = lora_gpu.ratios({"variants": {"full-7b": {"summary": full}, "lora16-7b": {"rc": 137}}})
    assert got == dict.fromkeys(lora_gpu.BARS)
    # The speed pair without the memory pair: speed ratios only.
    lora = lora_gpu.summarize(_run([5.0], [0.05], [0.0], 60.0))
    got = lora_gpu.ratios(
        {"variants": {"full-7b": {"summary": full}, "lora16-7b": {"summary": lora}}}
    )
    assert got["step_s"] == pytest.approx(0.5) and got["peak_gib"] is None


def test_step_args_name_the_shapes():
    args = lora_gpu.parse_args(["--out-dir", "/tmp/x"])
    assert args.variants == [
        "full-7b",
        "lora16-7b",
        "lora16-7b-beside",
        "full-7b-always",
        "lora16-7b-always",
        "lora16-14b",
    ]
    argv = lora_gpu.step_args("lora16-14b", args, Path("/tmp/x/run"))
    assert argv[argv.index("--shape") + 1] == "14b"
    assert argv[argv.index("--judge-shape") + 1] == "7b"
    assert argv[argv.index("--offload") + 1] == "auto"
    for variant, offload in (("full-7b-always", "always"), ("lora16-7b-always", "always")):
        argv = lora_gpu.step_args(variant, args, Path("/tmp/x/run"))
        assert argv[argv.index("--offload") + 1] == offload
        assert argv[argv.index("--shape") + 1] == "7b"
    assert "--tiny" not in argv
    assert "--activation-checkpointing" in argv
    assert argv[argv.index("--micro-batch-tokens") + 1] == "16384"
    # LoRA at its fastest train setting: no recomputed forward, the cap from free memory
    argv = lora_gpu.step_args("lora16-7b-noac", args, Path("/tmp/x/run"))
    assert "--activation-checkpointing" not in argv
    assert argv[argv.index("--micro-batch-tokens") + 1] == "auto"
    # Qwen2.5-14B's config.json: 48 layers of width 5120, 40 heads (8 KV), MLP 13824.
    shape = lora_gpu.setup.SHAPES["14b"]
    assert (shape["hidden_size"], shape["num_hidden_layers"]) == (5120, 48)
    assert (shape["num_key_value_heads"], shape["intermediate_size"]) == (8, 13824)


def test_a_cut_variant_is_summarized_from_its_log():
    text = "\n".join(
        [
            "[full x1 longtail] step 0 warmup 40.00s: rollout 30.00 genrm 5.00 train 4.00 sync 1.00",
            "[full x1 longtail] step 1 timed 31.50s: rollout 20.00 genrm 5.00 train 6.00 sync 0.50",
            "[full x1 fixed] step 1 timed 99.00s: rollout 99.00",
            "[full x1 longtail] step 2 timed 30.50s: rollout 20.00 genrm 5.00 train 5.00 sync 0.30",
            "Traceback (most recent call last):",
        ]
    )
    rows = lora_gpu.log_rows(text)
    assert [r["step_s"] for r in rows] == [31.5, 30.5]  # timed long-tail steps only
    summary = lora_gpu.summarize_log(rows)
    assert summary["step_s"]["median"] == pytest.approx(31.0)
    assert summary["phases_s"]["train"] == pytest.approx(5.5)
    assert summary["peak_gib"] is None and summary["source"] == "log"


# ---- lora_cpu_gain.py ----------------------------------------------------------------------------


def test_reward_gain_is_last_ten_minus_first_ten():
    rows = [{"reward/mean": float(i)} for i in range(40)]
    # mean(30..39) - mean(0..9) = 34.5 - 4.5
    assert lora_cpu_gain.reward_gain(rows) == pytest.approx(30.0)
    with pytest.raises(ValueError, match="need >= 20"):
        lora_cpu_gain.reward_gain(rows[:19])


def test_cpu_gain_ratios_and_report():
    data = {
        "commit": "abc1234",
        "steps": 40,
        "lora_overrides": ["policy.lora.rank=8"],
        "command": "x",
        "seeds": {
            "0": {
                "full": {"gain": 0.5, "first": -0.4, "last": 0.1},
                "lora": {"gain": 0.45, "first": -0.4, "last": 0.05},
            },
            "1": {"full": {"gain": 0.7, "first": -0.5, "last": 0.2}, "lora": {"error": "rc 1"}},
        },
    }
    assert lora_cpu_gain.ratios(data) == {"0": pytest.approx(0.9)}
    text = lora_cpu_gain.markdown(data)
    assert "| 0.90 | PASS |" in text
    assert "| 1 |" in text and "rc 1" in text and "| n/a | n/a |" in text


def test_cpu_gain_refuses_runs_without_lora(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "lora" / "lora_cpu_gain.py"),
            "--lora",
            "policy.lr=1e-2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "policy.lora.rank" in done.stderr


def test_lora_modes_smoke_run(tmp_path):
    """bench/lora/lora_modes_gpu.py --smoke: merge vs beside on the tiny shape, then the
    self-judge: one engine (the policy's base view) against two (a second copy of the base)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(ROOT / "bench" / "lora" / "lora_modes_gpu.py"), "--smoke"]
    cmd += ["--out-dir", str(tmp_path), "--models-dir", str(tmp_path / "models")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "lora_modes_cpu_smoke.json").read_text())
    merge, beside = results["modes"]["merge"], results["modes"]["beside"]
    # Beside the base: A [16, in] and B [out, 16] per linear of each layer, in the served dtype
    # (float32 on the tiny shape). Merging keeps the same float32 factors to un-merge, plus the
    # base values rounding would not give back.
    factors = LAYERS * sum(4 * 16 * (i + o) for i, o in _linears())
    assert beside["adapter_bytes"] == factors
    assert merge["adapter_bytes"] >= factors
    assert merge["kv_cache_bytes"] == beside["kv_cache_bytes"]  # equal memory
    assert set(merge["decode_ms"]) == set(beside["decode_ms"]) == {"8"}
    assert all(ms > 0 for ms in [*merge["decode_ms"].values(), *beside["decode_ms"].values()])
    separate, shared = results["self_judge"]["separate"], results["self_judge"]["shared"]
    assert (separate["num_engines"], shared["num_engines"]) == (2, 1)
    assert 2 * shared["weight_bytes"] == separate["weight_bytes"]  # one copy of the base
    # Two identical engines against one: the judge's weights and KV cache are the policy's.
    assert results["ratios"]["self_judge_resident"] == 0.5
    assert (tmp_path / "lora_modes_cpu_smoke.md").is_file()


def test_each_side_at_its_fastest_setting_and_the_partial_variants_layout(tmp_path):
    """The best-of row: the fastest finished LoRA 7B variant / the fastest full one (hand-built:
    LoRA 11, 9 (partial), 10 s; full 14, 13 s (partial) -> 9 / 13), named in the report; a
    variant not finished is not a candidate. The partial variants run step.py's partial layout."""

    def finished(step_s):
        return {"rc": 0, "summary": lora_gpu.summarize(_run([step_s], [0.1], [0.0], 50.0))}

    results = {
        "variants": {
            "lora16-7b": finished(11.0),
            "lora16-7b-partial": finished(9.0),
            "lora16-7b-noac": finished(10.0),
            "lora16-7b-noac-partial": {"rc": 1, "error": "CUDA out of memory", "oom": True},
            "full-7b": finished(14.0),
            "full-7b-partial": finished(13.0),
        }
    }
    assert lora_gpu.ratios(results)["step_s_best"] == pytest.approx(9.0 / 13.0)
    results |= {"device": "nvidia_h200", "commit": "abc1234", "smoke": False}
    results |= {"warmup": 1, "steps": 1, "micro_batch_tokens": 16384, "command": "x"}
    text = lora_gpu.markdown(results)
    assert "| fastest: lora16-7b-partial / full-7b-partial | 0.692 | <= 0.7 | PASS |" in text
    assert "| full-7b-partial | auto, partial | 0 |" in text
    del results["variants"]["full-7b"], results["variants"]["full-7b-partial"]
    assert lora_gpu.ratios(results)["step_s_best"] is None
    args = lora_gpu.parse_args(["--variants", "lora16-7b-noac-partial"])
    argv = lora_gpu.step_args("lora16-7b-noac-partial", args, tmp_path)
    assert argv[argv.index("--layout") + 1] == "partial"
    assert "--activation-checkpointing" not in argv
    assert argv[argv.index("--micro-batch-tokens") + 1] == "auto"
    argv = lora_gpu.step_args("full-7b", args, tmp_path)
    assert argv[argv.index("--layout") + 1] == "full" and "--activation-checkpointing" in argv


def test_a_shapes_variants_run_together_in_the_order_shapes_first_appear():
    """The disk holds one shape's models at a time: a 14B variant between two 7B ones would
    find the 7B models kept for the later one (session 33: no space left while saving)."""
    got = lora_gpu.run_order(["full-7b", "lora16-7b-beside", "lora16-14b", "lora16-7b-noac"])
    assert got == ["full-7b", "lora16-7b-beside", "lora16-7b-noac", "lora16-14b"]
    assert lora_gpu.run_order(["lora16-14b", "full-7b"]) == ["lora16-14b", "full-7b"]


def test_refresh_smoke_run_times_every_way(tmp_path):
    import refresh_gpu

    assert refresh_gpu.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "refresh_cpu_smoke.json").read_text())
    ways = ("refresh", "temporaries", "copy+scale_", "flat", "full_floor")
    assert set(results["ways"]) == set(ways)
    assert all(0 < t["min"] <= t["median"] <= t["max"] for t in results["ways"].values())
    # the tiny shape's 2 layers x 7 targets; A [16, in] and B [out, 16] in float32
    assert results["num_targets"] == LAYERS * 7
    assert results["adapter_bytes"] == LAYERS * sum(4 * 16 * (i + o) for i, o in _linears())


@pytest.mark.parametrize("scaling, exact", [(2.0, True), (0.5, True), (16 / 12, False)])
def test_copy_then_scale_matches_the_temporaries_for_power_of_two_scalings(scaling, exact):
    """Rounding to bf16 commutes with a power-of-two scaling (an exponent shift), so casting B
    first and scaling in bf16 gives the float32 path's values; other scalings round twice."""
    import refresh_gpu
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    model = AutoModelForCausalLM.from_config(Qwen2Config(**refresh_gpu.setup.TINY))
    lists = refresh_gpu.adapter(model, torch.bfloat16)
    lists.scaling = scaling
    refresh_gpu.with_temporaries(lists)
    want = [t.clone() for t in lists.destinations]
    assert all(w.abs().sum() > 0 for w in want)
    for t in lists.destinations:
        t.zero_()
    refresh_gpu.copy_then_scale(lists)
    same = all(torch.equal(g, w) for g, w in zip(lists.destinations, want, strict=True))
    assert same is exact
