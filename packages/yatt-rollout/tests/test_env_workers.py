"""Environments and tools in UserCodePool worker processes: state carried across calls, and a
tool that hangs, raises or kills its process is an observation; the run goes on."""

NUM_GPUS = 0

import asyncio
import json
import re
import textwrap

import pytest

from yatt.rollout import SamplingParams, UserCodePool
from yatt.rollout.env import EnvConfig, MultiTurnRollout, PoolToolRunner
from yatt.rollout.env.testing import QWEN25_TOOL_TEMPLATE, ScriptedEngine
from yatt.testing import make_tokenizer

ENV_FILE = '''
import os
import time


class Tally:
    def reset(self, **row):
        self.total = 0
        return row["question"]

    def bump(self, by: int) -> int:
        """Add to the total.

        Args:
            by: how much
        """
        self.total += by
        return self.total

    def hang(self) -> str:
        """Never answers."""
        self.total = -100  # lost: the worker is killed before it replies
        time.sleep(60)
        return "late"

    def boom(self) -> str:
        """Raises."""
        raise KeyError("kaput")

    def die(self) -> str:
        """Kills its own process."""
        os._exit(3)

    def get_reward(self) -> float:
        return float(self.total)


def double(x: int) -> int:
    """Twice x.

    Args:
        x: a number
    """
    return 2 * x
'''

SCRIPT = [
    ("bump", {"by": 2}),
    ("hang", {}),
    ("boom", {}),
    ("die", {}),
    ("double", {"x": 21}),
    ("bump", {"by": 3}),
]


def test_a_trajectory_in_worker_processes_survives_every_failure(tmp_path):
    path = tmp_path / "tally.py"
    path.write_text(textwrap.dedent(ENV_FILE))
    tokenizer = make_tokenizer()
    tokenizer.chat_template = QWEN25_TOOL_TEMPLATE
    observations = []

    def respond(text):
        turn = text.count("<|im_start|>assistant") - 1
        observations[:] = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        if turn == len(SCRIPT):
            return "done"
        name, args = SCRIPT[turn]
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'

    engine = ScriptedEngine(tokenizer=tokenizer, respond=respond)
    config = EnvConfig(
        environment=(f"{path}:Tally",),
        tools=(f"{path}:double",),
        max_turns=len(SCRIPT) + 1,
        max_trajectory_tokens=8192,
        tool_timeout_s=1.0,
    )
    runner = PoolToolRunner.from_timeout(config.tool_timeout_s, num_workers=2)
    pool = runner.pool
    try:
        rollout = MultiTurnRollout(engine, config, runner=runner)
        (trajectory,), stats = asyncio.run(
            rollout.run([{"question": "count"}], SamplingParams(max_new_tokens=200))
        )
    finally:
        pool.close()
    assert observations[0] == "2"
    assert observations[1].startswith("Error: hang timed out")
    assert observations[2].startswith("Error: boom failed") and "kaput" in observations[2]
    assert observations[3].startswith("Error: die failed")
    assert observations[4] == "42"
    # The state went on from before the killed call: 2 + 3.
    assert observations[5] == "5" and trajectory.env_reward == 5.0
    assert dict(stats.tool_errors) == {"timeout": 1, "exception": 2}
    assert trajectory.end_cause == "stop" and trajectory.num_turns == len(SCRIPT) + 1


def test_an_environment_defined_in_a_function_cannot_go_to_a_worker():
    class Local:
        def act(self) -> str:
            """Act."""
            return "x"

    tokenizer = make_tokenizer()
    tokenizer.chat_template = QWEN25_TOOL_TEMPLATE
    engine = ScriptedEngine(tokenizer=tokenizer, respond=lambda text: "ok")
    pool = UserCodePool(num_workers=1, timeout_s=1.0)
    try:
        with pytest.raises(ValueError, match=r"EnvConfig\.environment: 'Local' runs in worker"):
            MultiTurnRollout(engine, EnvConfig(), environments=[Local], runner=PoolToolRunner(pool))
    finally:
        pool.close()
