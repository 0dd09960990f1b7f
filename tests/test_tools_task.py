"""The embedded multi-turn task (examples/tasks/tools_task.py): the game's rules and reward,
and its one-call rollout driven by a scripted binary search."""

NUM_GPUS = 0

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from tasks import tools_task

from yatt.rollout import SamplingParams
from yatt.rollout.env.testing import COMPACT_TOOL_TEMPLATE, ScriptedEngine
from yatt.testing import make_tokenizer


def test_guess_answers_and_rewards():
    env = tools_task.GuessEnv()
    env.reset(prompt=tools_task.PROMPT, secret=5)
    assert [env.guess(3), env.guess(6), env.guess(5)] == ["higher", "lower", "correct"]
    assert env.done and env.get_reward() == pytest.approx(1.0 - 0.1 * 2)
    env.reset(secret=0)
    env.guess(4)
    assert not env.done and env.get_reward() == 0.0


def test_rollout_of_a_binary_search_finds_every_number():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = COMPACT_TOOL_TEMPLATE

    def respond(text):
        low, high = 0, tools_task.MAX_NUMBER
        guesses = [int(n) for n in re.findall(r'"n": (\d+)', text)]
        answers = re.findall(r"<\|im_start\|>tool\n(\w+)<\|im_end\|>", text)
        for n, answer in zip(guesses, answers, strict=True):
            low, high = (n + 1, high) if answer == "higher" else (low, n - 1)
        n = (low + high) // 2
        return f'<tool_call>{{"name": "guess", "arguments": {json.dumps({"n": n})}}}</tool_call>'

    engine = ScriptedEngine(tokenizer=tokenizer, respond=respond)
    rows = [{"prompt": tools_task.PROMPT, "secret": k} for k in range(tools_task.MAX_NUMBER + 1)]
    trajectories, stats = asyncio.run(
        tools_task.rollout_guesses(engine, rows, SamplingParams(max_new_tokens=96))
    )
    # Binary search over 0..7 (midpoint rounded down): 3 first, then 1 or 5, ...
    expected_guesses = {0: 3, 1: 2, 2: 3, 3: 1, 4: 3, 5: 2, 6: 3, 7: 4}
    for secret, trajectory in enumerate(trajectories):
        assert trajectory.end_cause == "env_ended"
        assert trajectory.num_turns == expected_guesses[secret]
        assert trajectory.env_reward == pytest.approx(1.0 - 0.1 * (expected_guesses[secret] - 1))
    assert stats.num_tool_calls == sum(expected_guesses.values()) and not stats.tool_errors
