"""The multi-turn rollout kind on two gloo ranks (the per-rank controller: each rank runs its own
environments, no driver between them), and a killed multi-turn run resumed from its checkpoint
recomputing the same steps as an uninterrupted one. The embedded tools task
(examples/tasks/tools_task.py) is the environment: `guess` is its tool."""

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

from tasks import tools_task

from yatt.testing import free_port

pytestmark = pytest.mark.slow

_STEPS = ("num_steps=3", "ckpt.every_steps=2")
# Numbers a resumed run must recompute exactly: its rollouts (seeded per step and rank) and its
# environments' rewards.
_EXACT = (
    "reward/mean",
    "dynamic_sampling/multiturn/num_tool_calls",
    "dynamic_sampling/multiturn/turns_mean",
)
# The update's numbers to float32 rounding: tool replies arrive at times of their own, so the
# engine's continuous batches hold different requests from run to run, and float32 kernels
# over batches of other shapes round the engine's logprobs (the loss's pi_old) differently in
# the last bits (seen: 7e-9 relative, with the same sampled tokens).
_CLOSE = ("train/loss", "train/grad_norm")


@pytest.fixture(scope="module")  # module fixtures (a two-rank run) take it
def task(tools_task_paths) -> dict[str, Path]:
    return tools_task_paths  # built once per session (tests/conftest.py)


def _command(out_dir: Path, task: dict[str, Path], *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(TRAINER),
        "task=tools",
        f"out_dir={out_dir}",
        f"policy.model_dir={task['policy']}",
        f"data.path={task['prompts']}",
        "data.prompts_per_rank=2",
        *args,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _metrics(out_dir: Path) -> dict[int, dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, task) -> Path:
    out = tmp_path_factory.mktemp("two_ranks")
    subprocess.run(_command(out, task, *_STEPS), check=True, env=_env(), timeout=900)
    return out


def test_two_ranks_run_their_own_environments_and_train(two_rank_run):
    records = _metrics(two_rank_run)
    assert sorted(records) == [0, 1, 2]
    prefix = "dynamic_sampling/multiturn/"
    for record in records.values():
        # Both ranks' trajectories are counted: 2 ranks x 2 prompts x the group size, or more.
        group_size = record.get("dynamic_sampling/group_size", 8)
        assert record[prefix + "num_trajectories"] >= 2 * 2 * group_size
        assert record[prefix + "num_tool_calls"] > 0
        assert 1.0 <= record[prefix + "turns_mean"] <= tools_task.MAX_TURNS
        assert record["train/grad_norm"] > 0
    checkpoints = sorted(p.name for p in (two_rank_run / "checkpoints").glob("step-*"))
    assert checkpoints, "ckpt.every_steps=2 wrote no checkpoint"


def test_a_killed_multiturn_run_resumes_to_the_uninterrupted_runs_numbers(
    tmp_path, task, two_rank_run
):
    killed = tmp_path / "killed"
    steps = (*_STEPS, "ckpt.async_save=false")
    proc = subprocess.Popen(_command(killed, task, *steps), env=_env(), start_new_session=True)
    committed = killed / "checkpoints" / "step-00000002"  # after steps 0 and 1
    deadline = time.monotonic() + 600
    while not committed.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-run
    proc.wait()
    assert committed.is_dir(), "the run never committed its first two steps"

    subprocess.run(_command(killed, task, *steps, "--resume"), check=True, env=_env(), timeout=900)
    resumed, expected = _metrics(killed), _metrics(two_rank_run)
    assert sorted(resumed) == sorted(expected) == [0, 1, 2]
    for step in (2,):  # recomputed by the resumed run from the checkpoint after step 1
        assert {k: resumed[step][k] for k in _EXACT} == {k: expected[step][k] for k in _EXACT}
        for key in _CLOSE:
            assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-5), key


def test_two_ranks_stream_trajectories_to_a_resident_judge_and_cut_the_tail(tmp_path, task):
    # placement=partial, rollout.sampling_mode=stream: each rank's trajectories judged as they
    # end (genrm.TrajectoryStream); over-sampled 2x, so once both ranks are full (collective
    # should_abort) the trajectories still running are cut and counted.
    judge = tools_task.build_format_judge(tmp_path / "judge")
    out = tmp_path / "stream"
    args = (
        "num_steps=2",
        "placement=partial",
        "rollout.sampling_mode=stream",
        "rollout.samples_per_prompt=4",
        "rollout.oversample=2",
        "rollout.max_oversample=2",
        "reward.backend=builtin",
        f"reward.judge_dir={judge}",
        f"reward.judge_template={tools_task.FORMAT_JUDGE_TEMPLATE}",
        "reward.engine.max_seq_len=4096",
        "data.answer_key=secret",
    )
    subprocess.run(_command(out, task, *args), check=True, env=_env(), timeout=900)
    records = _metrics(out)
    assert sorted(records) == [0, 1]
    prefix = "dynamic_sampling/"
    for record in records.values():
        assert record[prefix + "is_filled_all_ranks"] == 1.0
        assert record[prefix + "num_groups_kept"] == 2  # data.prompts_per_rank, per rank
        # every group drawn was kept, dropped for no variance, cut, or judged after the cut
        drawn = record[prefix + "num_groups_drawn"]
        assert record[prefix + "num_groups_cut"] <= drawn
        assert record[prefix + "multiturn/num_tool_calls"] > 0
        assert record["time/rollout+genrm_s"] > 0 and "time/genrm_s" not in record
        assert record["train/num_loss_tokens"] > 0
