"""The reference trainer end to end on 2 CPU ranks (gloo): both placement modes, checkpoints,
and exact resume after a kill. One-rank runs go through the `trainer` fixture (tests/conftest.py):
each a process forked from an interpreter that has the trainer's imports loaded."""

NUM_GPUS = 0

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "train_grpo.py"
sys.path.insert(0, str(ROOT / "examples"))

import grpo_config
import grpo_preflight

from yatt.testing import free_port, native_threads, signal_when_ready


def _group_threads() -> set[str] | None:
    """This process's native threads of process groups (gloo, the TCP store), by id; None
    where they cannot be listed."""
    threads = native_threads()
    if threads is None:
        return None
    return {tid for tid, name in threads.items() if "gloo" in name or "tcpstore" in name}


@pytest.fixture(scope="module")
def embedded(embedded_task) -> list[str]:
    """The embedded task (built once per session, conftest.py); runs point at it."""
    paths = embedded_task
    return [
        "task=text",  # the demo's own values (given paths no longer imply them)
        f"policy.model_dir={paths['policy']}",
        f"data.path={paths['prompts']}",
        f"reward.judge_dir={paths['judge']}",
    ]


def _command(
    out_dir: Path, embedded: list[str], *args: str, nproc: int = 2, trainer: Path = TRAINER
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        str(trainer),
        f"out_dir={out_dir}",
        "data.prompts_per_rank=4",
        *embedded,
        *args,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]


# The 2-rank run with placement=full: checked as it is, and as the uninterrupted run that a
# killed and resumed one must match (so it is run once for both tests).
_UNINTERRUPTED = ("num_steps=6", "ckpt.every_steps=3")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, embedded) -> Path:
    out = tmp_path_factory.mktemp("full")
    command = _command(out, embedded, *_UNINTERRUPTED, "placement=full")
    subprocess.run(command, check=True, env=_env(), timeout=600)
    return out


@pytest.mark.parametrize("placement", ["full", "partial"])
def test_two_ranks_train_and_checkpoint(tmp_path, embedded, placement, request):
    if placement == "full":
        out, num_steps, due = request.getfixturevalue("full_run"), 6, 3
    else:
        out, num_steps, due = tmp_path / placement, 3, 2
        args = (f"num_steps={num_steps}", f"placement={placement}", f"ckpt.every_steps={due}")
        subprocess.run(_command(out, embedded, *args), check=True, env=_env(), timeout=600)
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(num_steps))
    for r in records:
        assert -1.0 <= r["reward/mean"] <= 1.0
        assert 0.0 <= r["reward/accuracy"] <= 1.0
        assert r["train/num_loss_tokens"] > 0 or r["train/is_skipped"] == 1.0
    phase = "rollout" if placement == "partial" else "genrm"
    assert f"placement/{phase}/switch_s" in records[-1]
    assert records[-1]["ckpt/skipped_no_space"] == 0.0  # every due save fit on the disk
    assert (out / "checkpoints" / f"step-{due:08d}").is_dir()  # due by ckpt.every_steps
    assert (out / "checkpoints" / f"step-{num_steps - 1:08d}").is_dir()  # the last, always
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    # a few sampled responses per step, with their rewards (rank 0's), in out_dir
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == set(range(num_steps))
    assert all({"prompt", "completion", "reward"} <= s.keys() for s in samples)


def test_resume_after_kill_matches_an_uninterrupted_run(tmp_path, embedded, full_run):
    keys = ("reward/mean", "reward/accuracy", "train/loss", "train/grad_norm")
    # The killed run saves synchronously; the uninterrupted one saved asynchronously (the
    # default): how a step is saved must change no number the run logs.
    steps = (*_UNINTERRUPTED, "placement=full", "ckpt.async_save=false")
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_command(killed, embedded, *steps), env=_env(), start_new_session=True)
    committed = killed / "checkpoints" / "step-00000003"
    deadline = time.monotonic() + 300
    while not committed.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-run
    proc.wait()
    assert committed.is_dir(), "the run never committed step 3"

    subprocess.run(
        _command(killed, embedded, *steps, "--resume"), check=True, env=_env(), timeout=600
    )
    resumed = {r["step"]: r for r in _metrics(killed)}
    expected = {r["step"]: r for r in _metrics(full_run)}
    assert sorted(resumed) == sorted(expected) == list(range(6))
    for step in (4, 5):  # the steps after the checkpoint, recomputed by the resumed run
        assert {k: resumed[step][k] for k in keys} == {k: expected[step][k] for k in keys}


def _resolved(raw: dict) -> grpo_config.TrainConfig:
    """The config as main runs it: its values checked, then what they point at (preflight)."""
    # the demo's values with the demo's models (given paths no longer imply them)
    return grpo_preflight.preflight(grpo_config.build_config({"task": "text", **raw}))


def _paths(embedded: list[str]) -> dict[str, str]:
    """The embedded task's paths as raw config sections."""
    values = dict(arg.split("=", 1) for arg in embedded)
    return {
        "policy": {"model_dir": values["policy.model_dir"]},
        "data": {"path": values["data.path"]},
        "reward": {"judge_dir": values["reward.judge_dir"]},
    }


@pytest.mark.parametrize("config", sorted((ROOT / "examples" / "configs").glob("*.yaml")), ids=str)
def test_shipped_configs_use_only_known_keys(config, embedded, monkeypatch):
    import importlib.util

    import yaml

    # GPU configs name vLLM/SGLang, absent here: their options are still checked.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name in ("vllm", "sglang") else find_spec(name, *a),
    )
    # backend=megatron needs CUDA (preflight refuses it here): its keys are still checked
    monkeypatch.setattr(grpo_preflight, "check_policy_device", lambda backend: None)
    raw = yaml.safe_load(config.read_text())
    paths = _paths(embedded)
    for section, values in paths.items():  # the real paths of the GPU configs do not exist here
        raw[section] = {**raw.get(section, {}), **values}
    # A real dataset's splits: the embedded prompts (a JSONL file, no splits) stand in.
    raw["data"]["split"] = ""
    if "eval" in raw:
        raw["eval"] = {**raw["eval"], "path": paths["data"]["path"], "split": ""}
    monkeypatch.chdir(ROOT)  # reward functions are named relative to the repository root
    cfg = _resolved(raw)
    assert cfg.placement in ("full", "partial")
    assert cfg.policy.temperature == cfg.rollout.temperature
    with pytest.raises(ValueError, match=r"unknown config key 'rollout\.temprature'"):
        grpo_config.build_config({**raw, "rollout": {"temprature": 1}})


@pytest.mark.parametrize(
    ("name", "backend", "fraction_key"),
    [
        ("sglang_partial_gpu.yaml", "sglang", "mem_fraction_static"),
        ("vllm_full_gpu.yaml", "vllm", "gpu_memory_utilization"),
    ],
)
def test_engine_configs_run_rollout_and_judge_on_one_engine_and_gpu(name, backend, fraction_key):
    import yaml

    raw = yaml.safe_load((ROOT / "examples" / "configs" / name).read_text())
    fractions = []
    for section in ("rollout", "reward"):
        assert raw[section]["backend"] == backend
        fractions.append(raw[section]["backend_options"][fraction_key])
    # Both engines hold their share at once (resident together, or both built before the first
    # phase); the trainer's onloaded weights and activations need the rest.
    assert sum(fractions) <= 0.6


def test_unknown_or_missing_engine_backends_are_clear_errors_before_anything_loads():
    with pytest.raises(ValueError, match=r"rollout\.backend='tgi'"):
        grpo_config.RolloutConfig(backend="tgi")
    # vLLM/SGLang are not installed on the CPU machines: the extra to install is named.
    with pytest.raises(ValueError, match=r"reward\.backend='sglang'.*yatt-rollout\[sglang\]"):
        grpo_preflight.check_engine_installed("reward", grpo_config.RewardConfig(backend="sglang"))
    with pytest.raises(
        ValueError, match=r"reward\.backend_options=.*only for reward\.backend='vllm' or 'sglang'"
    ):
        grpo_config.RewardConfig(backend_options={"mem_fraction_static": 0.3})


def test_an_unknown_engine_option_names_the_field(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(ValueError, match=r"rollout\.backend_options=\{'gpu_mem': 0\.3\}"):
        grpo_config.RolloutConfig(backend="vllm", backend_options={"gpu_mem": 0.3})


@pytest.mark.parametrize(("key", "value"), [("placement", "split"), ("offload", "lazy")])
def test_placement_and_offload_are_checked_before_anything_loads(key, value):
    with pytest.raises(ValueError, match=f"{key}='{value}'"):
        grpo_config.TrainConfig(policy={}, **{key: value})


def test_policy_fields_are_checked_against_the_backends_config(embedded, monkeypatch):
    model_dir = _paths(embedded)["policy"]["model_dir"]
    # backend=megatron needs CUDA (preflight refuses it here): its fields are still checked
    monkeypatch.setattr(grpo_preflight, "check_policy_device", lambda backend: None)

    def build(raw: dict):
        return _resolved({**_paths(embedded), **raw})

    cfg = build({"backend": "megatron", "policy": {"model_dir": model_dir, "tp_size": 2}})
    assert isinstance(cfg.policy, grpo_config.core.MegatronPolicyConfig)
    assert cfg.policy.tp_size == 2
    assert isinstance(cfg.policy, grpo_config.core.MegatronPolicyConfig)
    assert isinstance(
        build({"policy": {"model_dir": model_dir}}).policy, grpo_config.core.TorchPolicyConfig
    )
    with pytest.raises(
        ValueError, match=r"unknown config key 'policy\.tp_size' for TorchPolicyConfig"
    ):
        build({"policy": {"model_dir": model_dir, "tp_size": 2}})
    with pytest.raises(
        ValueError, match=r"'policy\.tp_sise' for MegatronPolicyConfig; did you mean"
    ):
        build({"backend": "megatron", "policy": {"model_dir": model_dir, "tp_sise": 2}})
    with pytest.raises(ValueError, match=r"backend='jax' is not a policy backend"):
        build({"backend": "jax", "policy": {"model_dir": model_dir}})


def test_config_values_are_typed_and_the_temperature_has_one_source(embedded):
    raw = {**_paths(embedded), "rollout": {"temperature": 0.7}}
    raw["policy"] = {**raw["policy"], "lr": "1e-3"}  # as YAML reads 1e-3
    before = json.dumps(raw, sort_keys=True)
    cfg = _resolved(raw)
    assert cfg.policy.lr == 0.001
    assert cfg.policy.temperature == cfg.rollout.temperature == 0.7
    assert json.dumps(raw, sort_keys=True) == before  # the raw dict is never edited
    raw["policy"] = {**raw["policy"], "temperature": 0.7}
    with pytest.raises(ValueError, match=r"policy\.temperature=0\.7: set rollout\.temperature"):
        grpo_config.build_config(raw)


def test_the_embedded_task_fills_empty_paths_without_editing_the_raw_dict(embedded):
    out_dir = Path(_paths(embedded)["data"]["path"]).parents[1]  # <out_dir>/embedded/prompts.jsonl
    raw = {"out_dir": str(out_dir), "data": {"prompts_per_rank": 4}}
    cfg = _resolved(raw)  # already built: reused
    assert raw == {"out_dir": str(out_dir), "data": {"prompts_per_rank": 4}}
    assert cfg.data.path == _paths(embedded)["data"]["path"]
    assert cfg.policy.model_dir == _paths(embedded)["policy"]["model_dir"]
    assert cfg.reward.judge_dir == _paths(embedded)["reward"]["judge_dir"]
    assert cfg.data.prompts_per_rank == 4


def test_megatron_backend_on_cpu_stops_before_training_with_a_clear_error(
    tmp_path, embedded, trainer
):
    out = tmp_path / "megatron"
    config = ROOT / "examples" / "configs" / "tiny_megatron.yaml"
    args = ["--config", str(config), "policy.tp_size=1", f"out_dir={out}", "num_steps=2"]
    proc = trainer.run(
        [sys.executable, str(TRAINER), *args, *embedded],
        env={**_env(), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2  # refused in preflight, before the runtime starts
    assert "backend='megatron' needs CUDA" in proc.stderr, proc.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists()  # no step ran


# The trainer with megatron-core's own modules on CPU, through the core tests' shim (float32,
# Megatron's non-distributed optimizer, no grad clipping: see _cpu_shim.install_for_policy).
_MEGATRON_ON_CPU = """
import os, runpy, sys
sys.path.insert(0, {shim!r})
import _cpu_shim
_cpu_shim.install_for_policy()
sys.path.insert(0, os.path.dirname({trainer!r}))
import grpo_preflight
grpo_preflight.check_policy_device = lambda backend: None  # the shim runs megatron on CPU
sys.argv = [{trainer!r}, *sys.argv[1:]]
runpy.run_path({trainer!r}, run_name="__main__")
"""


def test_megatron_backend_trains_checkpoints_and_resumes_exactly_at_tp2(tmp_path, embedded):
    """backend=megatron through the unchanged loop: TP=2 on 2 gloo ranks (one batch per TP
    pair), rank-keyed checkpoints, and a resumed run equal to an uninterrupted one."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    wrapper = tmp_path / "megatron_on_cpu.py"
    shim = ROOT / "packages" / "yatt-core" / "tests" / "megatron"
    wrapper.write_text(_MEGATRON_ON_CPU.format(shim=str(shim), trainer=str(TRAINER)))
    megatron = (
        "backend=megatron",
        "policy.tp_size=2",
        "policy.dtype=float32",
        "policy.use_distributed_optimizer=false",
        "policy.grad_clip=null",
        "ckpt.every_steps=2",
        "ckpt.async_save=false",
    )
    env = {**_env(), "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}

    def run(out: Path, *args: str) -> None:
        command = _command(out, embedded, *megatron, *args, trainer=wrapper)
        subprocess.run(command, check=True, env=env, timeout=600)

    run(tmp_path / "straight", "num_steps=5")
    run(tmp_path / "resumed", "num_steps=3")  # saves step 2
    assert len(list((tmp_path / "resumed/checkpoints/step-00000002").glob("rank-*"))) == 2
    run(tmp_path / "resumed", "num_steps=5", "--resume")
    expected, resumed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [r["step"] for r in expected] == list(range(5))
    assert all(r["train/num_loss_tokens"] > 0 for r in expected)
    assert expected[0]["train/loss"] != expected[4]["train/loss"]
    keys = ("reward/mean", "train/loss", "train/grad_norm", "train/rollout_mismatch")
    for step in (3, 4):  # recomputed by the resumed run from the step-2 checkpoint
        assert {k: resumed[step][k] for k in keys} == {k: expected[step][k] for k in keys}


def _one_rank(out_dir: Path, embedded: list[str], *args: str) -> list[str]:
    fixed = [f"out_dir={out_dir}", "data.prompts_per_rank=4"]
    return [sys.executable, str(TRAINER), *fixed, *embedded, *args]


def test_empty_prompts_are_skipped_and_counted_without_a_crash(tmp_path, embedded, trainer):
    # Most rows unusable: rounds that draw only skipped rows return no samples and draw again.
    data = Path(next(a for a in embedded if a.startswith("data.path=")).split("=", 1)[1])
    rows = [json.loads(line) for line in data.read_text().splitlines()][:40]
    bad = tmp_path / "mostly_empty.jsonl"
    bad.write_text(
        "".join(
            json.dumps({**r, "prompt": "" if i % 4 else r["prompt"]}) + "\n"
            for i, r in enumerate(rows)
        )
    )
    args = [a for a in embedded if not a.startswith("data.path=")] + [f"data.path={bad}"]
    out = tmp_path / "run"
    trainer.run(_one_rank(out, args, "num_steps=4"), check=True, env=_env(), timeout=600)
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[-1]["data/skipped_rows"] > records[0]["data/skipped_rows"] > 0
    assert all(r["genrm/errors"] == 0 for r in records)


def test_a_run_whose_every_verdict_fails_stops_and_says_why(tmp_path, embedded, trainer):
    # The policy as the judge: it answers with digits, never Yes/No, so no verdict parses.
    policy_dir = _paths(embedded)["policy"]["model_dir"]
    args = [a for a in embedded if not a.startswith("reward.judge_dir=")]
    out = tmp_path / "run"
    result = trainer.run(
        _one_rank(out, [*args, f"reward.judge_dir={policy_dir}"], "num_steps=5"),
        env=_env(),
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "every one of" in result.stderr and "judge verdicts failed" in result.stderr
    assert "first on this rank: sample" in result.stderr and "no verdict" in result.stderr
    records = _metrics(out)
    assert len(records) == 1
    assert records[0]["genrm/unparsable"] == records[0]["genrm/verdicts"] > 0


def test_a_run_whose_steps_never_update_stops_and_says_why(tmp_path, embedded, trainer):
    """A reward that never varies within a group (a constant function): dynamic sampling keeps
    no group, no step updates, and the run stops after max_idle_steps instead of exiting 0."""
    rewards = tmp_path / "constant.py"
    rewards.write_text("def score(prompt, response, reference, row):\n    return 1.0\n")
    args = [a for a in embedded if not a.startswith("reward.judge_dir=")]
    out = tmp_path / "run"
    result = trainer.run(
        _one_rank(
            out,
            args,
            "reward.backend=none",
            f"reward.functions=[{rewards}:score]",
            "max_idle_steps=3",
            "rollout.max_sampling_rounds=1",
            "num_steps=10",
        ),
        env=_env(),
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "NoLearningError: step 2: 3 steps in a row updated nothing" in result.stderr
    assert "no group with reward variance" in result.stderr
    records = _metrics(out)  # the stuck steps' metrics were logged before the stop
    assert [r["train/idle_steps_in_a_row"] for r in records] == [1.0, 2.0, 3.0]
    assert all(r["train/is_skipped"] == 1.0 and r["reward/mean"] == 1.0 for r in records)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        pytest.param(
            ["data.answer_key=no_such_field"],
            r"required_keys='no_such_field' is not a field of the first 16 rows",
            id="rows-without-the-answer-field",
        ),
        pytest.param(
            ["reward.judge_template={prompt}{response} {rubric}"],
            r"required_keys='rubric' is not a field",
            id="template-names-a-column-the-rows-lack",
        ),
        pytest.param(
            ["reward.engine.max_seq_len=12"],
            r"reward\.engine\.max_seq_len: the judge prompt of row 0 .* takes \d+ tokens",
            id="judge-context-too-short",
        ),
        pytest.param(
            ["data.prompts_per_rank=100000"],
            r"batch_size=100000 \(prompts per rank per step: the trainer's data\.prompts_per_rank\)",
            id="more-prompts-per-step-than-data",
        ),
        pytest.param(
            ["data.path=EMPTY"],
            r"empty\.jsonl': none of its first 16 rows is usable.*holds no text",
            id="no-usable-row",
        ),
    ],
)
def test_data_the_judge_cannot_read_fails_before_any_model_loads(
    tmp_path, embedded, args, match, trainer
):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("".join(json.dumps({"prompt": "", "answer": "1"}) + "\n" for _ in range(20)))
    args = [arg.replace("EMPTY", str(empty)) for arg in args]
    keys = {arg.split("=", 1)[0] for arg in args}
    kept = [arg for arg in embedded if arg.split("=", 1)[0] not in keys]
    out = tmp_path / "run"
    result = trainer.run(
        _one_rank(out, kept, *args, "num_steps=2"),
        env=_env(),
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert re.search(match, result.stderr), result.stderr[-2000:]
    assert "Loading weights" not in result.stderr  # no model loaded
    assert not (out / "metrics.jsonl").exists()


def test_resume_without_a_checkpoint_is_an_error(tmp_path, embedded, trainer):
    result = trainer.run(
        [*_one_rank(tmp_path / "fresh", embedded, "num_steps=2"), "--resume"],
        env=_env(),
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "holds no checkpoint" in result.stderr
    assert not (tmp_path / "fresh" / "metrics.jsonl").exists()


def test_a_close_error_never_hides_the_loops_own(caplog):
    import train_grpo

    class Broken:
        def close(self):
            raise OSError("disk gone")

    closed = []

    class Fine:
        def close(self):
            closed.append(True)

    with pytest.raises(KeyError, match="the loop's"), train_grpo.ClosingStack() as resources:
        resources.close_later(Fine())
        resources.close_later(Broken())
        raise KeyError("the loop's")  # the loop failed: its error, not the close's
    assert closed == [True] and "closing Broken failed" in caplog.text
    with pytest.raises(OSError, match="disk gone"), train_grpo.ClosingStack() as resources:
        resources.close_later(Fine())
        resources.close_later(Broken())
    assert closed == [True, True]


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("num_steps=abc", r"num_steps='abc': must be an int"),
        ("num_steps=-5", r"num_steps=-5: must be >= 0"),
        ("rollout.samples_per_prompt=1", r"rollout.samples_per_prompt=1: must be >= 2"),
        ("data=", r"config section 'data' is empty"),
        ("reward.votes=0", r"reward.votes=0: must be >= 1"),
        ("reward.judge_template=Q {prompt} R {nope}", r"judge_template=.*reads \['nope'\]"),
        ("reward.judge_template=Q {0}", r"reward\.judge_template='Q \{0\}': .*named fields"),
        ("policy.lr=abc", r"policy\.lr='abc': must be a float"),
        ("policy.temperature=0.5", r"policy\.temperature=0\.5: set rollout\.temperature"),
        ("rollout.backend_options.dtype=bfloat16", r"rollout\.backend_options=.*only for"),
        ("data.answer_key=''", r"reads \{reference\} but data\.answer_key is ''"),
        # 8 groups per rank (the default) cannot split into 3 mini-batches of whole groups
        ("loss.num_mini_batches=3", r"loss\.num_mini_batches=3 does not divide data\.prompts"),
        ("overlong.buffer_tokens=5", r"overlong\.buffer_tokens=5 is longer than rollout\.max_new"),
        ("rollout.max_oversample=0.5", r"rollout\.max_oversample=0\.5: must be >= 1\.0"),
        ("rollout.on_unfilled=drop", r"rollout\.on_unfilled='drop': use one of"),
    ],
)
def test_bad_config_values_fail_before_anything_loads(tmp_path, override, match, trainer):
    # No embedded task exists in this out_dir: an error after setup would first build it.
    result = trainer.run(
        [sys.executable, str(TRAINER), f"out_dir={tmp_path}", override],
        env=_env(),
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert re.search(match, result.stderr), result.stderr[-2000:]
    assert not (tmp_path / "embedded").exists()


def test_chat_format_prompts_go_through_the_chat_template(tmp_path, embedded, trainer):
    data = Path(next(a for a in embedded if a.startswith("data.path=")).split("=", 1)[1])
    rows = [json.loads(line) for line in data.read_text().splitlines()][:32]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        "".join(
            json.dumps({**r, "prompt": [{"role": "user", "content": r["prompt"]}]}) + "\n"
            for r in rows
        )
        + json.dumps({"prompt": [{"role": "user"}], "answer": "1"})  # no content: skipped
        + "\n"
    )
    args = [a for a in embedded if not a.startswith("data.path=")] + [f"data.path={chat}"]
    out = tmp_path / "run"
    trainer.run(
        _one_rank(out, args, "num_steps=2", "rollout.engine.max_seq_len=96"),
        check=True,
        env=_env(),
        timeout=600,
    )
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["genrm/verdicts"] > 0 for r in records)


def test_help_lists_every_config_field_and_the_set_is_frozen(trainer):
    # A new config field must be added to tests/trainer_config_fields.txt: a deliberate edit.
    result = trainer.run(
        [sys.executable, str(TRAINER), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    flags = set(re.findall(r"--[a-z-]+", result.stdout.split("config fields", 1)[0]))
    assert flags == {"--help", "--config", "--traceback", "--resume", "--export", "--step"}
    listed = result.stdout.split("config fields", 1)[1].splitlines()[1:]
    names = [line.strip().split(" = ")[0] for line in listed if " = " in line]
    frozen = (ROOT / "tests" / "trainer_config_fields.txt").read_text().split()
    assert names == frozen
    assert "  policy.lr = 1e-06  # AdamW peak learning rate" in result.stdout
    assert "policy.is_reference" not in result.stdout  # loss.kl_coef > 0 makes the reference
    assert "policy.temperature" not in result.stdout  # rollout.temperature is the one source
    assert "  rollout.samples_per_prompt = 8  # GRPO group size n" in result.stdout
    # LoRA's sub-fields each with its meaning (issue 45)
    assert "  policy.lora.rank = 8  # r: the adapter's inner dimension" in result.stdout
    assert "  policy.lora.alpha = 16.0  # the update's scale is alpha / rank" in result.stdout


class _CountingTokenizer:
    """The policy's tokenizer, counting decode calls."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.num_decodes = tokenizer, 0

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self.num_decodes += 1
        return self.tokenizer.decode(*args, **kwargs)


@pytest.mark.parametrize("should_overlap", [False, True], ids=["full", "partial"])
def test_a_round_decodes_each_response_once_and_pairs_it_with_its_verdict(embedded, should_overlap):
    from dataclasses import replace

    import train_grpo
    from transformers import AutoTokenizer

    from yatt import rollout
    from yatt.placement import Plan
    from yatt.placement.testing import RecordingRole

    cfg = _resolved(_paths(embedded))
    # Region tags are per process, and an engine closed asleep leaves its tag paused: one
    # prefix per case.
    mode = "partial" if should_overlap else "full"
    rollout_cfg = replace(cfg.rollout, engine=replace(cfg.rollout.engine, region_prefix=mode))
    reward_cfg = replace(cfg.reward, engine=replace(cfg.reward.engine, region_prefix=f"{mode}-j"))
    engine = train_grpo.make_engine(rollout_cfg, cfg.policy.model_dir, "cpu")
    judge_engine = train_grpo.make_engine(reward_cfg, cfg.reward.judge_dir, "cpu")
    scorer, _ = train_grpo.make_scorer(cfg.reward, judge_engine)
    roles = {"rollout": engine, "genrm": judge_engine}
    trainer_role = RecordingRole("train", [], {"weights": 1})
    make_plan = Plan.partial_colocation if should_overlap else Plan.full_colocation
    plan = make_plan(**roles, train=trainer_role)
    tokenizer = _CountingTokenizer(AutoTokenizer.from_pretrained(cfg.policy.model_dir))
    rows = [{"prompt": "1+2=", "answer": 3}, {"prompt": "4+0=", "answer": "4"}]
    encoder = train_grpo.PromptEncoder(cfg, tokenizer)
    sampling = rollout.SamplingParams(n=3, temperature=1.0, max_new_tokens=4, seed=1)
    try:
        scored = train_grpo.generate_and_score(
            encoder.encode(rows),
            sampling,
            engine=engine,
            scorer=scorer,
            plan=plan,
            tokenizer=tokenizer,
            data=cfg.data,
            should_overlap=should_overlap,
            timings={},
        )
    finally:
        engine.close()
        judge_engine.close()
    assert len(scored) == 6 and tokenizer.num_decodes == 6  # once per response, not twice
    for item in scored:
        row = rows[item.completion.request_index]
        assert item.sample.prompt == row["prompt"]
        assert item.sample.reference == str(row["answer"])  # an integer answer read as text
        decoded = tokenizer.tokenizer.decode(item.completion.response_ids, skip_special_tokens=True)
        assert item.sample.response == decoded
        # The judge's label probabilities: 2 P(Yes) - 1, the sign that of the label it wrote.
        assert item.verdict.status == "ok" and -1.0 <= item.verdict.reward <= 1.0
        assert (item.verdict.reward > 0) == (item.verdict.votes[0].text.strip() == "Yes")
    groups = sorted(
        (item.completion.request_index, item.completion.sample_index) for item in scored
    )
    assert groups == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    batch = train_grpo.to_batch(scored, train_grpo.core.init_runtime(seed=0), encoder)
    rewards = [item.verdict.reward for item in scored]
    assert batch.samples["reward"].tolist() == pytest.approx(rewards, rel=1e-6)  # as float32


# -- a fake engine: each request's one response is its index ---------------------------------
# (the round's own tests, generate_and_judge with fakes, are yatt-genrm's: test_judged_round.py)
ROLLOUT_GAP_S = 0.03  # the fake engine's time before each response


class _FakeEngine:
    """Each request's one response is its index; streamed last request first, one per gap."""

    def _completion(self, index: int, request) -> object:
        from yatt import rollout

        return rollout.Completion(
            request_index=index,
            sample_index=0,
            prompt_ids=list(request.prompt_ids),
            response_ids=[index] * (index + 1),
            logprobs=[0.0] * (index + 1),
            finish_reason="length",
        )

    def generate(self, requests, sampling):
        return [self._completion(i, r) for i, r in enumerate(requests)]

    async def stream(self, requests, sampling):
        import asyncio

        for i in reversed(range(len(requests))):
            await asyncio.sleep(ROLLOUT_GAP_S)
            yield self._completion(i, requests[i])


def test_a_stop_signal_inside_the_evaluations_judge_leaves_this_rank_out_not_the_run(tmp_path):
    """issue 49: the judge's stop flag also reaches evaluate(); a ScoringStopped there is not
    an error of the run: the rank joins the eval reduction as one without eval rows."""
    from types import SimpleNamespace

    import grpo_config
    import train_grpo

    from yatt import core, genrm

    def stopped(prompts, sampling, timings):
        raise genrm.ScoringStopped(num_samples=len(prompts), waited_s=0.0)

    cfg, _ = grpo_config.read_config([f"out_dir={tmp_path}"])
    ctx = SimpleNamespace(
        runtime=core.init_runtime(seed=0),
        encoder=SimpleNamespace(cut_token_ids=()),
        accuracy=None,
        generate_and_score=stopped,
    )
    metrics = train_grpo.evaluate(["a prompt"], step=3, cfg=cfg, ctx=ctx)
    assert metrics["eval/num_samples"] == 0.0


def test_the_keep_rule_tests_the_task_reward_before_the_overlong_penalty():
    """DAPO eq. 11 filters on the accuracy signal, then eq. 13's soft penalty joins the reward
    (verl's recipe alike): an all-right group with one response in the overlong buffer has no
    task-reward variance and is not kept; a mixed group is kept with the penalty added."""
    from types import SimpleNamespace

    import train_grpo

    from yatt import core, genrm, rollout

    max_new_tokens, buffer_tokens = 8, 4
    groups = {0: ([1.0, 1.0, 1.0, 1.0], [2, 2, 2, 7]), 1: ([1.0, 0.0, 1.0, 0.0], [2, 2, 2, 7])}
    scored = [
        train_grpo.Scored(
            rollout.Completion(
                request_index=g,
                sample_index=j,
                prompt_ids=[1, 2],
                response_ids=[5] * length,
                logprobs=[-0.1] * length,
                finish_reason="stop",
            ),
            genrm.Sample(prompt="q", response="r"),
            genrm.Verdict(sample_id=f"{g}-{j}", reward=reward, status="ok"),
            SimpleNamespace(images=None, vision=None),  # a text prompt
        )
        for g, (rewards, lengths) in groups.items()
        for j, (reward, length) in enumerate(zip(rewards, lengths, strict=True))
    ]
    sampler = core.DynamicSampler(target_groups=1, reward_key=train_grpo.TASK_REWARD)
    ctx = SimpleNamespace(
        cfg=SimpleNamespace(
            overlong=core.OverlongConfig(buffer_tokens=buffer_tokens),
            rollout=SimpleNamespace(max_new_tokens=max_new_tokens),
        ),
        runtime=core.init_runtime(seed=0),
        encoder=SimpleNamespace(takes_images=False, cut_token_ids=()),
        accuracy=None,
        sampler=sampler,
    )
    sampler.num_to_draw()
    train_grpo.keep(scored, ctx, train_grpo.StepStats())
    batch, _ = train_grpo.take_batch(sampler, should_stop=False)
    # DAPO eq. 13 by hand: 7 tokens, 4 past L_max - L_cache = 4 ... (4 - 7) / 4 = -0.75
    assert batch.samples["reward"].tolist() == [1.0, 0.0, 1.0, 0.0 - 0.75]  # group 1, not 0
    assert train_grpo.TASK_REWARD not in batch.samples  # the penalised reward trains


class _FakePolicy:
    """Notes what each update saw; a constant cost per sample."""

    def __init__(self) -> None:
        self.num_logprobs = self.num_costs = 0
        self.updates: list[tuple[int, bool, bool]] = []  # (samples, has pi_old, has ref)

    def logprobs(self, batch):
        self.num_logprobs += 1
        return torch.zeros(batch["loss_mask"].shape)

    def estimate_batch_costs(self, batch):
        self.num_costs += 1
        return [1.0] * len(batch)

    def train_step(self, batch, loss):
        fields = batch.tokens
        self.updates.append((len(batch), "old_logprobs" in fields, "ref_logprobs" in fields))
        keys = ("loss", "grad_norm", "lr", "num_micro_batches", "is_skipped")
        return dict.fromkeys(keys, 0.0) | {"num_loss_tokens": 1.0}


@pytest.mark.parametrize("epochs, minis", [(1, 1), (2, 2)])
def test_train_on_batch_runs_epochs_times_mini_batches_updates_after_pi_old_and_the_reference(
    epochs, minis
):
    import train_grpo

    from yatt import core, rollout

    requests = [rollout.Request(prompt_ids=[7] * (i + 2)) for i in range(4)]
    completions = _FakeEngine().generate(requests, None)
    samples = core.rollout_samples(
        completions, rewards=[0.0, 1.0, 0.0, 1.0], group_ids=[0, 0, 1, 1]
    )
    loss = core.PolicyLoss(num_epochs=epochs, num_mini_batches=minis)
    policy, reference = _FakePolicy(), _FakePolicy()
    metrics = train_grpo.train_on_batch(
        core.rollout_batch(samples),
        policy=policy,
        reference=reference,
        loss=loss,
        costs=None,
        device="cpu",
        seed=0,
        step=0,
    )
    # pi_old by one forward before the first update (off-policy), the reference's once; each
    # epoch splits the 2 groups into `minis` mini-batches of whole groups.
    assert policy.num_logprobs == 1 and reference.num_logprobs == 1
    assert policy.updates == [(4 // minis, True, True)] * (epochs * minis)
    assert policy.num_costs == (minis > 1)  # costs: only a split needs them
    assert metrics["num_optimizer_steps"] == epochs * minis


# -- what users of TRL and verl expect (issue 16) ----------------------------------------------
_REWARD_FUNCTIONS = """
def exact(prompt, response, reference, row):
    if reference is None:
        return None  # cannot score: counted as unparsable
    return 1.0 if response.strip() == reference else -1.0
"""


def _datasets_folder(tmp_path: Path, embedded: list[str]) -> Path:
    """The embedded prompts as a DatasetDict saved with save_to_disk (train and test splits)."""
    datasets = pytest.importorskip("datasets", reason="the datasets extra is not installed")
    data = Path(_paths(embedded)["data"]["path"])
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    folder = tmp_path / "addition"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows[:512]),
            "test": datasets.Dataset.from_list(rows[512:576]),
        }
    ).save_to_disk(folder)
    return folder


def test_functions_only_reward_kl_reference_schedule_eval_datasets_and_export(
    tmp_path, embedded, trainer
):
    """2 ranks, no judge model: a reward function file, a KL reference, warm-up + cosine lr,
    eval every 2 steps, prompts from a save_to_disk split; the final step is checkpointed
    though not due, and exported as a folder transformers loads with the checkpoint's weights."""
    from safetensors.torch import load_file

    from yatt.core import compute_lr

    rewards = tmp_path / "rewards.py"
    rewards.write_text(_REWARD_FUNCTIONS)
    folder = _datasets_folder(tmp_path, embedded)
    policy_dir = _paths(embedded)["policy"]["model_dir"]
    out = tmp_path / "run"
    args = (
        "task=text",  # the demo's values (lr 2e-3) with its policy
        f"policy.model_dir={policy_dir}",
        f"data.path={folder}",
        "data.split=train",
        f"eval.path={folder}",
        "eval.split=test",
        "eval.every_steps=2",
        "eval.num_prompts=16",
        "reward.backend=none",
        f"reward.functions=[{rewards}:exact]",
        "loss.kl_coef=0.05",
        "policy.lr_schedule=cosine",
        "policy.num_warmup_steps=1",
        "num_steps=3",
        "ckpt.every_steps=100",
    )
    subprocess.run(_command(out, [], *args), check=True, env=_env(), timeout=600)
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["genrm/errors"] == r["genrm/unparsable"] == 0 for r in records)
    # Rewards come from the function alone: +1/-1 per sample, and its mean tracks accuracy.
    for r in records:
        assert r["reward/mean"] == pytest.approx(2 * r["reward/accuracy"] - 1)
    # The KL reference is the starting policy: no divergence before the first update.
    assert records[0]["train/kl"] == 0.0 and records[2]["train/kl"] > 0.0
    expected_lr = [
        compute_lr(step, lr=2e-3, num_warmup_steps=1, schedule="cosine", num_decay_steps=3)
        for step in range(3)
    ]
    assert [r["train/lr"] for r in records] == pytest.approx(expected_lr)
    # Eval after steps 2 and 3 (and the last): 16 held-out prompts over the 2 ranks, greedy.
    assert "eval/reward/mean" not in records[0]
    assert records[1]["eval/num_samples"] == records[2]["eval/num_samples"] == 16
    assert (out / "checkpoints" / "step-00000002").is_dir()  # the last step, always
    exported = load_file(out / "export" / "model.safetensors")
    trainer.run(
        [sys.executable, str(TRAINER), "--export", f"out_dir={out}", *args],
        check=True,
        env=_env(),
        timeout=300,
    )
    from_checkpoint = load_file(out / "export" / "model.safetensors")
    assert exported.keys() == from_checkpoint.keys()
    assert all(torch_equal(exported[k], from_checkpoint[k]) for k in exported)
    initial = load_file(Path(policy_dir) / "model.safetensors")
    assert any(not torch_equal(initial[k], exported[k]) for k in exported)  # it trained


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def _fake_chat_server(port: int, requests: list, finish_reason: str = "stop") -> None:
    """An OpenAI-compatible /chat/completions judge for the addition task: 'Yes' when the
    response after the prompt equals the reference ("{prompt}{response} ref {reference}")."""
    import asyncio

    from aiohttp import web

    async def chat(request):
        body = await request.json()
        requests.append(body)
        text = body["messages"][-1]["content"]
        head, _, reference = text.rpartition(" ref ")
        response = head.partition("=")[2]
        verdict = "Yes" if response.strip() == reference.strip() else "No"
        if finish_reason == "length":  # cut at max tokens, "Yes" as its last (partial) line
            verdict = "Let me check the sum step by step.\nYes"
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": verdict},
                "finish_reason": finish_reason,
            }
            for i in range(body.get("n", 1))
        ]
        usage = {"prompt_tokens": len(text), "completion_tokens": 1}
        return web.json_response({"choices": choices, "usage": usage})

    async def models(request):
        return web.json_response({"data": [{"id": "judge"}]})

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()  # until the test process exits (a daemon thread)

    asyncio.run(serve())


def test_a_judge_served_over_an_openai_compatible_endpoint(tmp_path, embedded, trainer):
    import threading

    requests: list = []
    port = free_port()
    threading.Thread(target=_fake_chat_server, args=(port, requests), daemon=True).start()
    paths = [a for a in embedded if not a.startswith("reward.judge_dir=")]
    out = tmp_path / "run"
    openai = f"reward.openai={{base_url: 'http://127.0.0.1:{port}/v1', model: judge}}"
    command = _one_rank(out, paths, "num_steps=2", "reward.backend=openai", openai)
    trainer.run(command, check=True, env=_env(), timeout=300)
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:  # the endpoint's verdicts are exact: reward = 2 accuracy - 1
        assert r["genrm/errors"] == 0
        assert r["reward/mean"] == pytest.approx(2 * r["reward/accuracy"] - 1)
    assert len(requests) >= records[0]["genrm/verdicts"]
    assert all(body["model"] == "judge" for body in requests)


def test_a_judge_cut_at_its_length_is_an_error_never_a_reward(tmp_path, embedded, trainer):
    """Issue 49: an endpoint whose every answer is cut ("length") with "Yes" as its last line:
    each verdict is a judge error (never +1), so the run stops naming the cause."""
    import threading

    requests: list = []
    port = free_port()
    server = threading.Thread(
        target=_fake_chat_server, args=(port, requests, "length"), daemon=True
    )
    server.start()
    paths = [a for a in embedded if not a.startswith("reward.judge_dir=")]
    out = tmp_path / "run"
    openai = f"reward.openai={{base_url: 'http://127.0.0.1:{port}/v1', model: judge}}"
    command = _one_rank(out, paths, "num_steps=2", "reward.backend=openai", openai)
    result = trainer.run(command, env=_env(), timeout=300, capture_output=True, text=True)
    assert result.returncode != 0
    assert "judge verdicts failed" in result.stderr
    assert "length" in result.stderr or "max_new_tokens" in result.stderr, result.stderr[-2000:]
    records = _metrics(out)
    assert len(records) == 1
    assert records[0]["genrm/errors"] == records[0]["genrm/verdicts"] > 0
    # no verdict read as "Yes": reward/accuracy is the task's exact match, not the judge's
    assert records[0]["reward/mean"] < 1.0


@pytest.mark.parametrize(
    ("reward", "match"),
    [
        ({"backend": "none"}, r"reward\.backend='none' loads no judge"),
        ({"backend": "none", "functions": ["no_such_module:fn"]}, r"reward\.functions: "),
        ({"functions": ["os:getcwd"]}, r"reward\.functions: .*os:getcwd"),
        (
            {"backend": "none", "functions": ["os.path:join"], "function_weights": [1, 2]},
            r"function_weights=.*one weight per",
        ),
        ({"backend": "openai"}, r"reward\.openai="),
        (
            {
                "backend": "openai",
                "openai": {
                    "base_url": "http://x/v1",
                    "model": "m",
                    "api_key_env": "YATT_NO_SUCH_KEY",
                },
            },
            r"YATT_NO_SUCH_KEY.*not set",
        ),
        ({"openai": {"base_url": "http://x/v1"}}, r"only for reward\.backend='openai'"),
        ({"backend": "tgi"}, r"reward\.backend='tgi'"),
    ],
)
def test_reward_settings_fail_before_anything_loads(reward, match, monkeypatch):
    monkeypatch.delenv("YATT_NO_SUCH_KEY", raising=False)
    with pytest.raises(ValueError, match=match):
        grpo_preflight.check_reward(grpo_config.RewardConfig(**reward))


def test_run_settings_fail_before_anything_loads(embedded, tmp_path):
    paths = _paths(embedded)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (
            {"placement": "partial", "reward": {"backend": "none", "rule_weight": 1.0}},
            r"placement='partial' keeps the judge's engine",
        ),
        ({"data": {"path": str(empty), "split": "train"}}, r"data\.split='train'.*has \[\]"),
        ({"eval": {"split": "test"}}, r"eval\.split='test' needs eval\.path"),
        ({"export": {"dtype": "fp8"}}, r"export\.dtype='fp8'"),
        ({"policy": {"is_reference": True}}, r"policy\.is_reference: .*loss\.kl_coef"),
        ({"log": {"wandb_project": "p"}}, r"wandb_project='p' needs wandb"),
        ({"policy": {"model_dir": "org/not-cached"}}, r"policy\.model_dir: .*hf download"),
    ]
    import importlib.util

    has_wandb = importlib.util.find_spec("wandb") is not None
    for override, match in cases:
        if "log" in override and has_wandb:
            continue  # installed: nothing to refuse
        raw = dict(paths)
        for key, value in override.items():  # sections merge with the paths; scalars replace
            raw[key] = {**paths.get(key, {}), **value} if isinstance(value, dict) else value
        with pytest.raises(ValueError, match=match):
            _resolved({**raw, "out_dir": str(tmp_path / "out")})


def test_a_hub_id_in_the_local_cache_is_a_model_path(embedded, tmp_path, monkeypatch):
    import shutil

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(_paths(embedded)["policy"]["model_dir"], snapshot)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raw = {**_paths(embedded), "policy": {"model_dir": "org/tiny"}}
    cfg = _resolved(raw)
    assert Path(cfg.policy.model_dir) == snapshot


# -- reliability (issue 23): config values refused before anything loads -----------------------
@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("reward.rule_weight=.nan", r"reward\.rule_weight=nan: must be a finite number"),
        ("reward.rule_weight=1e300", r"reward\.rule_weight=1e\+300: must be a finite number"),
        (
            "reward.function_weights=[.inf]",
            r"reward\.function_weights\[0\]=inf: must be a finite number",
        ),
        (
            "reward.function_weights=[1, 1e300]",
            r"reward\.function_weights\[1\]=1e\+300: must be a finite number within",
        ),
        ("seed=-1", r"seed=-1: must be >= 0"),
        ("seed=2147483648", r"seed=2147483648: must be <= 2147483647"),
        ("reward.votes=1e9", r"reward\.votes=1000000000: must be <= 64"),
        ("rollout.samples_per_prompt=1e5", r"rollout\.samples_per_prompt=100000: must be <= 1024"),
        ("eval.samples_per_prompt=5000", r"eval\.samples_per_prompt=5000: must be <= 1024"),
        (
            "reward.functions=[os.path:join, os.path:join]",
            r"reward\.functions=.*'os\.path:join' is listed twice",
        ),
    ],
)
def test_absurd_or_non_finite_values_are_refused_when_the_config_is_read(tmp_path, override, match):
    with pytest.raises(ValueError, match=match):
        grpo_config.read_config([f"out_dir={tmp_path}", override])
    assert not (tmp_path / "embedded").exists()  # refused before the embedded task is built


def test_the_largest_allowed_sizes_and_seed_are_accepted():
    grpo_config.RolloutConfig(samples_per_prompt=1024)
    grpo_config.RewardConfig(votes=64, rule_weight=-1e6)
    grpo_config.TrainConfig(policy={}, seed=2**31 - 1)


def test_a_reward_file_listed_twice_under_two_spellings_is_refused(tmp_path, monkeypatch):
    (tmp_path / "rewards.py").write_text(
        "def score(prompt, response, reference, row):\n    return 0.0\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'\./rewards\.py:score' is listed twice"):
        grpo_config.RewardConfig(
            backend="none", functions=["rewards.py:score", "./rewards.py:score"]
        )
    grpo_config.RewardConfig(backend="none", functions=["rewards.py:score", "os.path:join"])


def test_a_key_given_twice_in_yaml_is_refused_with_its_lines(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("rollout:\n  temperature: 0.5\nnum_steps: 3\nrollout:\n  max_new_tokens: 8\n")
    with pytest.raises(
        ValueError, match=r"run\.yaml: line 4: duplicate key 'rollout' \(first at line 1\)"
    ):
        grpo_config.read_config(["--config", str(config), f"out_dir={tmp_path}"])
    nested = tmp_path / "nested.yaml"
    nested.write_text("reward:\n  votes: 2\n  votes: 3\n")
    with pytest.raises(ValueError, match=r"line 3: duplicate key 'votes' \(first at line 2\)"):
        grpo_config.read_config(["--config", str(nested), f"out_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"override .*duplicate key 'base_url'"):
        grpo_config.read_config([f"out_dir={tmp_path}", "reward.openai={base_url: a, base_url: b}"])
    # A YAML merge key may still be overridden: not a duplicate.
    assert grpo_config.load_yaml("a: &b {v: 1}\nc:\n  <<: *b\n  v: 2\n", "t") == {
        "a": {"v": 1},
        "c": {"v": 2},
    }
    assert not (tmp_path / "embedded").exists()


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("/tmp/anything", r"a folder name under out_dir, not a path"),
        ("..", r"not '\.', '\.\.' or hidden"),
        (".", r"not '\.', '\.\.' or hidden"),
        ("sub/export", r"not a path"),
        ("checkpoints", r"the run writes 'checkpoints' itself"),
        ("tensorboard", r"the run writes 'tensorboard' itself"),
        ("embedded", r"the run writes 'embedded' itself"),
        ("metrics.jsonl", r"the run writes 'metrics\.jsonl' itself"),
    ],
)
def test_an_export_dir_outside_out_dir_or_over_the_runs_own_files_is_refused_when_read(
    tmp_path, name, match
):
    with pytest.raises(ValueError, match=rf"export\.dir='{re.escape(name)}': .*(?:{match})"):
        grpo_config.read_config([f"out_dir={tmp_path}", f"export.dir={name}"])
    assert not (tmp_path / "embedded").exists()  # refused before anything is built


def test_an_existing_export_dir_is_replaced_only_if_it_is_yatts_export(tmp_path, embedded):
    out_dir = tmp_path / "run"
    mine = out_dir / "mine"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("the user's own file")
    raw = {**_paths(embedded), "out_dir": str(out_dir)}
    with pytest.raises(ValueError, match=r"export\.dir='mine': .* is not a yatt export"):
        _resolved({**raw, "export": {"dir": "mine"}})
    assert (mine / "notes.txt").read_text() == "the user's own file"
    (out_dir / "link").symlink_to(tmp_path)  # a link: replacing it could reach anywhere
    with pytest.raises(
        ValueError, match=r"export\.dir='link': .*(holds the checkpoint|is a symbolic link)"
    ):
        _resolved({**raw, "export": {"dir": "link"}})
    (out_dir / "empty").mkdir()
    _resolved({**raw, "export": {"dir": "empty"}})  # nothing to lose
    earlier = out_dir / "earlier"
    earlier.mkdir()
    # the marker yatt's export writes (its "format" key is what marks it as yatt's)
    (earlier / ".yatt-export.json").write_text('{"format": "yatt-hf-export"}')
    _resolved({**raw, "export": {"dir": "earlier"}})


def _a_step_logged(out: Path) -> Callable[[], bool]:
    metrics = out / "metrics.jsonl"
    return lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1


def test_one_run_per_out_dir_and_sigterm_saves_and_exits_non_zero(tmp_path, embedded, trainer):
    """A second trainer or an --export beside a running trainer fails before anything loads,
    naming the running one; SIGTERM then saves the step in progress and exits 128 + 15, and
    the out_dir is free again (the --export that follows reads that checkpoint)."""
    out = tmp_path / "run"
    steps = ("num_steps=1000", "ckpt.every_steps=1000", "eval.every_steps=0")

    def while_running(first: subprocess.Popen) -> None:
        second = trainer.run(
            _one_rank(out, embedded, *steps, "--resume"),
            env=_env(),
            timeout=300,
            capture_output=True,
            text=True,
        )
        assert second.returncode != 0
        assert f"is in use by pid {first.pid} on host" in second.stderr, second.stderr[-2000:]
        assert "(train, since" in second.stderr
        assert "Loading weights" not in second.stderr  # no model loaded
        export = trainer.run(
            [*_one_rank(out, embedded, *steps), "--export"],
            env=_env(),
            timeout=300,
            capture_output=True,
            text=True,
        )
        assert export.returncode != 0
        assert f"is in use by pid {first.pid}" in export.stderr, export.stderr[-2000:]
        assert not (out / "export").exists()

    first = signal_when_ready(
        _one_rank(out, embedded, *steps),
        signal.SIGTERM,
        ready=_a_step_logged(out),
        what="a logged step",
        env=_env(),
        while_ready=while_running,
    )
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-2000:]
    assert "stopped by signal 15" in first.stderr
    steps_logged = [r["step"] for r in _metrics(out)]  # one writer: each step logged once
    assert steps_logged == list(range(len(steps_logged)))
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert saved == [f"step-{steps_logged[-1]:08d}"]  # the step the signal interrupted
    assert not (out / "export").exists()  # a stopped run is not a finished one
    trainer.run(
        [*_one_rank(out, embedded, *steps), "--export"], check=True, env=_env(), timeout=300
    )
    assert (out / "export" / "model.safetensors").is_file()


def test_a_stop_signal_ends_a_step_that_cannot_end_and_saves_it(tmp_path, embedded):
    """A constant reward and many sampling rounds: step 0 could run for hours. SIGTERM (and
    SIGHUP alike) is read between rounds: the step ends on every rank without an update, is
    saved, and the run exits 128 + 15 (it used to be read only at a step's end)."""
    marker = tmp_path / "judged"
    rewards = tmp_path / "constant.py"
    rewards.write_text(
        "from pathlib import Path\n"
        "def score(prompt, response, reference, row):\n"
        f"    Path({str(marker)!r}).touch()\n"
        "    return 1.0\n"
    )
    args = [a for a in embedded if not a.startswith("reward.judge_dir=")]
    out = tmp_path / "run"
    command = _one_rank(
        out,
        args,
        "reward.backend=none",
        f"reward.functions=[{rewards}:score]",
        "rollout.max_sampling_rounds=64",  # the most the config allows
        "num_steps=3",
        "eval.every_steps=0",
    )
    run = signal_when_ready(
        command,
        signal.SIGTERM,
        ready=marker.exists,
        what="a verdict",
        env=_env(),
        exit_timeout_s=120,
    )
    assert run.returncode == 128 + signal.SIGTERM, run.stderr[-2000:]
    assert "stopped by signal 15 during step 0's rollout" in run.stderr
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert saved == ["step-00000000"]
    (record,) = _metrics(out)  # the stopped step's line: what it sampled, no update
    assert record["step"] == 0 and record["dynamic_sampling/is_stopped"] == 1.0
    assert not any(key.startswith("train/") for key in record)


def test_a_stop_signal_inside_a_blocking_score_ends_the_step_and_saves_it(tmp_path, embedded):
    """A reward function that sleeps for an hour (its timeout 600 s): the step waits inside the
    judge's blocking score(). SIGTERM there is read while the judge waits (issue 49): the
    pending reward calls are aborted, the step is saved without its update and the run exits
    128 + 15 within seconds, not after the function's timeout."""
    marker = tmp_path / "judging"
    rewards = tmp_path / "sleepy.py"
    rewards.write_text(
        "import time\n"
        "from pathlib import Path\n"
        "def score(prompt, response, reference, row):\n"
        f"    Path({str(marker)!r}).touch()\n"
        "    time.sleep(3600)\n"
        "    return 1.0\n"
    )
    args = [a for a in embedded if not a.startswith("reward.judge_dir=")]
    out = tmp_path / "run"
    command = _one_rank(
        out,
        args,
        "reward.backend=none",
        f"reward.functions=[{rewards}:score]",
        "reward.function_timeout_s=600",
        "num_steps=3",
        "eval.every_steps=0",
    )
    run = signal_when_ready(
        command,
        signal.SIGTERM,
        ready=marker.exists,
        what="a reward call",
        env=_env(),
        exit_timeout_s=120,
    )
    assert run.returncode == 128 + signal.SIGTERM, run.stderr[-2000:]
    assert run.stopped_s < 30, f"{run.stopped_s:.0f} s from SIGTERM to exit"
    assert "stopped by signal 15 during step 0's rollout" in run.stderr
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert saved == ["step-00000000"]
    (record,) = _metrics(out)
    assert record["step"] == 0 and record["dynamic_sampling/is_stopped"] == 1.0
    assert not any(key.startswith("train/") for key in record)


def test_ctrl_c_saves_and_exits_non_zero(tmp_path, embedded):
    out = tmp_path / "run"
    steps = ("num_steps=1000", "ckpt.every_steps=1000", "eval.every_steps=0")
    run = signal_when_ready(
        _one_rank(out, embedded, *steps),
        signal.SIGINT,
        ready=_a_step_logged(out),
        what="a logged step",
        env=_env(),
    )
    assert run.returncode == 128 + signal.SIGINT, run.stderr[-2000:]
    last = _metrics(out)[-1]["step"]
    assert (out / "checkpoints" / f"step-{last:08d}").is_dir()


STRICT_TEMPLATE = (  # raises on a role other than user/assistant, as Gemma's and Mistral's do
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be user/assistant') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_row_the_strict_chat_template_refuses_is_a_counted_skip_not_a_crash(
    tmp_path, embedded, trainer
):
    """A policy whose chat template raises on an unknown role (Gemma/Mistral style), given
    rows with a 'tool' message: those rows are bad_prompt skips; the run trains on the rest."""
    import shutil

    policy = tmp_path / "strict-policy"
    shutil.copytree(_paths(embedded)["policy"]["model_dir"], policy)
    (policy / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    lines = Path(_paths(embedded)["data"]["path"]).read_text().splitlines()
    rows = [json.loads(line) for line in lines[:32]]
    data = tmp_path / "chat.jsonl"
    with data.open("w") as f:
        for i, row in enumerate(rows):
            messages = [{"role": "user", "content": row["prompt"]}]
            if i % 2:
                messages.insert(0, {"role": "tool", "content": "7"})
            f.write(json.dumps({**row, "prompt": messages}) + "\n")
    kept = [a for a in embedded if a.split("=", 1)[0] not in ("policy.model_dir", "data.path")]
    out = tmp_path / "run"
    args = [f"policy.model_dir={policy}", f"data.path={data}", *kept]
    trainer.run(
        _one_rank(out, args, "num_steps=2", "eval.every_steps=0", "rollout.engine.max_seq_len=96"),
        check=True,
        env=_env(),
        timeout=600,
    )
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1]
    assert records[-1]["data/skipped_rows/bad_prompt"] > 0
    assert all(r["genrm/verdicts"] > 0 for r in records)


def test_the_loaders_size_limits_are_config_fields(tmp_path, embedded):
    from grpo_setup import row_limits

    raw = {**_paths(embedded), "data": {**_paths(embedded)["data"], "max_row_bytes": 200}}
    cfg = grpo_config.build_config(raw)
    assert row_limits(cfg) == {"max_row_bytes": 200, "max_prompt_bytes": None}
    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"prompt": "1+2=", "answer": "3"})
        + "\n"
        + json.dumps({"prompt": "1+2=" + " pad" * 100, "answer": "3"})
        + "\n"
    )
    loader = grpo_config.core.ShardedLoader(
        data, batch_size=1, should_shuffle=False, **row_limits(cfg)
    )
    loader.next_batch(2)
    assert loader.skipped_by_cause()["too_long"] == 1  # the 400-byte line, unread
    with pytest.raises(ValueError, match=r"data\.max_prompt_bytes=-1: must be >= 0"):
        grpo_config.DataConfig(max_prompt_bytes=-1)


def test_a_reward_file_that_exits_while_it_loads_is_a_start_up_error(tmp_path):
    rewards = tmp_path / "exits.py"
    rewards.write_text(
        "import sys\nsys.exit(0)\ndef score(prompt, response, reference, row):\n    return 1.0\n"
    )
    with pytest.raises(ValueError, match=r"reward\.functions: .*exits\.py:score"):
        cfg, _ = grpo_config.read_config(
            [f"out_dir={tmp_path}", "reward.backend=none", f"reward.functions=[{rewards}:score]"]
        )
        grpo_preflight.preflight(cfg)
    with pytest.raises(ValueError, match=r"reward\.function_timeout_s=-1: must be >= 0"):
        grpo_config.RewardConfig(function_timeout_s=-1)


_HANGS_ONCE = """
import time
from collections.abc import Callable
from pathlib import Path

MARKER = Path(__file__).with_suffix(".hung")


def exact(prompt, response, reference, row):
    if not MARKER.exists():  # the first call of the run hangs
        MARKER.touch()
        time.sleep(3600)
    return 1.0 if response.strip() == reference else -1.0
"""


def test_a_reward_function_that_hangs_is_an_error_verdict_after_its_timeout(
    tmp_path, embedded, trainer
):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(_HANGS_ONCE)
    out = tmp_path / "run"
    paths = [arg for arg in embedded if not arg.startswith("reward.judge_dir=")]
    started = time.monotonic()
    trainer.run(
        _one_rank(
            out,
            paths,
            "reward.backend=none",
            f"reward.functions=[{rewards}:exact]",
            "reward.function_timeout_s=2",
            "num_steps=2",
            "eval.every_steps=0",
        ),
        check=True,
        env=_env(),
        timeout=600,
    )
    assert time.monotonic() - started < 400  # not the hour the call sleeps
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["genrm/errors"] >= 1  # the hung call, cut off
    assert (tmp_path / "rewards.hung").exists()


def test_the_default_loss_is_todays_dapo_step_and_several_updates_are_off_policy(embedded):
    cfg = grpo_config.build_config(_paths(embedded))
    # Today's update: DAPO's token-mean loss, clip 0.2 / 0.28, one on-policy step per batch.
    assert (cfg.loss.resolved_clip_low, cfg.loss.resolved_clip_high) == (0.2, 0.28)
    assert cfg.loss.resolved_aggregation == "token_mean"
    assert cfg.loss.is_on_policy and cfg.loss.num_updates_per_batch == 1
    # Only the first of several steps per batch is on-policy: the default turns False.
    raw = {**_paths(embedded), "loss": {"num_mini_batches": 2, "num_epochs": 2}}
    assert not grpo_config.build_config(raw).loss.is_on_policy
    raw["loss"] = {"num_mini_batches": 2, "is_on_policy": True}  # asked for: refused
    with pytest.raises(ValueError, match=r"is_on_policy=True with num_mini_batches=2"):
        grpo_config.build_config(raw)
    # The cosine schedule decays over optimizer steps: 10 steps x 2 x 2 updates = 40.
    raw = {**_paths(embedded), "num_steps": 10, "loss": {"num_mini_batches": 2, "num_epochs": 2}}
    raw["policy"] = {**raw["policy"], "lr_schedule": "cosine"}
    assert _resolved(raw).policy.num_decay_steps == 40


def test_the_dapo_recipe_clips_and_logs_truncation(tmp_path, embedded, trainer):
    # DAPO's 4 mini-batches per rollout batch move the ratio off 1: the clip-higher bound acts.
    out = tmp_path / "dapo"
    result = trainer.run(
        [
            sys.executable,
            str(TRAINER),
            "--config",
            str(ROOT / "examples" / "configs" / "dapo.yaml"),
            f"out_dir={out}",
            *embedded,
            "num_steps=3",
            "eval.every_steps=0",
            "export.dir=''",
        ],
        env=_env(),
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["train/num_optimizer_steps"] == 4 for r in records)
    assert all(0.0 <= r["response/truncated_frac"] <= 1.0 for r in records)
    assert any(r["train/clip_frac_high"] > 0 for r in records)


def test_old_logprobs_from_the_engine_fill_their_defaults_and_refuse_a_correction(embedded):
    raw = {**_paths(embedded), "loss": {"old_logprobs_from": "engine"}}
    loss = grpo_config.build_config(raw).loss
    assert loss.old_logprobs_from == "engine"
    assert not loss.is_on_policy and loss.rollout_correction == "none"
    for given, named in (
        ({"rollout_correction": "token_truncate"}, r"loss\.rollout_correction='token_truncate'"),
        ({"is_on_policy": True}, r"loss\.is_on_policy=True"),
        ({"old_logprobs_from": "vllm"}, r"loss\.old_logprobs_from='vllm'"),
    ):
        raw = {**_paths(embedded), "loss": {"old_logprobs_from": "engine", **given}}
        with pytest.raises(ValueError, match=named):
            grpo_config.build_config(raw)


def test_the_policys_memory_options_are_config_fields(embedded):
    # TorchPolicy's options for large models: a micro-batch cap chosen from free memory
    # (null), activation checkpointing and AdamW's state offloaded to the host.
    args = [
        "policy.max_tokens_per_microbatch=null",
        "policy.gradient_checkpointing=true",
        "policy.should_offload_optimizer=true",
    ]
    raw = _paths(embedded)
    for arg in args:
        raw = grpo_config.with_override(raw, arg)
    policy = _resolved(raw).policy
    assert policy.max_tokens_per_microbatch is None
    assert policy.gradient_checkpointing and policy.should_offload_optimizer
    with pytest.raises(ValueError, match=r"gradient_checkpointing='sometimes'"):
        grpo_config.build_config(
            grpo_config.with_override(raw, "policy.gradient_checkpointing=sometimes")
        )


def test_engine_old_logprobs_are_the_batchs_and_each_epoch_reshuffles(
    tmp_path, embedded, monkeypatch
):
    # One step in this process: old_logprobs_from=engine puts the engine's logprobs in the
    # batch as pi_old, with no trainer forward for them; 2 epochs x 2 mini-batches split with
    # a different seed per epoch.
    import train_grpo

    from yatt import core

    splits: list[dict] = []
    real_split = core.split_mini_batches

    def recording_split(batch, num_mini_batches, **kwargs):
        mask = batch["loss_mask"].bool()
        splits.append(
            {
                "seed": kwargs.get("seed"),
                "is_engine_old": torch.equal(
                    batch["old_logprobs"][mask], batch["rollout_logprobs"][mask]
                ),
                "num_loss_tokens": int(mask.sum()),
            }
        )
        return real_split(batch, num_mini_batches, **kwargs)

    num_logprob_calls = []
    real_logprobs = core.TorchPolicy.logprobs

    def counting_logprobs(self, batch):
        num_logprob_calls.append(len(batch))
        return real_logprobs(self, batch)

    monkeypatch.setattr(core, "split_mini_batches", recording_split)
    monkeypatch.setattr(core.TorchPolicy, "logprobs", counting_logprobs)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads_before = _group_threads()
    code = train_grpo.main(
        [
            f"out_dir={tmp_path}",
            *embedded,
            "num_steps=1",
            "eval.every_steps=0",
            "export.dir=''",
            "data.prompts_per_rank=4",
            "loss.old_logprobs_from=engine",
            "loss.num_mini_batches=2",
            "loss.num_epochs=2",
            "loss.should_reshuffle_epochs=true",
        ]
    )
    assert code == 0
    # The run's process groups went with it: no gloo thread lives on to interpreter exit,
    # where one can abort a finished rank (the policy must not outlive the runtime's shutdown).
    if threads_before is not None:
        assert _group_threads() <= threads_before
    assert len(splits) == 2  # one split per epoch
    assert all(split["is_engine_old"] and split["num_loss_tokens"] > 0 for split in splits)
    assert splits[0]["seed"] is not None and splits[0]["seed"] != splits[1]["seed"]
    assert num_logprob_calls == []  # no old-logprob forward
    record = _metrics(tmp_path)[0]
    assert record["train/num_optimizer_steps"] == 4
    assert "train/is_weight" not in record  # nothing to correct


def test_each_epoch_splits_with_its_own_seed_unless_told_not_to():
    import train_grpo

    from yatt import core

    two = core.PolicyLoss(num_mini_batches=2, num_epochs=2, should_reshuffle_epochs=True)
    seeds = [train_grpo.mini_batch_seed(0, 5, epoch, two) for epoch in range(2)]
    assert None not in seeds and seeds[0] != seeds[1]
    assert train_grpo.mini_batch_seed(0, 5, 0, two) == seeds[0]  # a resumed run splits alike
    assert train_grpo.mini_batch_seed(0, 6, 0, two) != seeds[0]  # another step, another split
    one = core.PolicyLoss(num_mini_batches=2)
    fixed = core.PolicyLoss(num_mini_batches=2, num_epochs=2, should_reshuffle_epochs=False)
    assert train_grpo.mini_batch_seed(0, 5, 0, one) is None  # the best-balanced split
    assert train_grpo.mini_batch_seed(0, 5, 1, fixed) is None


# -- rollout.sampling_mode=stream (placement=partial) ---------------------------------------------


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"rollout": {"sampling_mode": "stream"}}, r"sampling_mode='stream'.*placement='partial'"),
        ({"rollout": {"sampling_mode": "streams"}}, r"rollout\.sampling_mode='streams': use one"),
        (
            {"placement": "partial", "rollout": {"keep_partial": True}},
            r"rollout\.keep_partial=True .* rollout\.sampling_mode='stream'",
        ),
        (
            {
                "placement": "partial",
                "rollout": {"sampling_mode": "stream", "keep_partial": True},
                "loss": {"rollout_correction": "none"},
            },
            r"loss\.rollout_correction='none': resuming aborted responses",
        ),
        (
            {"placement": "partial", "backend": "megatron", "policy": {"tp_size": 2}},
            r"rollout\.sampling_mode='stream': .* model-parallel policy",
        ),
    ],
    ids=["full_placement", "unknown_mode", "keep_partial_in_rounds", "no_correction", "tp2"],
)
def test_stream_settings_are_checked_when_the_config_is_built(embedded, raw, match):
    base = _paths(embedded)
    if raw.get("backend") == "megatron":
        raw = {**raw, "rollout": {"sampling_mode": "stream"}}
    merged = {**base, **raw}
    merged["policy"] = {**base.get("policy", {}), **raw.get("policy", {})}
    with pytest.raises(ValueError, match=match):
        grpo_config.build_config(merged)
    # the default stays rounds, and a stream with the engines resident together is accepted
    assert grpo_config.build_config(base).rollout.sampling_mode == "rounds"
    for placement in ("partial", "separate"):
        stream = {**base, "placement": placement, "rollout": {"sampling_mode": "stream"}}
        assert grpo_config.build_config(stream).rollout.sampling_mode == "stream"


def test_separate_placement_gives_each_ranks_engines_a_gpu_of_their_own(monkeypatch):
    # Rank r trains on GPU r; its engines take GPU r + the ranks on the node (torchrun's
    # LOCAL_WORLD_SIZE). No GPU is touched: the count of visible ones is the only input.
    import grpo_setup
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cuda = torch.device
    assert grpo_setup.engine_device("separate", cuda("cuda", 0)) == "cuda:2"
    assert grpo_setup.engine_device("separate", cuda("cuda", 1)) == "cuda:3"
    for placement in ("full", "partial"):  # the engines share the trainer's GPU
        assert grpo_setup.engine_device(placement, cuda("cuda", 1)) == "cuda:1"
    assert grpo_setup.engine_device("separate", cuda("cpu")) == "cpu"  # the host: one device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)  # two ranks need four GPUs
    with pytest.raises(ValueError, match=r"placement='separate' .* need 4 GPUs, 3 visible"):
        grpo_setup.engine_device("separate", cuda("cuda", 1))
    # a judge given by functions only: separate still holds (the rollout's engine moves)
    reward = grpo_config.RewardConfig(backend="none", rule_weight=1.0)
    functions_only = grpo_config.TrainConfig(policy={}, placement="separate", reward=reward)
    assert functions_only.placement == "separate"
    # vLLM and SGLang pick their GPUs themselves: refused, naming both fields
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    vllm = grpo_config.RolloutConfig(backend="vllm")
    with pytest.raises(ValueError, match=r"placement='separate' with rollout\.backend='vllm'"):
        grpo_config.TrainConfig(policy={}, placement="separate", reward=reward, rollout=vllm)


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.1", "nan"])
def test_rollout_fill_probability_outside_0_1_is_refused_when_the_config_is_read(tmp_path, value):
    with pytest.raises(ValueError, match=r"rollout\.fill_probability="):
        grpo_config.read_config([f"out_dir={tmp_path}", f"rollout.fill_probability={value}"])
    assert not (tmp_path / "embedded").exists()  # refused before the embedded task is built


def test_rollout_fill_probability_defaults_to_null_and_reaches_the_sampler(
    tmp_path, embedded, trainer
):
    assert grpo_config.RolloutConfig().fill_probability is None  # the mean, as before
    # 4 groups per rank at keep rate 1/2 (oversample 2): the mean draws 8 (factor 2); filling
    # with probability 0.9 needs 12: P(Binomial(11, 1/2) >= 4) = 1 - 232/2048 = 0.887,
    # P(Binomial(12, 1/2) >= 4) = 1 - 299/4096 = 0.927. The first draw's factor: 12 / 4.
    args = ("num_steps=1", "rollout.oversample=2", "rollout.max_oversample=4")
    out = tmp_path / "fill"
    trainer.run(
        _one_rank(out, embedded, *args, "rollout.fill_probability=0.9"),
        check=True,
        env=_env(),
        timeout=600,
    )
    (record,) = _metrics(out)
    assert record["dynamic_sampling/oversample_factor"] == 3.0


def test_a_streamed_run_fills_its_batch_and_logs_the_cut_groups(tmp_path, embedded, trainer):
    # 3 prompts drawn per missing group, 8 engine slots: the abort finds groups still queued.
    args = (
        "num_steps=2",
        "placement=partial",
        "rollout.sampling_mode=stream",
        "rollout.keep_partial=true",
        "rollout.oversample=3",
        "rollout.max_oversample=4",
        "rollout.engine.max_batch_size=8",
    )
    out = tmp_path / "stream"
    trainer.run(_one_rank(out, embedded, *args), check=True, env=_env(), timeout=600)
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["dynamic_sampling/num_groups_kept"] == 4  # data.prompts_per_rank: full
        assert r["dynamic_sampling/is_filled_all_ranks"] == 1.0
        assert r["train/num_loss_tokens"] > 0
        for key in ("num_tokens_aborted", "rollout_pending_tokens", "genrm_pending_tokens"):
            assert r[f"dynamic_sampling/{key}"] >= 0
        assert 0 < r["placement/rollout_memory_fraction"] < 1
    first, second = records
    assert first["dynamic_sampling/num_groups_drawn"] == 12  # 4 missing x 3
    # Every drawn group was judged, or cut by the abort (counted), or judged after it.
    judged = first["dynamic_sampling/num_groups_generated"]
    assert judged + first["dynamic_sampling/num_groups_aborted"] <= 12
    # keep_partial: what step 0 cut is what step 1 resumed first.
    kept_partial = first["dynamic_sampling/num_groups_kept_partial"]
    assert kept_partial == first["dynamic_sampling/num_groups_aborted"]
    assert second["dynamic_sampling/num_groups_resumed"] == kept_partial


def test_a_streamed_run_resumed_after_a_step_that_cut_groups_resumes_them(
    tmp_path, embedded, trainer
):
    # The same stream as above: step 0 cuts groups (the abort finds some queued) that step 1
    # resumes; a run stopped after step 0's checkpoint and resumed must do the same.
    args = (
        "placement=partial",
        "rollout.sampling_mode=stream",
        "rollout.keep_partial=true",
        "rollout.oversample=3",
        "rollout.max_oversample=4",
        "rollout.engine.max_batch_size=8",
        "ckpt.async_save=false",
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run = dict(check=True, env=_env(), timeout=600)
    trainer.run(_one_rank(straight, embedded, *args, "num_steps=2"), **run)
    trainer.run(_one_rank(resumed, embedded, *args, "num_steps=1"), **run)  # saves step 0
    trainer.run(_one_rank(resumed, embedded, *args, "num_steps=2", "--resume"), **run)
    expected, got = _metrics(straight), _metrics(resumed)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [0, 1]
    # What a stream's abort cuts depends on thread timing (the engines run beside the loop), so
    # the two runs' step 0 may differ: the resumed run is checked against its own checkpoint.
    num_cut = got[0]["dynamic_sampling/num_groups_kept_partial"]
    assert num_cut > 0, "step 0 cut no group: the test needs one to resume"
    # the checkpoint's cut groups, resumed first (without them: 0), none dropped ...
    assert got[1]["dynamic_sampling/num_groups_resumed"] == num_cut
    assert got[1]["dynamic_sampling/num_partial_groups_dropped_on_resume"] == 0
    assert "dynamic_sampling/num_partial_groups_dropped_on_resume" not in expected[1]
    # ... and its keep rate, the first draw's prior (without it: rollout.oversample, 3). Where
    # both runs' step 0 came out alike, step 1 must too (same groups, same prior, same seeds).
    step0 = [f"dynamic_sampling/{key}" for key in ("num_groups_kept_partial", "keep_rate")]
    if {k: got[0][k] for k in step0} == {k: expected[0][k] for k in step0}:
        keys = ["reward/mean", "reward/accuracy", "train/loss", "train/grad_norm"]
        keys += [f"dynamic_sampling/{key}" for key in ("oversample_factor", "num_groups_resumed")]
        # Equal up to summation order: verdicts come back in thread-timing order, and a mean
        # of the same rewards summed in another order differs in its last bits (seen: 1e-11).
        assert {k: got[1][k] for k in keys} == pytest.approx(
            {k: expected[1][k] for k in keys}, rel=1e-9, abs=1e-12
        )


def test_the_policys_vllm_or_sglang_engine_is_told_the_policys_tp_size(monkeypatch):
    # The adapters check their tensor-parallel size against it before any model loads.
    import importlib.util

    import grpo_setup

    from yatt.rollout import _engine_spec  # rollout.build_engine's adapters, by backend

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    made = []
    for backend in ("vllm", "sglang"):
        monkeypatch.setitem(
            _engine_spec._ENGINE_CLASSES, backend, lambda model_dir, **kwargs: made.append(kwargs)
        )
        section = grpo_config.RolloutConfig(backend=backend)
        grpo_setup.make_engine(section, "model", "cuda:0", policy_tp_size=2)
        grpo_setup.make_engine(section, "judge", "cuda:0")  # a judge shares no policy's batch
    assert [kwargs["policy_tp_size"] for kwargs in made] == [2, None, 2, None]


# -- the config is a leaf (issue 25): values only; preflight checks what they point at ----------
_PARSE_WITHOUT_IO = r"""
import builtins, importlib, importlib.util, io, json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
import grpo_config

calls = []


def recording(name, real):
    def wrapper(*args, **kwargs):
        if is_on:
            calls.append(f"{name}{args[:1]!r}")
        return real(*args, **kwargs)

    return wrapper


is_on = False
for module, names in (
    (builtins, ["open"]),
    (io, ["open"]),
    (os, ["stat", "lstat", "listdir", "scandir", "open", "mkdir", "makedirs"]),
    (os.path, ["exists", "isfile", "isdir", "realpath"]),
    (importlib, ["import_module"]),
    (importlib.util, ["find_spec", "spec_from_file_location"]),
    (tempfile, ["mkdtemp", "mkstemp", "TemporaryDirectory"]),
):
    for name in names:
        setattr(module, name, recording(f"{module.__name__}.{name}", getattr(module, name)))


class RecordingEnviron(type(os.environ)):
    def __getitem__(self, key):
        if is_on:
            calls.append(f"os.environ[{key!r}]")
        return super().__getitem__(key)


os.environ.__class__ = RecordingEnviron
is_on = True
configs = []
for argv in json.loads(sys.argv[2]):  # as read_config does, less argparse's own locale lookups
    raw = {}
    for item in argv:
        raw = grpo_config.with_override(raw, item)
    configs.append(grpo_config.build_config(raw))
is_on = False
print(json.dumps({"calls": calls, "modules": sorted(sys.modules)}))
"""


def test_the_config_module_imports_no_task_and_reads_nothing_while_parsing(tmp_path):
    # Every section, with values that today's checks of the world would read: model folders
    # and a Hub id, splits, a reward file and a module, an API key, wandb, vLLM, an export
    # folder. Parsing them must open, stat, import and read nothing (preflight does that).
    (tmp_path / "rewards.py").write_text("def score(p, r, ref, row):\n    return 1.0\n")
    (tmp_path / "mine").mkdir()
    common = [
        f"out_dir={tmp_path}",
        "task=vision",
        f"policy.model_dir={tmp_path / 'no-policy'}",
        "policy.lr=1e-3",
        f"data.path={tmp_path / 'data'}",
        "data.split=train",
        f"eval.path={tmp_path / 'data'}",
        "eval.split=test",
        "rollout.backend=vllm",
        "rollout.backend_options={gpu_memory_utilization: 0.3}",
        "log.wandb_project=p",
        "export.dir=mine",
        "loss.num_mini_batches=2",
        "ckpt.every_steps=5",
        "overlong.buffer_tokens=1",
    ]
    local_judge = [
        *common,
        "reward.backend=builtin",
        "reward.judge_dir=org/not-cached-judge",
        f"reward.functions=[{tmp_path / 'rewards.py'}:score, os.path:join]",
        "reward.verdict_parser=my_parsers:make",
    ]
    endpoint = [
        *common,
        "reward.backend=openai",
        "reward.openai={base_url: 'http://x/v1', model: m, api_key_env: YATT_TEST_KEY}",
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _PARSE_WITHOUT_IO,
            str(ROOT / "examples"),
            json.dumps([local_judge, endpoint]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**_env(), "YATT_TEST_KEY": "k"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["calls"] == []
    task_modules = [
        name
        for name in seen["modules"]
        if name.split(".")[0] in ("tasks", "tiny_task", "tiny_vision_task", "grpo_preflight")
        or name.startswith("yatt.testing")
    ]
    assert task_modules == []
    assert not (tmp_path / "embedded-vision").exists()


# -- the judge's verdict format is config (issue 25) ----------------------------------------------
def _hand_written_verdicts(overrides: list[str], texts: list[str]) -> tuple[list, list]:
    """The rewards make_scorer's judge gives each of `texts` (the judge's whole output, as a
    fake engine writes it), and the engine's calls."""
    from grpo_setup import make_scorer

    from yatt import genrm
    from yatt.genrm.testing import FakeJudgeEngine

    cfg, _ = grpo_config.read_config(["reward.verdict_from=text", *overrides])
    grpo_preflight.check_reward(cfg.reward)
    outputs = iter(texts)
    engine = FakeJudgeEngine(judge=lambda prompt, vote: next(outputs))
    scorer, _ = make_scorer(cfg.reward, engine)
    samples = [genrm.Sample(prompt="2+2=", response="4", reference="4") for _ in texts]
    return scorer.score(samples), engine.calls


def test_a_judge_with_another_verdict_format_is_a_config_change(tmp_path, monkeypatch):
    texts = ["Score: 7", "Correct", "Verdict: Yes"]
    default, calls = _hand_written_verdicts([], texts)
    # Today's yes/no parser: only the last reads as a verdict; a 4-token budget.
    assert [v.status for v in default] == ["unparsable", "unparsable", "ok"]
    assert default[2].reward == 1.0
    assert calls[0].sampling.max_new_tokens == 4
    # "Score: N" on a 1..10 scale is (N - 1) / 9; the budget is the config's.
    scored, calls = _hand_written_verdicts(
        ["reward.verdict_parser=score", "reward.verdict_max_tokens=64"], ["Score: 7"]
    )
    assert scored[0].status == "ok" and scored[0].reward == pytest.approx(6 / 9)
    assert calls[0].sampling.max_new_tokens == 64
    # Other labels: "Correct" is +1 and "Incorrect" -1, "Yes" is no verdict any more.
    labels = "reward.verdict_parser_options={yes_label: Correct, no_label: Incorrect}"
    relabelled, _ = _hand_written_verdicts([labels], ["Correct", "Incorrect", "Yes"])
    assert [v.reward for v in relabelled[:2]] == [1.0, -1.0]
    assert relabelled[2].status == "unparsable"
    # A parser of the user's own, by "file.py:name": here a 0..5 scale, 4 -> 0.8.
    (tmp_path / "my_parsers.py").write_text(
        "from yatt.genrm import ScoreParser\n\n\ndef make():\n    return ScoreParser(low=0, high=5)\n"
    )
    spec = f"reward.verdict_parser={tmp_path / 'my_parsers.py'}:make"
    own, _ = _hand_written_verdicts([spec], ["Score: 4"])
    assert own[0].reward == pytest.approx(0.8)
    monkeypatch.syspath_prepend(str(tmp_path))  # and by "module:name"
    own, _ = _hand_written_verdicts(["reward.verdict_parser=my_parsers:make"], ["Score: 4"])
    assert own[0].reward == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["reward.verdict_parser=yesno"], r"reward\.verdict_parser='yesno': use one of"),
        (["reward.verdict_parser=3"], r"reward\.verdict_parser=3: must be a str"),
        (
            ["reward.verdict_parser=score", "reward.verdict_parser_options={lo: 0}"],
            r"reward\.verdict_parser_options=\{'lo': 0\}: .*'lo'",
        ),
        (
            ["reward.verdict_parser_options={low: 5, high: 1}", "reward.verdict_parser=score"],
            r"reward\.verdict_parser_options=.*low=5.*high=1",
        ),
        (
            ["reward.verdict_parser=a.b:make", "reward.verdict_parser_options={low: 0}"],
            r"reward\.verdict_parser_options=.*only for reward\.verdict_parser in",
        ),
        (["reward.verdict_parser_options=[1]"], r"reward\.verdict_parser_options=\[1\]: a mapping"),
        (["reward.verdict_max_tokens=0"], r"reward\.verdict_max_tokens=0: must be >= 1"),
        (["reward.verdict_max_tokens=1e9"], r"reward\.verdict_max_tokens=1000000000: must be <="),
        (
            ["reward.verdict_parser=score", "reward.verdict_from=label_logprobs"],
            r"reward\.verdict_from='label_logprobs' .* reward\.verdict_parser='score'",
        ),
    ],
)
def test_bad_verdict_format_values_name_their_field(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        grpo_config.read_config([f"out_dir={tmp_path}", *overrides])


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_parsers:make", r"reward\.verdict_parser='no_such_parsers:make': .*No module"),
        ("os.path:no_such_name", r"reward\.verdict_parser='os\.path:no_such_name': .*no_such"),
        ("os:getcwd", r"reward\.verdict_parser='os:getcwd' gives a str, not a verdict parser"),
    ],
)
def test_a_verdict_parser_that_does_not_load_is_a_preflight_error(tmp_path, spec, match):
    cfg, _ = grpo_config.read_config([f"out_dir={tmp_path}", f"reward.verdict_parser={spec}"])
    with pytest.raises(ValueError, match=match):
        grpo_preflight.preflight(cfg)
    assert not (tmp_path / "embedded").exists()  # refused before the embedded task is built


# -- the judge's call batching is config ------------------------------------------------------------
def test_judge_batching_is_config_checked_before_anything_loads(tmp_path):
    from grpo_setup import make_scorer

    from yatt import genrm
    from yatt.genrm.testing import FakeJudgeEngine

    base = [f"out_dir={tmp_path}", "reward.verdict_from=text"]
    cfg, _ = grpo_config.read_config([*base, "reward.batching={batch_window_millis: 150}"])
    engine = FakeJudgeEngine(judge=lambda prompt, vote: "Yes")
    scorer, _ = make_scorer(cfg.reward, engine)
    # the judge's engine calls wait 150 ms for more verdicts; the other fields keep GenRM's
    assert scorer.batching.batch_window_millis == 150.0
    assert scorer.batching.max_batch_size == genrm.BatchingConfig().max_batch_size
    default, _ = grpo_config.read_config(base)
    assert make_scorer(default.reward, engine)[0].batching == genrm.BatchingConfig()
    for override, match in [
        ("reward.batching={max_batch_size: 0}", r"reward\.batching: .*max_batch_size"),
        ("reward.batching={window_ms: 3}", r"reward\.batching=.*window_ms"),
        ("reward.batching=8", r"reward\.batching=8: a mapping"),
    ]:
        with pytest.raises(ValueError, match=match):
            grpo_config.read_config([*base, override])
    with pytest.raises(ValueError, match=r"reward\.batching=.*local judge engine"):
        grpo_config.read_config(
            [
                *base,
                "reward.backend=none",
                "reward.rule_weight=1.0",
                "reward.batching={max_pending: 8}",
            ]
        )


def test_a_lora_run_trains_syncs_the_adapter_and_checkpoints_and_exports_it_alone(
    tmp_path, embedded, trainer
):
    """Issue 45: policy.lora with a KL term builds no frozen copy (the base under the disabled
    adapter is the reference), the built-in engine serves the synced adapter (its logprobs
    are the policy's, so the rollout mismatch stays at float32 rounding), the checkpoint holds
    only the adapter, and --export writes the merged folder and the PEFT adapter."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    args = (
        *embedded,
        "policy.lora.rank=8",
        "policy.lora.alpha=16",
        "policy.lr=2e-2",
        "loss.kl_coef=0.05",
        "num_steps=3",
        "data.prompts_per_rank=4",
    )
    trainer.run(
        [sys.executable, str(TRAINER), f"out_dir={out}", *args],
        check=True,
        env=_env(),
        timeout=600,
    )
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    # the reference is the starting policy: no divergence before the first update, some after
    assert records[0]["train/kl"] == 0.0 and records[2]["train/kl"] > 0.0
    # pi (trainer, adapter on) vs the engine's sampling logprobs: equal within float32 rounding
    # on every step, the steps after an adapter sync included
    assert all(r["train/rollout_mismatch"] < 1e-4 for r in records)
    from torch.distributed.checkpoint import FileSystemReader

    step_dir = out / "checkpoints" / "step-00000002"
    saved = list(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)
    model_keys = [k for k in saved if k.startswith("model.")]
    assert any(".lora_A." in k for k in model_keys) and any(".lora_B." in k for k in model_keys)
    assert all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys  # no base
    exported = load_file(out / "export" / "model.safetensors")
    assert not any("lora" in k for k in exported)  # merged under the base's names
    adapter = out / "export" / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    trainer.run(
        [sys.executable, str(TRAINER), "--export", f"out_dir={out}", *args],
        check=True,
        env=_env(),
        timeout=300,
    )
    again = load_file(out / "export" / "model.safetensors")
    assert again.keys() == exported.keys()
    assert all(torch.allclose(exported[k], again[k], atol=1e-6) for k in exported)
    initial = load_file(Path(_paths(embedded)["policy"]["model_dir"]) / "model.safetensors")
    assert any(not torch.equal(initial[k], exported[k]) for k in exported)  # it trained


def test_lora_with_a_vllm_or_sglang_rollout_gets_an_engine_that_serves_it(tmp_path):
    """policy.lora with vLLM/SGLang: the engine's options gain what its LoRA API needs; a LoRA
    it cannot serve is refused before anything loads."""
    cfg = grpo_preflight.with_lora_engine(
        _read_config(tmp_path, "policy.lora.rank=12", "rollout.backend=vllm")
    )
    assert cfg.rollout.backend_options == {"enable_lora": True, "max_lora_rank": 16}
    cfg = grpo_preflight.with_lora_engine(
        _read_config(tmp_path, "policy.lora.rank=12", "rollout.backend=sglang")
    )
    assert cfg.rollout.backend_config().lora_target_modules == ("all",)
    assert cfg.rollout.backend_config().max_lora_rank == 12
    with pytest.raises(ValueError, match=r"policy.lora.modules_to_save=\['lm_head'\] with vllm"):
        grpo_preflight.with_lora_engine(
            _read_config(
                tmp_path,
                "policy.lora.rank=8",
                "policy.lora.modules_to_save=[lm_head]",
                "rollout.backend=vllm",
            )
        )
    builtin = _read_config(tmp_path, "policy.lora.rank=8")
    assert grpo_preflight.with_lora_engine(builtin) is builtin
    # The built-in engine serving the adapter beside its weights makes its buffers with them:
    # it is given the adapter's rank and targets (its first compile then holds the adapter).
    beside = grpo_preflight.with_lora_engine(
        _read_config(
            tmp_path,
            "policy.lora.rank=8",
            "policy.lora.target_modules=[q_proj,v_proj]",
            "policy.lora.modules_to_save=[lm_head]",
            "rollout.engine.lora_mode=beside",
        )
    )
    assert beside.rollout.engine.max_lora_rank == 8
    assert beside.rollout.engine.lora_target_modules == ("q_proj", "v_proj")
    assert beside.rollout.engine.lora_modules_to_save == ("lm_head",)
    with pytest.raises(ValueError, match=r"rollout.engine.max_lora_rank=4 is below policy.lora"):
        grpo_preflight.with_lora_engine(
            _read_config(
                tmp_path,
                "policy.lora.rank=8",
                "rollout.engine.lora_mode=beside",
                "rollout.engine.max_lora_rank=4",
            )
        )
    full = _read_config(tmp_path, "rollout.backend=vllm")
    assert grpo_preflight.with_lora_engine(full) is full


def _read_config(tmp_path: Path, *overrides: str) -> grpo_config.TrainConfig:
    cfg, _ = grpo_config.read_config([f"out_dir={tmp_path}", *overrides])
    return cfg
