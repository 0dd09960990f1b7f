"""Off-policy steps (rollout.max_staleness >= 1) with multi-turn environments: the embedded
tools task (examples/tasks/tools_task.py, a `guess` tool) run at s = 1 and 2; one worker's
group with the version moving between its turns (each turn's tokens keep the version that ran
them); environment seeds that a resume reproduces.

Expected values come from the rules, not the code: a token's version is the number of weight
pushes before its turn started (the fake version counts the engine calls made before it); the
tokens between two turns belong to no turn and take the version of the turn before them;
every loss token has an age, so the ages sum to the loss tokens."""

NUM_GPUS = 0

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "train_grpo.py"
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).parent))  # _offpolicy_runs

import grpo_config
import train_grpo
from _offpolicy_runs import RecordingRollout, loader_rows, train_in_process
from tasks import tools_task
from tasks.guess_env import GuessEnv

from yatt import core
from yatt.rollout import MultiTurnRollout, SamplingParams
from yatt.rollout.env.testing import COMPACT_TOOL_TEMPLATE, ScriptedEngine
from yatt.testing import make_tokenizer

P = 4  # prompts per step and rank
PREFIX = "dynamic_sampling/multiturn/"


@pytest.fixture(scope="module")
def task(tools_task_paths) -> list[str]:
    """The tools task (built once per session, conftest.py); runs point at it."""
    return [
        "task=tools",
        f"policy.model_dir={tools_task_paths['policy']}",
        f"data.path={tools_task_paths['prompts']}",
        f"data.prompts_per_rank={P}",
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]


# -- one worker's group: versions per turn, seeds --------------------------------------------
# The scripted policy: a malformed call (an error observation), then guess 2 ("higher"), then
# guess 5 (correct: the environment ends the game)
TURNS = [
    "<tool_call>{not json</tool_call>",
    '<tool_call>{"name": "guess", "arguments": {"n": 2}}</tool_call>',
    '<tool_call>{"name": "guess", "arguments": {"n": 5}}</tool_call>',
]


def _context(*, samples_per_prompt: int = 1) -> SimpleNamespace:
    """What offpolicy_trajectories reads of the trainer's RolloutContext: the tools task's
    config, a scripted engine, the multi-turn rollout over it, no scorer (the environment's
    reward alone), rows as prompts."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = COMPACT_TOOL_TEMPLATE
    engine = ScriptedEngine(
        tokenizer=tokenizer, respond=lambda text: TURNS[text.count("<|im_start|>assistant") - 1]
    )
    cfg = grpo_config.build_config({"task": "tools"})  # n: the sampling's, below
    multiturn = MultiTurnRollout(
        engine, tools_task.env_config(), environments=[GuessEnv], tokenizer=tokenizer
    )
    return SimpleNamespace(
        cfg=cfg,
        engine=engine,
        multiturn=multiturn,
        scorer=None,
        encoder=SimpleNamespace(encode=lambda rows: [core.Prompt(row, []) for row in rows]),
        sampling=lambda step, num_round: SamplingParams(
            n=samples_per_prompt, max_new_tokens=96, seed=step * 1000 + num_round
        ),
    )


def _row(index: int) -> dict:
    return {"prompt": tools_task.PROMPT, "secret": 5, core.ROW_INDEX_KEY: index}


def test_each_turn_keeps_the_version_it_ran_under():
    ctx = _context()
    # a weight push before every engine call: turn k runs under version k
    group = train_grpo.offpolicy_trajectories(_row(3), lambda: len(ctx.engine.prompts), ctx)
    (judged,) = group.scored
    trajectory = judged.completion.trajectory
    assert trajectory.num_turns == 3 and trajectory.end_cause == "env_ended"
    assert judged.verdict.reward == pytest.approx(0.9)  # found on the 2nd guess: 1 - 0.1
    assert group.version == 0  # the start's: what admission control counted
    # the expected versions, read off the mask: each run of sampled tokens is the next turn;
    # the tool and template ids after a turn keep that turn's version
    mask = trajectory.loss_mask
    expected, turn = [], -1
    for i, is_sampled in enumerate(mask):
        if is_sampled and (i == 0 or not mask[i - 1]):
            turn += 1
        expected.append(turn)
    assert turn == 2 and mask[0] == 1
    assert group.token_versions == [expected]
    assert group.turn_stats.num_tool_calls == 3 and group.turn_stats.turns == [3]
    # the trainer's batch stamps those versions on the loss tokens (prompt: the first turn's)
    encoder = SimpleNamespace(takes_images=False, cut_token_ids=())
    batch = train_grpo.to_batch(
        group.scored,
        SimpleNamespace(tp_size=1),
        encoder,
        policy_versions=group.token_versions,
    )
    num_prompt = len(trajectory.prompt_ids)
    versions = batch.tokens["policy_version"][0, : num_prompt + len(mask)].tolist()
    assert versions == [0] * num_prompt + expected


def test_a_groups_samples_each_get_their_own_versions():
    ctx = _context(samples_per_prompt=2)
    group = train_grpo.offpolicy_trajectories(_row(3), lambda: 4, ctx)
    assert [len(v) for v in group.token_versions] == [
        len(j.completion.trajectory.response_ids) for j in group.scored
    ]
    assert all(set(v) == {4} for v in group.token_versions)
    assert group.turn_stats.num_trajectories == 2


def test_environment_seeds_depend_on_the_row_not_the_version():
    # a re-queued prompt restarts under the resumed run's version: its environment keeps its
    # seed; another row gets another
    def seed_of(index: int, start_version: int) -> int:
        ctx = _context()
        group = train_grpo.offpolicy_trajectories(_row(index), lambda: start_version, ctx)
        (judged,) = group.scored
        return judged.completion.trajectory.row[train_grpo.ENV_SEED_KEY]

    assert seed_of(3, start_version=0) == seed_of(3, start_version=5)
    assert seed_of(3, start_version=0) != seed_of(4, start_version=0)


def test_without_a_judge_model_full_placement_holds_off_policy():
    # the tools task's reward is the environment's and a function: no judge engine sleeps
    # under the workers, so its placement (full: partial needs a judge model) is accepted
    cfg = grpo_config.build_config({"task": "tools", "rollout": {"max_staleness": 1}})
    assert cfg.placement == "full" and not cfg.uses_judge_model
    train_grpo.check_offpolicy(cfg)


# -- runs ----------------------------------------------------------------------------------------
NUM_STEPS = 5


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(("rollout.max_staleness=1",), id="s1"),
        pytest.param(("rollout.max_staleness=2",), id="s2"),
        pytest.param(("rollout.max_staleness=1", "policy.lora.rank=8"), id="s1-lora"),
    ],
)
def test_a_tools_run_ages_its_tokens_and_logs_the_multiturn_metrics(task, tmp_path, trainer, extra):
    s = int(extra[0].split("=")[1])
    out = tmp_path / "run"
    args = [*task, *extra, f"num_steps={NUM_STEPS}"]
    trainer.run(
        [sys.executable, str(TRAINER), f"out_dir={out}", *args],
        check=True,
        env=_env(),
        timeout=600,
    )
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(NUM_STEPS))
    for r in records:
        ages = [r[f"offpolicy/tokens_age_{a}"] for a in range(s + 1)]
        # every loss token has an age: 0..s, or over the bound (a slow group trained late)
        assert sum(ages) + r["offpolicy/tokens_over_bound"] == r["train/num_loss_tokens"] > 0
        assert all(n == 0 for a, n in enumerate(ages) if a > r["step"]), r["step"]
        if r["step"] <= s:  # nothing can be older than s yet
            assert r["offpolicy/tokens_over_bound"] == 0.0, r["step"]
        # the groups the step took, 8 trajectories each (no reset fails in this game)
        num_groups = r["dynamic_sampling/num_groups_taken"]
        assert r[PREFIX + "num_trajectories"] == 8 * num_groups >= 8 * P
        ends = sum(v for k, v in r.items() if k.startswith(PREFIX + "end/"))
        assert ends == r[PREFIX + "num_trajectories"]
        assert 1.0 <= r[PREFIX + "turns_mean"] <= r[PREFIX + "turns_max"] <= tools_task.MAX_TURNS
        assert r[PREFIX + "num_tool_calls"] > 0  # the fitted policy calls `guess`
    # step 0 is on-policy; generation runs ahead: tokens s versions old
    assert records[0]["offpolicy/tokens_age_0"] == records[0]["train/num_loss_tokens"]
    assert sum(r[f"offpolicy/tokens_age_{s}"] for r in records) > 0
    # the bound holds for most tokens (the slow tail is counted, not dropped)
    over = sum(r["offpolicy/tokens_over_bound"] for r in records)
    assert over <= 0.25 * sum(r["train/num_loss_tokens"] for r in records)


# -- a crash and a resume: every prompt once ------------------------------------------------------
def test_a_crash_then_resume_handles_every_prompt_once(tmp_path, task, monkeypatch):
    # test_train_grpo_offpolicy.py's test on the tools task: the rows the crashed run took by
    # its last checkpoint, the resumed run's takes and what is still in flight at its end are
    # the loader's own sequence, each row once; the re-queued prompts are trained
    monkeypatch.setattr(core, "AsyncRollout", RecordingRollout)
    RecordingRollout.instances = []
    out = tmp_path / "run"
    args = [
        f"out_dir={out}", *task, "rollout.max_staleness=1", "num_steps=6", "ckpt.every_steps=2",
        "ckpt.async_save=false",
    ]  # fmt: skip
    crash_step = 3  # after step 2's checkpoint committed
    real_train_on_batch = train_grpo.train_on_batch

    def crashing(batch, **kwargs):
        if kwargs["step"] == crash_step:
            raise RuntimeError("planted crash")
        return real_train_on_batch(batch, **kwargs)

    monkeypatch.setattr(train_grpo, "train_on_batch", crashing)
    with pytest.raises(RuntimeError, match="planted crash"):
        train_in_process(*args)
    monkeypatch.setattr(train_grpo, "train_on_batch", real_train_on_batch)
    assert train_in_process(*args, should_resume=True) == 0

    crashed, resumed = RecordingRollout.instances
    committed = crashed.taken[: crashed.taken_before_version[crash_step]]
    assert resumed.requeued, "the checkpoint held no prompt in flight"
    handled = committed + resumed.taken + resumed.rows_in_flight()
    cfg = grpo_config.config_from_args(train_grpo.parse_args(args))
    assert sorted(handled) == sorted(loader_rows(cfg, len(handled)))
    for row in set(resumed.requeued):
        assert resumed.taken.count(row) >= resumed.requeued.count(row), row
    records = {r["step"]: r for r in _metrics(out)}
    assert sorted(records) == list(range(6))
    assert records[crash_step]["offpolicy/num_requeued"] == len(resumed.requeued)
    assert records[crash_step][PREFIX + "num_trajectories"] >= 8 * P
