"""The embedded multi-turn task: guess a number from 0 to 7 with a `guess` tool that answers
"higher", "lower" or "correct". Random guessing finds it within four turns half of the time;
binary search always does, in at most four turns. Half the secrets are the game's favourite
number (FAVOURITE), so guessing it first pays: the first thing GRPO finds. Built locally (no downloads) under a work
directory:

    prompts.jsonl   {"prompt": "Guess my number (0-7).", "secret": 5} rows
    eval.jsonl      held-out rows (other seeds)
    policy/         a tiny causal LM fitted to the tool-call format: every turn it calls
                    guess with a number it has not tried yet (random, ignoring the hints), so
                    it starts by calling tools and GRPO has room to learn to search

The reward is the environment's: 1 - 0.1 * (guesses - 1) when it found the number, else 0;
the trainer adds 0.1 x tool_error_penalty (-1 per failed tool call) as a reward function.

One call runs a step's rollout (the trainer's `task=tools` rollout kind):

    trajectories, stats = await rollout_guesses(engine, rows, sampling)
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import get_json_schema

from tasks.guess_env import MAX_NUMBER, GuessEnv  # the game, light enough for tool workers
from yatt.rollout import SamplingParams
from yatt.rollout.env import (
    ChatTokens,
    EnvConfig,
    MultiTurnRollout,
    MultiTurnStats,
    ToolRunner,
    Trajectory,
)
from yatt.rollout.env.testing import COMPACT_TOOL_TEMPLATE

logger = logging.getLogger("train_grpo")
MAX_TURNS = 4
PROMPT = f"Guess my number (0-{MAX_NUMBER})."
NUM_EVAL_ROWS = 64
_READY = "READY"


def env_config(**overrides: Any) -> EnvConfig:
    """The task's multi-turn settings (a preset: the CLI overrides single fields)."""
    values: dict[str, Any] = {
        "max_turns": MAX_TURNS,
        "max_trajectory_tokens": 480,
        "tool_timeout_s": 5.0,
        "max_tool_output_tokens": 16,
    }
    values.update(overrides)
    return EnvConfig(**values)


async def rollout_guesses(
    engine: Any,
    rows: list[dict[str, Any]],
    sampling: SamplingParams,
    *,
    config: EnvConfig | None = None,
    runner: ToolRunner | None = None,
) -> tuple[list[Trajectory], MultiTurnStats]:
    """The task's rollout: sampling.n trajectories per row, ordered by (row, sample), with the
    environment's reward on each (Trajectory.env_reward) and the step's multi-turn counts."""
    rollout = MultiTurnRollout(
        engine, config or env_config(), environments=[GuessEnv], runner=runner
    )
    return await rollout.run(rows, sampling)


# The game's favourite number: half the secrets are it, the rest uniform. A policy gains by
# guessing it first (a signal a tiny policy finds in a few steps) and by reading the hints.
FAVOURITE = 5


def guess_rows(num_rows: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "prompt": PROMPT,
            "secret": FAVOURITE if rng.random() < 0.5 else rng.randint(0, MAX_NUMBER),
        }
        for _ in range(num_rows)
    ]


def _call(n: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "guess", "arguments": {"n": n}}}


def _game_ids(tokens: ChatTokens, rng: random.Random, end_id: int) -> tuple[list[int], list[int]]:
    """One random game through the chat template: (ids, labels) with labels on the policy's
    turns only, built by the same token layer the rollout uses."""
    secret = rng.randint(0, MAX_NUMBER)
    guesses = rng.sample(range(MAX_NUMBER + 1), MAX_NUMBER + 1)[:MAX_TURNS]
    messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    ids = tokens.prompt_ids(messages)
    labels = [-100] * len(ids)
    for n in guesses:
        turn = tokens.encode(
            f'<tool_call>{{"name": "guess", "arguments": {{"n": {n}}}}}</tool_call>'
        )
        turn.append(end_id)
        ids, labels = ids + turn, labels + turn
        messages.append({"role": "assistant", "content": "", "tool_calls": [_call(n)]})
        if n == secret:
            break
        answer = "higher" if secret > n else "lower"
        result = [{"role": "tool", "content": answer}]
        appended = tokens.appended_ids(messages, result, end_token_id=end_id).ids
        messages += result
        ids, labels = ids + appended, labels + [-100] * len(appended)
    return ids, labels


def build_policy(
    model_dir: Path, *, seed: int, steps: int = 150, batch_size: int = 16, lr: float = 1e-2
) -> float:
    """A tiny policy that calls `guess` every turn with untried random numbers."""
    from yatt.testing import make_tiny_causal_lm

    make_tiny_causal_lm(
        model_dir,
        arch="qwen2",
        hidden_size=64,
        num_layers=2,
        seed=seed,
        max_position_embeddings=512,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = COMPACT_TOOL_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The template closes turns with <|im_end|>: generation stops there too.
    config_path = model_dir / "generation_config.json"
    generation = json.loads(config_path.read_text()) if config_path.exists() else {}
    generation["eos_token_id"] = [tokenizer.eos_token_id, end_id]
    config_path.write_text(json.dumps(generation, indent=2))
    tokens = ChatTokens(tokenizer, [get_json_schema(GuessEnv.guess)])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=lr / 30)
    loss_value = float("nan")
    for step in range(steps):
        games = [_game_ids(tokens, rng, end_id) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in games)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for i, (row_ids, row_labels) in enumerate(games):
            ids[i, : len(row_ids)] = torch.tensor(row_ids)
            labels[i, : len(row_labels)] = torch.tensor(row_labels)
            mask[i, : len(row_ids)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
        if step % 100 == 0:
            logger.info(
                "fitting the tools task's policy: step %d/%d, loss %.3f", step, steps, loss_value
            )
    model.eval()
    model.save_pretrained(model_dir)
    return loss_value


# What the format judge is fitted to read: any text, then " ref <the secret>".
FORMAT_JUDGE_TEMPLATE = "{prompt}{response} ref {reference}"


def build_format_judge(judge_dir: str | Path, *, seed: int = 0, steps: int = 60) -> Path:
    """A tiny judge model that answers "Yes" or "No" and stops after a prompt in
    FORMAT_JUDGE_TEMPLATE (reward.judge_template), whatever the transcript: fitted on the
    format alone, its verdicts carry no signal. It lets the tools task run with a judge model
    resident beside the policy (placement=partial) on CPU; 4096 positions hold a whole
    transcript in bytes (reward.engine.max_seq_len=4096)."""
    from tasks.tiny_task import _fit_completions
    from yatt.testing import make_tiny_causal_lm

    judge_dir = Path(judge_dir)
    make_tiny_causal_lm(judge_dir, max_position_embeddings=4096, seed=seed)
    # No chat template: the GenRM sends its plain template text, as the fitting saw it.
    (judge_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = judge_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.pop("chat_template", None)
    config_path.write_text(json.dumps(tokenizer_config, indent=2))
    alphabet = 'abcdefghij <>{}":,\n[]0123456789'

    def pairs(rng: random.Random) -> tuple[str, str]:
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(10, 400)))
        prompt = FORMAT_JUDGE_TEMPLATE.format(prompt="", response=text, reference=rng.randint(0, 7))
        return prompt, rng.choice(["Yes", "No"])

    _fit_completions(judge_dir, pairs, steps=steps, batch_size=16, lr=3e-3, seed=seed)
    return judge_dir


def is_prepared(workdir: Path) -> bool:
    return (Path(workdir) / _READY).exists()


def prepare(
    workdir: str | Path, render: Any = None, *, seed: int = 0, num_rows: int = 1024
) -> dict[str, Path]:
    """Build (or reuse) the rows and the policy under `workdir` (`render` is unused: the task
    has no judge; it keeps tiny_task.locked_build's signature)."""
    workdir = Path(workdir)
    paths = {
        "prompts": workdir / "prompts.jsonl",
        "eval": workdir / "eval.jsonl",
        "policy": workdir / "policy",
    }
    if is_prepared(workdir):
        return paths
    workdir.mkdir(parents=True, exist_ok=True)
    for path, rows in (
        (paths["prompts"], guess_rows(num_rows, seed)),
        (paths["eval"], guess_rows(NUM_EVAL_ROWS, seed + 1)),
    ):
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    build_policy(paths["policy"], seed=seed)
    (workdir / _READY).write_text("ok\n")  # last: a half-built task is rebuilt
    return paths


def prepare_locked(workdir: Path, template: Any = None) -> dict[str, Path]:
    """`prepare` under the embedded tasks' file lock (every rank waits for one build)."""
    from tasks.tiny_task import locked_build

    return locked_build(workdir, template, prepare)
