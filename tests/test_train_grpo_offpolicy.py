"""Off-policy steps in the reference trainer (issue 48, rollout.max_staleness) on the CPU with
the embedded task: refusals before any model loads, runs at s = 1 and 2 that stay inside the
bound (every token's age from the version stamped on it, counted by the trainer's own metrics),
and a crash (in process, and SIGKILL of a real process) whose --resume handles every prompt the
loader gave out exactly once: taken by the trainer before the checkpoint, or after the resume,
or still in flight at the end; none skipped, none twice.

Expected values come from the rule, not the code: admission (AReaL's n < (w + s + 1) P) means
no token is older than s when it is trained; the loader's own sequence of rows (a fresh loader,
same seed) is the list every prompt must appear in once."""

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
sys.path.insert(0, str(Path(__file__).parent))  # _offpolicy_runs

import grpo_config
import train_grpo
from _offpolicy_runs import RecordingRollout, loader_rows, train_in_process

from yatt import core
from yatt.testing import free_port

P = 4  # prompts per step and rank
OFFPOLICY = ("placement=partial", f"data.prompts_per_rank={P}", "eval.every_steps=0")


@pytest.fixture(scope="module")
def embedded(embedded_task) -> list[str]:
    """The embedded task (built once per session, conftest.py); runs point at it."""
    paths = embedded_task
    return [
        "task=text",
        f"policy.model_dir={paths['policy']}",
        f"data.path={paths['prompts']}",
        f"reward.judge_dir={paths['judge']}",
    ]


@pytest.fixture(scope="module")
def small_data(embedded, tmp_path_factory) -> list[str]:
    """The task with 16 rows: a run of a few steps crosses an epoch."""
    source = Path(next(a for a in embedded if a.startswith("data.path=")).split("=", 1)[1])
    path = tmp_path_factory.mktemp("small") / "prompts.jsonl"
    path.write_text("".join(source.read_text().splitlines(keepends=True)[:16]))
    return [a if not a.startswith("data.path=") else f"data.path={path}" for a in embedded]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _config(*overrides: str) -> grpo_config.TrainConfig:
    return grpo_config.config_from_args(train_grpo.parse_args(list(overrides)))


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        pytest.param(("rollout.max_staleness=-1",), r"rollout\.max_staleness=-1: must be an int >= 0", id="negative"),
        pytest.param(("placement=full",), r"rollout\.max_staleness=1 with placement='full'", id="full"),
        pytest.param(("loss.rollout_correction=none",), r"rollout\.max_staleness=1 with loss\.rollout_correction='none'", id="no-correction"),
        pytest.param(("loss.old_logprobs_from=engine", "loss.rollout_correction=none", "loss.is_on_policy=false"), r"rollout\.max_staleness=1 with loss\.rollout_correction='none'", id="engine-logprobs"),
        pytest.param(("rollout.sampling_mode=stream",), r"rollout\.max_staleness=1 with rollout\.sampling_mode='stream'", id="stream"),
        pytest.param(("rollout.sampling_mode=stream", "rollout.keep_partial=true"), r"rollout\.max_staleness=1 with rollout\.keep_partial=True", id="keep-partial"),
    ],
)  # fmt: skip
def test_combinations_that_cannot_hold_are_refused_naming_both_fields(embedded, overrides, match):
    cfg = _config(*embedded, *OFFPOLICY, "rollout.max_staleness=1", *overrides)
    with pytest.raises(ValueError, match=match):
        train_grpo.check_offpolicy(cfg)


def test_a_policy_backend_without_versions_is_refused_and_multiturn_is_not(embedded):
    cfg = _config(*embedded, *OFFPOLICY, "rollout.max_staleness=2")
    train_grpo.check_offpolicy(cfg)  # the defaults hold
    cfg.rollout.tools = ["my_tools.py:search"]
    train_grpo.check_offpolicy(cfg)  # multi-turn: each turn stamped with its version
    cfg.rollout.tools = []
    cfg.backend = "megatron"
    with pytest.raises(ValueError, match=r"max_staleness=2 with backend='megatron'"):
        train_grpo.check_offpolicy(cfg)
    cfg.backend = "torch"
    cfg.rollout.max_staleness = 0  # on-policy: anything goes
    cfg.placement = "full"
    train_grpo.check_offpolicy(cfg)


def test_a_refusal_exits_2_before_any_model_loads(tmp_path, embedded, trainer):
    result = trainer.run(
        [sys.executable, str(TRAINER), f"out_dir={tmp_path}", *embedded, "rollout.max_staleness=1"],
        env=_env(),
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "rollout.max_staleness=1 with placement='full'" in result.stderr
    assert "loading the policy" not in result.stderr


# -- runs within the bound --------------------------------------------------------------------
NUM_STEPS = 8


@pytest.mark.parametrize(
    ("s", "placement"), [(1, "partial"), (2, "partial"), (1, "separate")]
)  # fmt: skip
def test_a_run_stays_within_the_bound_and_learns(tmp_path, embedded, trainer, s, placement):
    # placement=separate: the engines on a GPU of their own on a GPU machine; on the host the
    # same wiring (its plan, every role resident, the weights pushed each step) on the CPU
    out = tmp_path / f"s{s}"
    args = [*embedded, *OFFPOLICY, f"rollout.max_staleness={s}", f"num_steps={NUM_STEPS}"]
    args.append(f"placement={placement}")
    trainer.run(
        [sys.executable, str(TRAINER), f"out_dir={out}", *args], check=True, env=_env(), timeout=600
    )
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(NUM_STEPS))
    for r in records:
        assert r["offpolicy/tokens_over_bound"] == 0.0, r["step"]
        assert f"offpolicy/tokens_age_{s + 1}" not in r  # keys for ages 0..s only
        ages = [r[f"offpolicy/tokens_age_{a}"] for a in range(s + 1)]
        assert sum(ages) == r["train/num_loss_tokens"] > 0
        # no token is older than the steps run so far
        assert all(n == 0 for a, n in enumerate(ages) if a > r["step"]), r["step"]
        assert r["offpolicy/is_resident"] == 1.0  # the host: every role resident together
        assert r["placement/is_separate"] == float(placement == "separate")
        for a in range(s + 1):  # pi_prox / pi_behaviour, truncated at the cap
            if r[f"offpolicy/tokens_age_{a}"]:
                assert 0.0 < r[f"offpolicy/is_weight_mean_age_{a}"] <= 2.0
    # step 0 is on-policy (nothing was older); generation runs ahead: tokens s versions old
    assert records[0]["offpolicy/tokens_age_0"] == records[0]["train/num_loss_tokens"]
    assert sum(r[f"offpolicy/tokens_age_{s}"] for r in records) > 0
    assert records[-1]["offpolicy/age_mean"] > 0.5
    first = sum(r["reward/mean"] for r in records[:3]) / 3
    last = sum(r["reward/mean"] for r in records[-3:]) / 3
    assert last > first, (first, last)


def test_a_lora_run_stays_within_the_bound(tmp_path, embedded, trainer):
    # policy.lora: each step pushes the adapter alone (the built-in engine merges it into its
    # copy of the base) while the workers generate; the decoupled objective as with full weights
    out = tmp_path / "lora"
    args = [*embedded, *OFFPOLICY, "rollout.max_staleness=1", "num_steps=4", "policy.lora.rank=8"]
    trainer.run(
        [sys.executable, str(TRAINER), f"out_dir={out}", *args], check=True, env=_env(), timeout=600
    )
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records:
        assert r["offpolicy/tokens_over_bound"] == 0.0, r["step"]
        ages = r["offpolicy/tokens_age_0"] + r["offpolicy/tokens_age_1"]
        assert ages == r["train/num_loss_tokens"] > 0
    # step 0: the engine samples with the adapter the trainer holds (pi_prox / pi_behaviour = 1)
    assert records[0]["offpolicy/is_weight_mean_age_0"] == pytest.approx(1.0, abs=1e-3)
    assert sum(r["offpolicy/tokens_age_1"] for r in records) > 0
    assert (out / "export" / "adapter").is_dir()  # the adapter alone, in PEFT's format


# -- a crash and a resume: every prompt once ---------------------------------------------------
def test_a_crash_then_resume_handles_every_prompt_once(tmp_path, small_data, monkeypatch):
    monkeypatch.setattr(core, "AsyncRollout", RecordingRollout)
    RecordingRollout.instances = []
    out = tmp_path / "run"
    args = [
        f"out_dir={out}", *small_data, *OFFPOLICY, "rollout.max_staleness=1", "num_steps=8",
        "ckpt.every_steps=2", "ckpt.async_save=false",
    ]  # fmt: skip
    crash_step = 3  # after step 2's checkpoint committed (steps 2, 4, 6 are due)
    real_train_on_batch = train_grpo.train_on_batch

    def crashing(batch, **kwargs):
        if kwargs["step"] == crash_step:
            raise RuntimeError("planted crash")
        return real_train_on_batch(batch, **kwargs)

    monkeypatch.setattr(train_grpo, "train_on_batch", crashing)
    with pytest.raises(RuntimeError, match="planted crash"):
        train_in_process(*args)
    assert (out / "checkpoints" / f"step-{crash_step - 1:08d}").is_dir()
    monkeypatch.setattr(train_grpo, "train_on_batch", real_train_on_batch)
    assert train_in_process(*args, should_resume=True) == 0

    crashed, resumed = RecordingRollout.instances
    # what the checkpoint stands for: the rows taken by the end of its step
    committed = crashed.taken[: crashed.taken_before_version[crash_step]]  # 0..crash_step - 1
    assert resumed.requeued, "the checkpoint held no prompt in flight"
    handled = committed + resumed.taken + resumed.rows_in_flight()
    assert len(handled) > 16  # the run crossed an epoch of the 16 rows
    cfg = _config(*args)
    assert sorted(handled) == sorted(loader_rows(cfg, len(handled)))
    # the re-queued prompts were trained (taken) by the resumed run, not left in flight
    for row in set(resumed.requeued):
        assert resumed.taken.count(row) >= resumed.requeued.count(row), row
    records = {r["step"]: r for r in _metrics(out)}
    assert sorted(records) == list(range(8))
    assert records[crash_step]["offpolicy/num_requeued"] == len(resumed.requeued)


NUM_KILLED_STEPS = 40  # about 10 s on a CPU: killed well before its end


def _assert_within_the_bound(records) -> None:
    """Over a long run a group can finish after later ones (threads, joined engine calls) and
    be trained a step late, over the bound: counted, and rare. A resume that lost track of
    the versions or the slots puts most tokens over it, step after step (as a stopped step
    did before admission counted its unconsumed slots)."""
    records = list(records)
    over = sum(r["offpolicy/tokens_over_bound"] for r in records)
    total = sum(r["train/num_loss_tokens"] for r in records)
    assert over <= 0.05 * total, (over, total)
    assert sum(r["offpolicy/tokens_over_bound"] > 0 for r in records) <= len(records) // 10


def test_sigkill_mid_run_then_resume_finishes_within_the_bound(tmp_path, small_data, trainer):
    out = tmp_path / "killed"
    args = [
        sys.executable, str(TRAINER), f"out_dir={out}", *small_data, *OFFPOLICY,
        "rollout.max_staleness=1", f"num_steps={NUM_KILLED_STEPS}", "ckpt.every_steps=2",
        "ckpt.async_save=false",
    ]  # fmt: skip
    proc = subprocess.Popen(args, env=_env(), start_new_session=True)
    committed = out / "checkpoints" / "step-00000004"
    deadline = time.monotonic() + 300
    while not committed.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    is_running = proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert committed.is_dir(), "the run never committed step 4"
    assert is_running, "the run ended before it was killed"
    trainer.run([*args, "--resume"], check=True, env=_env(), timeout=600)  # a fork: no imports
    records = {r["step"]: r for r in _metrics(out)}
    assert sorted(records) == list(range(NUM_KILLED_STEPS))
    first = min(step for step in records if step > 4)
    assert records[first]["offpolicy/num_requeued"] > 0  # in-flight prompts restarted
    _assert_within_the_bound(records.values())


def test_sigterm_saves_the_step_in_progress_and_resume_finishes(tmp_path, small_data, trainer):
    # A step stopped mid-rollout puts its taken groups back in flight (put_back) and its
    # unconsumed slots are counted (finish_step(0)), so the saved checkpoint holds them and
    # the resumed run stays within the bound; the resumed run trains every step.
    out = tmp_path / "stopped"
    args = [
        sys.executable, str(TRAINER), f"out_dir={out}", *small_data, *OFFPOLICY,
        "rollout.max_staleness=2", f"num_steps={NUM_KILLED_STEPS}", "ckpt.every_steps=2",
        "ckpt.async_save=false",
    ]  # fmt: skip
    proc = subprocess.Popen(args, env=_env(), start_new_session=True)
    committed = out / "checkpoints" / "step-00000002"
    deadline = time.monotonic() + 300
    while not committed.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it was stopped"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    trainer.run([*args, "--resume"], check=True, env=_env(), timeout=600)  # a fork: no imports
    records = {r["step"]: r for r in _metrics(out)}
    assert sorted(records) == list(range(NUM_KILLED_STEPS))
    stopped = [r for r in records.values() if "offpolicy/tokens_over_bound" not in r]
    # a signal during a rollout: that step's line has no update; during training or a save:
    # the step ends and is saved as usual
    assert len(stopped) <= 1
    _assert_within_the_bound(r for r in records.values() if r not in stopped)


def test_without_room_on_the_device_the_phases_run_with_the_workers_paused(
    tmp_path, small_data, monkeypatch
):
    # A GPU without room for all three roles: today's partial-colocation phases, the workers
    # paused while the trainer's phases put the engines to sleep (forced here on the host).
    monkeypatch.setattr(train_grpo, "is_offpolicy_resident", lambda device: False)
    out = tmp_path / "phases"
    args = [f"out_dir={out}", *small_data, *OFFPOLICY, "rollout.max_staleness=1", "num_steps=4"]
    assert train_in_process(*args) == 0
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["offpolicy/is_resident"] == 0.0 for r in records)
    assert all(r["offpolicy/tokens_over_bound"] == 0.0 for r in records)
    assert "placement/train/switch_s" in records[-1]  # the trainer's phases ran
    assert sum(r["offpolicy/tokens_age_1"] for r in records) > 0


def test_two_ranks_each_drive_their_own_rollout(tmp_path, embedded):
    # One controller per rank: each its own worker threads, admission and in-flight prompts;
    # the metrics summed over the ranks (2 x P groups of 8 samples of 2 tokens a step).
    out = tmp_path / "ranks"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={free_port()}", str(TRAINER), f"out_dir={out}", *embedded, *OFFPOLICY,
        "rollout.max_staleness=1", "num_steps=4", "ckpt.every_steps=2",
    ]  # fmt: skip
    subprocess.run(command, check=True, env=_env(), timeout=600)
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records:
        ages = r["offpolicy/tokens_age_0"] + r["offpolicy/tokens_age_1"]
        assert ages == r["train/num_loss_tokens"] > 0
    assert records[0]["offpolicy/tokens_age_1"] == 0  # nothing older than step 0
    assert sum(r["offpolicy/tokens_age_1"] for r in records) > 0
    assert (out / "checkpoints" / "step-00000002").is_dir()
