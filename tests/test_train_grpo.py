"""The reference trainer end to end on 2 CPU ranks (gloo): both placement modes, checkpoints,
and exact resume after a kill."""

NUM_GPUS = 0

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "train_grpo.py"
sys.path.insert(0, str(ROOT / "examples"))

import tiny_task

from yatt.testing import free_port


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> list[str]:
    """The embedded task built once; runs point at it with overrides."""
    workdir = tmp_path_factory.mktemp("embedded")
    subprocess.run([sys.executable, str(TRAINER), f"out_dir={workdir}", "num_steps=0"], check=True)
    paths = tiny_task.prepare(workdir / "embedded", None)
    return [
        f"policy.model_dir={paths['policy']}",
        f"data.path={paths['prompts']}",
        f"reward.judge_dir={paths['judge']}",
    ]


def _command(out_dir: Path, embedded: list[str], *args: str, nproc: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        str(TRAINER),
        f"out_dir={out_dir}",
        "data.prompts_per_rank=4",
        *embedded,
        *args,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("placement", ["full", "partial"])
def test_two_ranks_train_and_checkpoint(tmp_path, embedded, placement):
    out = tmp_path / placement
    subprocess.run(
        _command(out, embedded, "num_steps=3", f"placement={placement}", "ckpt.every_steps=2"),
        check=True,
        env=_env(),
        timeout=600,
    )
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert -1.0 <= r["reward/mean"] <= 1.0
        assert 0.0 <= r["reward/accuracy"] <= 1.0
        assert r["train/num_loss_tokens"] > 0 or r["train/is_skipped"] == 1.0
    phase = "rollout" if placement == "partial" else "genrm"
    assert f"placement/{phase}/switch_s" in records[-1]
    assert (out / "checkpoints" / "step-00000002").is_dir()
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_after_kill_matches_an_uninterrupted_run(tmp_path, embedded):
    keys = ("reward/mean", "reward/accuracy", "train/loss", "train/grad_norm")
    steps = ("num_steps=6", "ckpt.every_steps=3", "ckpt.async_save=false")
    straight = tmp_path / "straight"
    subprocess.run(_command(straight, embedded, *steps), check=True, env=_env(), timeout=600)

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
    expected = {r["step"]: r for r in _metrics(straight)}
    assert sorted(resumed) == sorted(expected) == list(range(6))
    for step in (4, 5):  # the steps after the checkpoint, recomputed by the resumed run
        assert {k: resumed[step][k] for k in keys} == {k: expected[step][k] for k in keys}


@pytest.mark.parametrize("config", sorted((ROOT / "examples" / "configs").glob("*.yaml")), ids=str)
def test_shipped_configs_use_only_known_keys(config, embedded, tmp_path):
    import yaml

    sys.path.insert(0, str(TRAINER.parent))
    import train_grpo

    raw = yaml.safe_load(config.read_text())
    raw.setdefault("policy", {})["model_dir"] = embedded[0].split("=", 1)[1]
    for section in ("rollout", "reward"):
        engine = raw.get(section, {}).get("engine", {})
        engine.pop("device", None)  # the trainer picks the rank's device
    cfg = train_grpo.core.config_from_dict(train_grpo.TrainConfig, raw)
    assert cfg.placement in ("full", "partial")
    with pytest.raises(ValueError, match=r"unknown config key 'rollout\.temprature'"):
        train_grpo.core.config_from_dict(
            train_grpo.TrainConfig, {**raw, "rollout": {"temprature": 1}}
        )


def test_unknown_rollout_backend_is_a_clear_error():
    sys.path.insert(0, str(TRAINER.parent))
    import train_grpo

    with pytest.raises(ValueError, match=r"rollout\.backend='tgi'"):
        train_grpo.make_engine(train_grpo.RolloutConfig(backend="tgi"), "unused", "cpu")
