"""bench/verl_*.py and step_trl.py --use-vllm on the CPU: the verl run's data, forced lengths,
judge prompts, Hydra overrides, step parsing, medians and the merged report's ratios. verl's own
schema check (verl_step.py --dry-run) runs when verl and Hydra import here."""

NUM_GPUS = 0

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "step"))
sys.path.insert(0, str(ROOT / "bench" / "verl"))
import _step_setup as setup
import step_trl
import verl_report
import verl_runs
import verl_step
import verl_workload


def _as_dict(overrides: list[str]) -> dict[str, str]:
    out = {}
    for item in overrides:
        key, value = item.split("=", 1)
        assert key not in out, f"{key} set twice"
        out[key] = value
    return out


def _overrides(cfg: verl_step.VerlBenchConfig) -> dict[str, str]:
    work = setup.Workload(judge_tokens=cfg.judge_tokens)
    paths = {
        "policy_dir": Path("/m/policy"),
        "judge_dir": Path("/m/judge"),
        "data_file": Path("/d/train.parquet"),
        "agent_loop_config": Path("/d/loops.yaml"),
    }
    return _as_dict(verl_step.verl_overrides(cfg, work=work, **paths))


# -- data: every step's prompts, and each group's forced lengths ------------------------------
@pytest.mark.parametrize("mix", ["fixed", "longtail"])
def test_dataset_rows_carry_each_groups_forced_lengths_in_step_order(mix):
    cfg = verl_step.VerlBenchConfig(mix=mix, steps=2, warmup=1)
    work = setup.Workload(judge_tokens=128)
    rows = verl_step.dataset_rows(cfg, work)
    assert len(rows) == 3 * 16
    for step in range(3):
        flat = setup.response_lengths(mix, work, step)  # prompt-major, group-minor
        texts = setup.prompt_texts(work, step)
        for p in range(16):
            row = rows[step * 16 + p]
            info = row["extra_info"]
            assert info["index"] == step * 16 + p
            assert info["forced_lengths"] == flat[p * 8 : (p + 1) * 8]
            assert row["prompt"] == [{"role": "user", "content": texts[p]}]
            assert info["prompt_text"] == texts[p]
            assert info["judge_tokens"] == 128
    if mix == "fixed":
        assert all(r["extra_info"]["forced_lengths"] == [256] * 8 for r in rows)


def test_forced_length_gives_each_copy_of_a_row_the_next_length():
    seen: dict[int, int] = {}
    row = {"index": 3, "forced_lengths": [64, 900, 100]}
    other = {"index": 4, "forced_lengths": [7, 8, 9]}
    got = [verl_workload.forced_length(row, seen) for _ in range(3)]
    assert got == [64, 900, 100]
    assert verl_workload.forced_length(other, seen) == 7  # a row of its own count
    assert verl_workload.forced_length(row, seen) == 64  # the next step's copy: starts again
    with pytest.raises(ValueError, match="forced_lengths"):
        verl_workload.forced_length({"index": 5, "forced_lengths": []}, seen)
    # verl's V1 trainer numbers the copies: the number picks the length, no counting
    fresh: dict[int, int] = {}
    assert [verl_workload.forced_length(row, fresh, session_id=k) for k in (2, 0, 1)] == [
        100,
        64,
        900,
    ]
    assert fresh == {}


def test_prompt_text_is_the_rows_user_message():
    assert verl_workload.prompt_text([{"role": "user", "content": "abc"}]) == "abc"
    with pytest.raises(ValueError, match="raw_prompt"):
        verl_workload.prompt_text([])


def test_groups_keep_their_lengths_when_verl_splits_the_batch_over_agent_workers():
    # verl repeats each row n times, interleaved, then hands contiguous chunks to the agent-loop
    # workers (one process each, one counter each). With agent_workers dividing the prompts, a
    # group's copies meet in one worker and get exactly the group's lengths.
    cfg = verl_step.VerlBenchConfig(mix="longtail")
    work = setup.Workload()
    rows = verl_step.dataset_rows(cfg, work)[:16]
    copies = [r["extra_info"] for r in rows for _ in range(work.group_size)]
    chunk = len(copies) // cfg.agent_workers
    got: dict[int, list[int]] = {}
    for w in range(cfg.agent_workers):
        seen: dict[int, int] = {}
        for info in copies[w * chunk : (w + 1) * chunk]:
            got.setdefault(info["index"], []).append(verl_workload.forced_length(info, seen))
    flat = setup.response_lengths("longtail", work, 0)
    for p in range(16):
        assert sorted(got[p]) == sorted(flat[p * 8 : (p + 1) * 8])
    with pytest.raises(ValueError, match="agent_workers"):
        verl_step.VerlBenchConfig(agent_workers=3)


def test_judge_prompt_ids_are_yatt_genrms():
    from yatt import genrm
    from yatt.testing import make_tokenizer

    tokenizer = make_tokenizer()
    response = [5, 30, 100, 151000]
    ids = verl_workload.judge_prompt_ids(tokenizer, "abcdef", response)
    template = genrm.JudgeTemplate(user=setup.JUDGE_USER, max_response_tokens=2048)
    sample = genrm.Sample(prompt="abcdef", response=setup.ids_to_text(response))
    expected, is_truncated = template.render_ids(sample, tokenizer)
    assert ids == expected and not is_truncated


def test_policy_view_renders_the_prompt_as_its_own_tokens(tmp_path):
    policy_dir, _ = setup.make_models(tmp_path / "models", tiny=True)
    view = verl_step.policy_view(policy_dir, tmp_path / "view")
    from transformers import AutoTokenizer

    text = setup.prompt_texts(setup.Workload(), 0)[0]
    tok = AutoTokenizer.from_pretrained(view)
    messages = [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(rendered, add_special_tokens=False)
    assert len(ids) == 128 and ids == tok.encode(text, add_special_tokens=False)
    weights = [p for p in view.iterdir() if p.name.endswith(".safetensors")]
    assert weights and all(p.is_symlink() for p in weights)
    # the source keeps its own template (the judge and yatt's runs read it)
    original = AutoTokenizer.from_pretrained(policy_dir)
    assert original.chat_template != verl_step.CONTENT_ONLY_TEMPLATE


# -- verl's configuration ----------------------------------------------------------------------
@pytest.mark.parametrize("mix,response", [("fixed", 256), ("longtail", 1024)])
def test_overrides_describe_the_workload(mix, response):
    o = _overrides(verl_step.VerlBenchConfig(mix=mix))
    assert o["data.train_batch_size"] == "16" and o["actor_rollout_ref.rollout.n"] == "8"
    # one optimizer step per batch: the mini-batch is the whole batch, one epoch
    assert o["actor_rollout_ref.actor.ppo_mini_batch_size"] == o["data.train_batch_size"]
    assert o["actor_rollout_ref.actor.ppo_epochs"] == "1"
    assert o["data.max_prompt_length"] == "128"
    assert o["data.max_response_length"] == str(response)
    assert o["actor_rollout_ref.rollout.max_model_len"] == str(128 + response)
    # no KL anywhere
    assert o["actor_rollout_ref.actor.use_kl_loss"] == "False"
    assert o["algorithm.use_kl_in_reward"] == "False"
    assert o["algorithm.adv_estimator"] == "grpo"
    assert o["actor_rollout_ref.rollout.ignore_eos"] == "True"
    assert o["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "16384"
    # no flash-attn on the machine: SDPA on padded micro-batches, as yatt's TorchPolicy
    assert o["+actor_rollout_ref.model.override_config.attn_implementation"] == "sdpa"
    assert o["actor_rollout_ref.model.use_remove_padding"] == "False"
    # the judge's context holds prompt + the longest response + template + verdict
    assert int(o["reward.reward_model.rollout.max_model_len"]) >= 128 + 1024 + 128
    assert o["reward.reward_model.enable"] == "True"
    assert o["reward.reward_model.enable_resource_pool"] == "False"  # colocate


@pytest.mark.parametrize("mode,bypass", [("bypass", "True"), ("recompute", "False")])
def test_old_log_prob_mode_switches_vllm_logprobs_with_bypass(mode, bypass):
    o = _overrides(verl_step.VerlBenchConfig(old_log_prob=mode))
    assert o["algorithm.rollout_correction.bypass_mode"] == bypass
    assert o["actor_rollout_ref.rollout.calculate_log_probs"] == bypass


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_kernels_turn_on_verls_fused_head_with_the_backend(backend):
    off = _overrides(verl_step.VerlBenchConfig())
    assert "actor_rollout_ref.model.use_fused_kernels" not in off  # verl's default: logits
    cfg = verl_step.VerlBenchConfig(fused_kernels=backend)
    o = _overrides(cfg)
    assert o["actor_rollout_ref.model.use_fused_kernels"] == "True"
    assert o["actor_rollout_ref.model.fused_kernel_options.impl_backend"] == backend
    assert cfg.variant == f"verl_fixed-fused-{backend}"


def test_poll_interval_plugs_verls_custom_sampler_hook():
    mine = _overrides(verl_step.VerlBenchConfig())
    assert not any(k.startswith("trainer.v1.sampler") for k in mine)  # verl's buffer as it ships
    cfg = verl_step.VerlBenchConfig(poll_interval_s=0.05)
    o = _overrides(cfg)
    assert o["trainer.v1.sampler.custom_sampler.name"] == "QuickPollReplayBuffer"
    assert o["trainer.v1.sampler.custom_sampler.path"].strip("'").endswith("verl_plugins.py")
    assert float(o["+trainer.v1.sampler.sampler_kwargs.poll_interval_s"]) == 0.05
    assert cfg.variant == "verl_fixed-poll50ms"
    plugin = (ROOT / "bench" / "verl" / "verl_plugins.py").read_text()
    assert plugin.count("class QuickPollReplayBuffer(ReplayBuffer):") == 1


def test_quick_poll_buffer_passes_its_interval_to_verls_buffer(monkeypatch):
    """verl_plugins with verl's base classes stubbed: the interval reaches ReplayBuffer."""
    import types

    class ReplayBuffer:
        def __init__(self, trainer_mode, sampler_kwargs, poll_interval=2.0, **kwargs):
            self.poll_interval, self.kwargs = poll_interval, kwargs

    stubs = {
        "aiohttp": {},
        "verl.experimental.agent_loop.single_turn_agent_loop": {"SingleTurnAgentLoop": object},
        "verl.experimental.reward_loop.reward_manager.base": {"RewardManagerBase": object},
        "verl.trainer.ppo.v1.replay_buffer": {"ReplayBuffer": ReplayBuffer},
    }
    for name, attrs in stubs.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    monkeypatch.delitem(sys.modules, "verl_plugins", raising=False)
    import verl_plugins

    buf = verl_plugins.QuickPollReplayBuffer(
        trainer_mode="sync", sampler_kwargs={"poll_interval_s": 0.05}, refill_fn=None
    )
    assert buf.poll_interval == 0.05 and buf.kwargs == {"refill_fn": None}
    assert (
        verl_plugins.QuickPollReplayBuffer(trainer_mode="sync", sampler_kwargs={}).poll_interval
        == 2.0
    )
    monkeypatch.delitem(sys.modules, "verl_plugins")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"VerlBenchConfig\.mix"):
        verl_step.VerlBenchConfig(mix="short")
    with pytest.raises(ValueError, match=r"VerlBenchConfig\.old_log_prob"):
        verl_step.VerlBenchConfig(old_log_prob="none")
    with pytest.raises(ValueError, match=r"VerlBenchConfig\.judge_shape"):
        verl_step.VerlBenchConfig(judge_shape="70b")
    with pytest.raises(ValueError, match=r"VerlBenchConfig\.trainer"):
        verl_step.VerlBenchConfig(trainer="v2")
    with pytest.raises(ValueError, match=r"VerlBenchConfig\.fused_kernels"):
        verl_step.VerlBenchConfig(fused_kernels="liger")
    for bad in (0.0, -1.0, 5.0):
        with pytest.raises(ValueError, match=r"VerlBenchConfig\.poll_interval_s"):
            verl_step.VerlBenchConfig(poll_interval_s=bad)
    with pytest.raises(ValueError, match=r"VerlBenchConfig\.poll_interval_s"):
        verl_step.VerlBenchConfig(poll_interval_s=0.05, trainer="v0")


@pytest.mark.parametrize("trainer,use_v1", [("v1", "True"), ("v0", "False")])
def test_trainer_choice_and_verdict_length_reach_verl(trainer, use_v1):
    cfg = verl_step.VerlBenchConfig(trainer=trainer, judge_tokens=96)
    o = _overrides(cfg)
    assert o["trainer.use_v1"] == use_v1
    assert o["+ray_kwargs.ray_init.runtime_env.env_vars.YATT_JUDGE_TOKENS"] == "'96'"
    assert o["reward.reward_model.rollout.response_length"] == "96"
    assert cfg.variant == "verl_fixed" + ("-v0" if trainer == "v0" else "")


def test_quoted_paths_survive_hydras_override_parser():
    parser = pytest.importorskip("hydra.core.override_parser.overrides_parser")
    path = "/tmp/a dir/it's,[x]=y.parquet"
    parsed = parser.OverridesParser.create().parse_override(
        f"data.train_files={verl_step._quote(path)}"
    )
    assert parsed.value() == path


@pytest.mark.skipif(
    importlib.util.find_spec("verl") is None or importlib.util.find_spec("hydra") is None,
    reason="verl and hydra-core are not installed here (the GPU machine's probe runs this)",
)
def test_dry_run_composes_and_validates_with_verls_schema(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "verl" / "verl_step.py"),
        "--dry-run",
        "--mix",
        "longtail",
    ]
    cmd += ["--model-dir", str(tmp_path / "m"), "--out-dir", str(tmp_path / "o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compose and validate" in done.stdout


# -- a run's steps -----------------------------------------------------------------------------
def _line(number: int, **timing: float) -> str:
    data = {f"timing_s/{k}": v for k, v in timing.items()}
    data |= {"response_length/mean": 256.0, "response_length/max": 256, "response_length/min": 256}
    return json.dumps({"step": number, "data": data})


def test_parse_steps_maps_verls_timing_onto_yatts_phases():
    lines = [
        (100.0, _line(1, step=10.0, gen=4.0, reward=2.0, adv=0.1, update_actor=2.5,
                      update_weights=0.4)),
        (101.0, json.dumps({"step": 1, "data": {"val-core/acc": 0.0}})),  # no step timing
        (120.0, _line(2, step=9.0, gen=3.0, reward=2.0, old_log_prob=1.0, update_actor=2.0,
                      update_weights=0.5)),
    ]  # fmt: skip
    rows = verl_runs.parse_steps(lines)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["t0"] == 90.0 and rows[0]["t1"] == 100.0
    assert rows[0]["wall_s"] is None and rows[1]["wall_s"] == 20.0  # line to line
    first = rows[0]["phases"]
    assert first["rollout"] == 4.0 and first["genrm"] == 2.0 and first["sync"] == 0.4
    assert first["train"] == pytest.approx(2.6)
    assert first["other"] == pytest.approx(10.0 - 4.0 - 2.0 - 2.6 - 0.4)
    assert rows[1]["phases"]["train"] == pytest.approx(3.0)  # old-log-prob pass counts as train
    assert rows[1]["timing_s"]["old_log_prob"] == 1.0


def test_phases_of_maps_verls_timers_as_the_configs_readme_says():
    # configs/README.md: rollout = gen, genrm = reward, train = old_log_prob + adv +
    # update_actor, sync = update_weights, other = the rest of verl's step
    timing = {"step": 12.0, "gen": 5.0, "reward": 2.5, "old_log_prob": 0.5, "adv": 0.25,
              "update_actor": 2.0, "update_weights": 0.75, "save_checkpoint": 0.5}  # fmt: skip
    assert verl_runs.phases_of(timing) == {
        "rollout": 5.0,
        "genrm": 2.5,
        "train": 2.75,
        "sync": 0.75,
        "other": 1.0,  # 12 - 5 - 2.5 - 2.75 - 0.75: save_checkpoint and the untimed rest
    }
    bare = verl_runs.phases_of({"step": 3.0})  # a timer verl did not run counts as 0
    assert bare == {"rollout": 0.0, "genrm": 0.0, "train": 0.0, "sync": 0.0, "other": 3.0}
    # timers that overlap past the step leave no rest, never a negative one
    assert verl_runs.phases_of({"step": 4.0, "gen": 3.0, "reward": 2.0})["other"] == 0.0


def test_lengths_forced_compares_every_step_with_its_draw():
    cfg = verl_step.VerlBenchConfig(mix="longtail", steps=1, warmup=1)
    work = setup.Workload()
    rows = []
    for step in (1, 2):  # verl counts steps from 1
        want = setup.response_lengths("longtail", work, step - 1)
        lengths = {"mean": sum(want) / len(want), "max": max(want), "min": min(want)}
        rows.append({"step": step, "response_length": lengths})
    assert verl_runs.lengths_forced(rows, cfg, work)
    rows[1]["response_length"]["max"] -= 1  # one response stopped a token early
    assert not verl_runs.lengths_forced(rows, cfg, work)


def test_line_clock_times_lines_as_they_land(tmp_path):
    path = tmp_path / "m.jsonl"
    clock = verl_step.LineClock(path, period_s=0.01).start()
    path.write_text('{"a": 1}\n{"b"')
    time.sleep(0.1)
    with path.open("a") as f:
        f.write(": 2}\n")
    time.sleep(0.1)
    clock.stop()
    assert [json.loads(line) for _, line in clock.lines] == [{"a": 1}, {"b": 2}]
    assert clock.lines[0][0] < clock.lines[1][0]


def test_summarize_takes_median_min_max_and_median_busy():
    steps = [
        {
            "step_s": s,
            "phases": {"rollout": s / 2},
            "gpus": [{"gpu": 0, "busy": b, "peak_used_gib": m}],
        }
        for s, b, m in [(3, 0.5, 10), (1, 0.9, 12), (2, None, None), (10, 0.3, 11), (4, 0.6, 9)]
    ]
    out = verl_report.summarize(steps)
    assert (out["median"]["step_s"], out["min"]["step_s"], out["max"]["step_s"]) == (3, 1, 10)
    assert out["median"]["phases"]["rollout"] == 1.5
    assert out["median"]["gpus"] == [{"gpu": 0, "busy": 0.55, "peak_used_gib": 12}]
    with pytest.raises(ValueError, match="no timed steps"):
        verl_report.summarize([])


# -- the merged report -------------------------------------------------------------------------
def _run(
    path: Path, layout: str, steps: dict[str, float], *, t=(0.0, 1.0), judge_tokens=128, **extra
) -> None:
    work = {"num_prompts": 16, "group_size": 8, "prompt_tokens": 128, "judge_tokens": judge_tokens}
    mixes = {
        mix: {
            w: {"step_s": s + 1.0, "step_without_ckpt_s": s, "phases": {"rollout": s / 2}}
            for w in ("median", "min", "max")
        }
        for mix, s in steps.items()
    }
    run = {
        "layout": layout,
        "num_gpus": 1,
        "host": "h",
        "device": "nvidia_h200",
        "started_at": t[0],
        "ended_at": t[1],
        "workload": work,
        "mixes": mixes,
        **extra,
    }
    path.write_text(json.dumps(run))  # fmt: skip


def test_report_ratios_take_the_best_yatt_run_like_for_like(tmp_path):
    _run(tmp_path / "step_full_1gpu.json", "full", {"fixed": 2.0, "longtail": 3.0}, t=(0, 1))
    _run(tmp_path / "step_partial_1gpu.json", "partial", {"fixed": 2.2, "longtail": 2.5}, t=(1, 2))
    # faster, but it judged 8-token verdicts: not the same work
    _run(tmp_path / "step_full-x_1gpu.json", "full", {"longtail": 0.1}, t=(2, 3), judge_tokens=8)
    _run(
        tmp_path / "verl_longtail_1gpu.json",
        "verl_longtail",
        {"longtail": 10.0},
        t=(3, 4),
        framework="verl",
        config={"old_log_prob": "bypass"},
    )
    _run(tmp_path / "trl_vllm_1gpu.json", "trl-vllm", {"fixed": 5.0}, t=(4, 5))  # fmt: skip
    # verl at its best is the anchor: a slower default run and a faster one that recomputes the
    # old log-probs (not the work yatt does) leave the ratio on the 10 s run
    _run(tmp_path / "verl_longtail-slow_1gpu.json", "verl_longtail-slow", {"longtail": 14.0},
         t=(5, 6), framework="verl", config={"old_log_prob": "bypass"})  # fmt: skip
    _run(tmp_path / "verl_longtail-recompute_1gpu.json", "verl_longtail-recompute",
         {"longtail": 5.0}, t=(6, 7), framework="verl", config={"old_log_prob": "recompute"})  # fmt: skip
    runs = verl_report.load_runs(tmp_path)
    table = verl_report.ratios(runs)
    # yatt's step without its checkpoint: partial's 2.5 over verl's 10
    assert table["yatt_vs_verl"]["value"] == pytest.approx(0.25)
    assert table["yatt_vs_verl"]["num"] == "step_partial_1gpu.json"
    assert table["yatt_vs_verl"]["den"] == "verl_longtail_1gpu.json"
    assert table["yatt_vs_trl_vllm"]["value"] == pytest.approx(2.0 / 5.0)
    md = verl_report.write_report(runs, tmp_path / "out", commit="abc123")
    text = md.read_text()
    assert "0.25" in text and "abc123" in text and md.name == "verl_nvidia_h200.md"
    saved = json.loads((tmp_path / "out" / "verl_nvidia_h200.json").read_text())
    assert saved["ratios"]["yatt_vs_trl_vllm"]["value"] == pytest.approx(0.4)


def test_report_refuses_runs_that_overlapped_or_are_missing(tmp_path):
    _run(tmp_path / "step_full_1gpu.json", "full", {"longtail": 3.0}, t=(0, 2))
    _run(tmp_path / "verl_longtail_1gpu.json", "verl_longtail", {"longtail": 10.0}, t=(1, 3),
         framework="verl")  # fmt: skip
    table = verl_report.ratios(verl_report.load_runs(tmp_path))
    assert table["yatt_vs_verl"]["value"] is None
    assert "overlapped" in table["yatt_vs_verl"]["why"]
    assert table["yatt_vs_trl_vllm"]["value"] is None
    assert "not measured" in table["yatt_vs_trl_vllm"]["why"]


# -- TRL with vLLM -----------------------------------------------------------------------------
def test_step_trl_vllm_colocate_forces_lengths_through_sampling_params():
    args = step_trl.parse_args(["--use-vllm", "--vllm-memory", "0.25"])
    work = setup.Workload()
    got = step_trl.generation_settings(args, work)
    assert got["use_vllm"] and got["vllm_mode"] == "colocate"
    assert got["generation_kwargs"] == {"ignore_eos": True}
    assert got["vllm_gpu_memory_utilization"] == 0.25
    assert got["vllm_max_model_length"] == 128 + 256
    hf = step_trl.generation_settings(step_trl.parse_args([]), work)
    assert hf == {"use_vllm": False, "generation_kwargs": {"min_new_tokens": 256}}
    with pytest.raises(SystemExit):
        step_trl.parse_args(["--use-vllm", "--vllm-memory", "1.5"])


def test_a_verl_runs_json_is_what_the_report_reads(tmp_path):
    cfg = verl_step.VerlBenchConfig(mix="fixed", steps=2, warmup=1)
    work = setup.Workload(judge_tokens=128)
    lines = [
        (10.0 * k, _line(k, step=s, gen=s / 2, reward=1.0, update_actor=1.0, update_weights=0.1))
        for k, s in ((1, 9.0), (2, 4.0), (3, 6.0))
    ]
    rows = verl_runs.parse_steps(lines)
    for row in rows:
        row["gpus"], row["is_warmup"] = [], row["step"] <= cfg.warmup
    path = verl_runs.write_run(cfg, rows, tmp_path, work)
    assert path.name == "verl_fixed_1gpu.json"
    (run,) = verl_report.load_runs(tmp_path)
    assert run["framework"] == "verl"
    mix = run["mixes"]["fixed"]
    assert mix["median"]["step_s"] == 5.0 and mix["num_timed"] == 2  # the warm-up step left out
    assert mix["warmup_step_s"] == [9.0] and mix["median_wall_s"] == 10.0
    assert mix["all_lengths_forced"]  # fixed: 256 each, as _line reports
    assert verl_report.step_time(run, "fixed") == 5.0


def test_the_committed_agent_loop_entry_names_the_plugin_class():
    yaml = pytest.importorskip("yaml")
    (entry,) = yaml.safe_load(verl_step.AGENT_LOOPS.read_text())
    assert entry["name"] == verl_step.AGENT_LOOP_NAME
    module, cls = entry["_target_"].rsplit(".", 1)
    assert (ROOT / "bench" / "verl" / f"{module}.py").read_text().count(f"class {cls}(") == 1


def test_a_verl_run_past_its_timeout_ends_with_its_children(tmp_path):
    import os

    pid_file = tmp_path / "child.pid"
    cmd = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    with (tmp_path / "log").open("w") as log:
        t0 = time.perf_counter()
        rc = verl_step.run_in_own_group(cmd, env=dict(os.environ), log=log, timeout_s=1.0)
    assert rc == 124 and time.perf_counter() - t0 < 30
    child = Path(f"/proc/{int(pid_file.read_text())}/stat")

    def gone() -> bool:  # ended: no process, or a zombie its new parent has not reaped yet
        try:
            return child.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()  # the grandchild went with the group
    with (tmp_path / "log").open("w") as log:
        assert verl_step.run_in_own_group(["true"], env=dict(os.environ), log=log, timeout_s=5) == 0


def test_step_time_takes_min_and_max_from_the_steps_when_a_run_keeps_only_its_median():
    # TRL's run JSON: a median and the timed steps, no min/max entries
    run = {
        "mixes": {
            "fixed": {"median": {"step_s": 4.7}, "steps": [{"step_s": v} for v in (4.7, 4.46, 5.0)]}
        }
    }
    assert verl_report.step_time(run, "fixed") == 4.7
    assert verl_report.step_time(run, "fixed", "min") == 4.46
    assert verl_report.step_time(run, "fixed", "max") == 5.0
    assert (
        verl_report.step_time({"mixes": {"fixed": {"median": {"step_s": 1.0}}}}, "fixed", "max")
        is None
    )
