"""The trainer's multi-turn rollout kind (rollout.environment / rollout.tools) on the embedded
tools task (examples/tasks/tools_task.py): a short run logs the multi-turn metrics; a
trajectory's training sample has its loss only on the tokens the engine sampled; a malformed
tool call becomes an observation the model reads."""

NUM_GPUS = 0

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "train_grpo.py"
sys.path.insert(0, str(ROOT / "examples"))

import grpo_config
from tasks import tools_task

from yatt import core, genrm
from yatt.rollout import SamplingParams
from yatt.rollout.env.testing import COMPACT_TOOL_TEMPLATE, ScriptedEngine
from yatt.testing import make_tokenizer


@pytest.fixture(scope="module")  # module fixtures (a two-rank run) take it
def task(tools_task_paths) -> dict[str, Path]:
    return tools_task_paths  # built once per session (tests/conftest.py)


def test_a_short_tools_run_logs_the_multiturn_metrics(task, tmp_path, trainer):
    out_dir = tmp_path / "run"
    command = [
        sys.executable,
        str(TRAINER),
        "task=tools",
        f"out_dir={out_dir}",
        f"policy.model_dir={task['policy']}",
        f"data.path={task['prompts']}",
        "data.prompts_per_rank=4",
        "num_steps=2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    trainer.run(command, check=True, env=env, timeout=600)  # forked: the imports are loaded
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        prefix = "dynamic_sampling/multiturn/"
        assert record[prefix + "num_trajectories"] >= 4 * 8  # 4 prompts x 8 samples, or more
        assert record[prefix + "num_tool_calls"] > 0  # the fitted policy calls `guess`
        assert 1.0 <= record[prefix + "turns_mean"] <= tools_task.MAX_TURNS
        assert record[prefix + "turns_max"] <= tools_task.MAX_TURNS


@pytest.fixture(scope="module")
def format_judge(tmp_path_factory) -> Path:
    return tools_task.build_format_judge(tmp_path_factory.mktemp("format_judge"))


@pytest.mark.parametrize("sampling_mode", ["rounds", "stream"])
def test_partial_colocation_judges_each_trajectory_as_it_ends(
    task, format_judge, tmp_path, sampling_mode, trainer
):
    # A judge model resident beside the rollout (placement=partial), its context long enough
    # for a whole transcript in bytes. rounds: each trajectory judged as it ends
    # (genrm.judge_trajectories(should_overlap=True)); stream: genrm.TrajectoryStream, the
    # tail cut once the rank is full.
    out_dir = tmp_path / "run"
    command = [
        sys.executable,
        str(TRAINER),
        "task=tools",
        f"out_dir={out_dir}",
        f"policy.model_dir={task['policy']}",
        f"data.path={task['prompts']}",
        "data.prompts_per_rank=2",
        "rollout.samples_per_prompt=4",
        "num_steps=2",
        "placement=partial",
        f"rollout.sampling_mode={sampling_mode}",
        "reward.backend=builtin",
        f"reward.judge_dir={format_judge}",
        f"reward.judge_template={tools_task.FORMAT_JUDGE_TEMPLATE}",
        "reward.engine.max_seq_len=4096",
        "data.answer_key=secret",  # the judge's reference: the secret number
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = trainer.run(command, env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        prefix = "dynamic_sampling/"
        assert record[prefix + "multiturn/num_trajectories"] >= 2 * 4  # 2 rows x 4, or more
        assert record[prefix + "multiturn/num_tool_calls"] > 0
        # judged while the rollout ran: one phase, no separate judge phase after it
        assert record["time/rollout+genrm_s"] > 0
        assert "time/rollout_s" not in record and "time/genrm_s" not in record
        assert "reward/judge/mean" in record and "reward/env_reward/mean" in record
        if sampling_mode == "stream":
            assert record[prefix + "num_groups_cut"] >= 0
            assert record[prefix + "rollout_pending_tokens"] > 0
        assert record["train/num_loss_tokens"] > 0


def test_the_tools_task_selects_the_multiturn_kind_and_bad_values_name_the_field():
    cfg = grpo_config.build_config({"task": "tools"})
    assert cfg.rollout.is_multiturn and cfg.rollout.env_config().max_turns == 4
    with pytest.raises(ValueError, match=r"rollout\.max_turns=0"):
        grpo_config.build_config({"task": "tools", "rollout": {"max_turns": 0}})
    with pytest.raises(ValueError, match=r"rollout\.tool_parser|unknown tool parser"):
        grpo_config.build_config({"task": "tools", "rollout": {"tool_parser": "nope"}})
    # a multi-turn stream drops what it cuts: nothing to resume
    with pytest.raises(ValueError, match=r"rollout\.keep_partial=True with rollout\.environment"):
        grpo_config.build_config(
            {"task": "tools", "rollout": {"sampling_mode": "stream", "keep_partial": True}}
        )
    cfg = grpo_config.build_config({"task": "tools", "rollout": {"tools": ["nope.py:f"]}})
    with pytest.raises(ValueError, match=r"nope\.py"):
        cfg.rollout.check_environment()


def test_a_trajectory_trains_only_on_sampled_tokens_and_a_bad_call_is_an_observation():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = COMPACT_TOOL_TEMPLATE
    turns = [
        "<tool_call>{not json</tool_call>",  # malformed: an error observation, counted
        '<tool_call>{"name": "guess", "arguments": {"n": 2}}</tool_call>',  # "higher"
        '<tool_call>{"name": "guess", "arguments": {"n": 5}}</tool_call>',  # correct: ends
    ]

    def respond(text: str) -> str:
        return turns[text.count("<|im_start|>assistant") - 1]

    engine = ScriptedEngine(tokenizer=tokenizer, respond=respond)
    rows = [{"prompt": tools_task.PROMPT, "secret": 5}]
    (trajectory,), stats = asyncio.run(
        tools_task.rollout_guesses(engine, rows, SamplingParams(max_new_tokens=96))
    )
    assert stats.tool_errors == {"malformed": 1} and trajectory.num_turns == 3
    tool_messages = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert tool_messages[1:] == ["higher", "correct"]
    assert tool_messages[0].startswith(
        "Error: the tool call is not valid JSON"
    )  # read by the model

    completion = genrm.TrajectoryCompletion(trajectory, request_index=0)
    (sample,) = core.rollout_samples([completion], rewards=[1.0], group_ids=[0])
    prompt_len = len(trajectory.prompt_ids)
    mask, ids = sample["loss_mask"], sample["input_ids"]
    assert mask[:prompt_len] == [0] * prompt_len
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    untrained = tokenizer.decode(
        [t for t, m in zip(ids[prompt_len:], mask[prompt_len:], strict=True) if not m]
    )
    # Every sampled turn is trained on; no tool result or template token is.
    for turn in turns:
        assert turn in trained
    assert "higher" not in trained and "correct" not in trained and "Error" not in trained
    assert "<|im_start|>" not in trained
    assert "higher" in untrained and tool_messages[0][:20] in untrained
    assert sum(mask) == trajectory.num_sampled_tokens
