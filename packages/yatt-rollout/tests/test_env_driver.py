"""The multi-turn driver: trajectories run concurrently with no round barrier, and nothing a
tool or environment does stops the run (each failure an observation the model reads, counted)."""

NUM_GPUS = 0

import asyncio
import json
import re
import time

import pytest

from yatt.rollout import SamplingParams
from yatt.rollout.env import EnvConfig, MultiTurnRollout
from yatt.rollout.env.testing import QWEN25_TOOL_TEMPLATE, ScriptedEngine
from yatt.testing import make_tokenizer

SLOW_TOOL_S = 0.6


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = QWEN25_TOOL_TEMPLATE
    return tokenizer


def _calls(*calls):
    return "".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
        for name, args in calls
    )


def _turn(prompt_text):
    return prompt_text.count("<|im_start|>assistant") - 1


def _user(prompt_text):
    return re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt_text, re.DOTALL).group(1)


def _responses(prompt_text):
    return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt_text, re.DOTALL)


class Counter:
    """Counts up; `wait` sleeps (a slow tool), `boom` raises, `done` ends the episode."""

    def reset(self, **row):
        self.total = row.get("start", 0)
        if row.get("should_fail_reset"):
            raise RuntimeError("no environment today")
        return row.get("question")

    def bump(self, by: int) -> int:
        """Add to the total.

        Args:
            by: how much
        """
        self.total += by
        return self.total

    def wait(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "waited"

    def boom(self) -> str:
        """Raise."""
        raise KeyError("kaput")

    def spam(self, size: int) -> str:
        """A long output.

        Args:
            size: characters
        """
        return "x" * size

    def finish(self) -> str:
        """End the episode."""
        self.done = True
        return "bye"

    def get_reward(self) -> float:
        if self.total < 0:
            raise ValueError("negative")
        return float(self.total)


def _rollout(tokenizer, respond, delay_s=lambda text: 0.0, **config):
    engine = ScriptedEngine(tokenizer=tokenizer, respond=respond, delay_s=delay_s)
    config = {"max_turns": 4, "max_trajectory_tokens": 4096, "tool_timeout_s": 5.0, **config}
    rollout = MultiTurnRollout(engine, EnvConfig(**config), environments=[Counter])
    return rollout, engine


def test_a_trajectory_continues_while_another_waits_for_its_tool(tokenizer):
    # Row "slow" calls a tool that sleeps; row "fast" runs three turns meanwhile.
    def respond(text):
        turn = _turn(text)
        if _user(text) == "slow":
            return _calls(("wait", {"seconds": SLOW_TOOL_S})) if turn == 0 else "done"
        return _calls(("bump", {"by": 1})) if turn < 2 else "done"

    rollout, engine = _rollout(tokenizer, respond)
    rows = [{"question": "slow"}, {"question": "fast"}]
    start = time.monotonic()
    trajectories, stats = asyncio.run(rollout.run(rows, SamplingParams(max_new_tokens=200)))
    assert time.monotonic() - start < 2 * SLOW_TOOL_S  # the slow tool ran once, not per round
    order = [
        (_user(t), _turn(t))
        for t in (tokenizer.decode(p, skip_special_tokens=False) for p in engine.prompts)
    ]
    # Every turn of "fast" entered the engine before "slow"'s second turn: no round barrier.
    assert order.index(("fast", 2)) < order.index(("slow", 1))
    slow, fast = trajectories
    assert (slow.num_turns, fast.num_turns) == (2, 3)
    assert fast.env_reward == 2.0 and slow.end_cause == fast.end_cause == "stop"
    assert sorted(stats.turns) == [2, 3]


@pytest.mark.parametrize(
    ("call", "cause", "observation"),
    [
        (("boom", {}), "exception", "Error: boom raised KeyError: 'kaput'"),
        (("wait", {"seconds": 30}), "timeout", "Error: wait timed out (no answer within 0.2 s)"),
        (("nope", {}), "unknown_tool", "Error: unknown tool 'nope'; the tools are"),
        (("bump", {"by": 1, "extra": 2}), "bad_arguments", "Error: wrong arguments for bump"),
        (("bump", {}), "bad_arguments", "Error: wrong arguments for bump"),
        (None, "malformed", "Error: the tool call is not valid JSON"),
    ],
    ids=["raises", "timeout", "unknown", "extra-arg", "missing-arg", "bad-json"],
)
def test_each_tool_failure_is_an_observation_and_counted(tokenizer, call, cause, observation):
    seen = []

    def respond(text):
        if _turn(text) == 0:
            return "<tool_call>{oops</tool_call>" if call is None else _calls(call)
        seen.extend(_responses(text))
        return "fine"

    rollout, _ = _rollout(tokenizer, respond, tool_timeout_s=0.2)
    start = time.monotonic()
    (trajectory,), stats = asyncio.run(rollout.run([{"question": "q"}], SamplingParams()))
    assert time.monotonic() - start < 5  # a hung tool is abandoned at its timeout
    assert len(seen) == 1 and seen[0].startswith(observation), seen
    assert dict(stats.tool_errors) == {cause: 1} and stats.num_tool_calls == 1
    assert trajectory.end_cause == "stop" and trajectory.num_turns == 2
    assert stats.as_metrics()[f"multiturn/tool_errors/{cause}"] == 1.0


def test_tool_output_is_capped_in_bytes_then_tokens(tokenizer):
    seen = []

    def respond(text):
        if _turn(text) == 0:
            return _calls(("spam", {"size": 10_000}))
        seen.extend(_responses(text))
        return "fine"

    for limits, size in [
        ({"max_tool_output_bytes": 100}, 100),
        ({"max_tool_output_tokens": 40}, 40),
    ]:
        seen.clear()
        rollout, _ = _rollout(tokenizer, respond, **limits)
        asyncio.run(rollout.run([{"question": "q"}], SamplingParams()))
        # A byte-level tokenizer: one token per byte, so both limits cut to `size` characters.
        assert seen == ["x" * size + " ...[output truncated]"]


def test_a_reset_that_raises_skips_the_row_and_the_rest_run(tokenizer):
    rollout, _ = _rollout(tokenizer, lambda text: "answer")
    rows = [{"question": "a"}, {"question": "b", "should_fail_reset": True}, {"question": "c"}]
    trajectories, stats = asyncio.run(rollout.run(rows, SamplingParams(n=2)))
    assert [(t.row_index, t.sample_index) for t in trajectories] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert stats.num_reset_errors == 2 and stats.num_trajectories == 4


def test_end_causes_and_rewards(tokenizer):
    def respond(text):
        question = _user(text)
        if question == "loop":  # calls a tool every turn
            return _calls(("bump", {"by": 1}))
        if question == "finish":
            return _calls(("finish", {}))
        if question == "negative":
            return _calls(("bump", {"by": -5})) if _turn(text) == 0 else "ok"
        return "y" * 300  # longer than the turn's limit

    rollout, _ = _rollout(tokenizer, respond, max_turns=3)
    rows = [{"question": q} for q in ("loop", "finish", "negative", "long")]
    trajectories, stats = asyncio.run(rollout.run(rows, SamplingParams(max_new_tokens=100)))
    loop, finish, negative, long = trajectories
    assert (loop.end_cause, loop.num_turns, loop.env_reward) == ("max_turns", 3, 3.0)
    assert (finish.end_cause, finish.num_turns) == ("env_ended", 1)
    assert negative.env_reward is None and stats.num_reward_errors == 1
    assert (long.end_cause, len(long.response_ids)) == ("length", 100)
    assert stats.end_causes == {"max_turns": 1, "env_ended": 1, "stop": 1, "length": 1}
    # The last turn's tool ran (its effect is in the reward, its result in the messages) but
    # no tokens were appended after it.
    assert loop.loss_mask[-1] == 1
    assert loop.messages[-1] == {"role": "tool", "content": "3", "name": "bump"}
    assert finish.messages[-1] == {"role": "tool", "content": "bye", "name": "finish"}


def test_the_trajectory_token_limit_cuts_a_turn(tokenizer):
    rollout, _ = _rollout(tokenizer, lambda text: _calls(("bump", {"by": 1})))
    prompt_len = len(rollout._tokens["Counter"].prompt_ids([{"role": "user", "content": "q"}]))
    limit = prompt_len + 150  # room for about two turns of ~50 tokens and their results
    rollout.config.max_trajectory_tokens = limit
    (trajectory,), stats = asyncio.run(rollout.run([{"question": "q"}], SamplingParams()))
    assert trajectory.end_cause == "max_trajectory_tokens"
    assert len(trajectory.prompt_ids) + len(trajectory.response_ids) <= limit
    assert stats.as_metrics()["multiturn/end/max_trajectory_tokens"] == 1.0


def test_a_tool_result_that_would_fill_the_trajectory_is_not_appended(tokenizer):
    # The first turn's sampled tokens and its tool result, measured on a roomy run; then a limit
    # one token short of holding both: the result must not be appended (the next turn would
    # have no room), and the trajectory ends at the limit's cause within it.
    rollout, _ = _rollout(tokenizer, lambda text: _calls(("bump", {"by": 1})), max_turns=2)
    (roomy,), _ = asyncio.run(rollout.run([{"question": "q"}], SamplingParams()))
    prompt_len = len(roomy.prompt_ids)
    sampled = roomy.loss_mask.index(0)  # the first turn's tokens, then its result's
    appended = roomy.loss_mask[sampled:].index(1)
    assert sampled > 1 and appended > 1
    limit = prompt_len + sampled + appended - 1
    rollout.config.max_trajectory_tokens = limit
    (trajectory,), _ = asyncio.run(rollout.run([{"question": "q"}], SamplingParams()))
    assert trajectory.end_cause == "max_trajectory_tokens"
    assert trajectory.response_ids == roomy.response_ids[:sampled]
    assert trajectory.loss_mask == [1] * sampled and trajectory.num_turns == 1
    assert len(trajectory.prompt_ids) + len(trajectory.response_ids) <= limit


def test_rows_are_routed_to_environments_by_a_field(tokenizer, tmp_path):
    class Other(Counter):
        def ping(self) -> str:
            """Answer pong."""
            return "pong"

    def respond(text):
        if _turn(text) == 0:
            return _calls(("ping", {}))
        return "|".join(_responses(text))

    engine = ScriptedEngine(tokenizer=tokenizer, respond=respond)
    config = EnvConfig(environment=("a.py:A", "b.py:B"), route_key="env")
    rollout = MultiTurnRollout(engine, config, environments=[Counter, Other])
    rows = [{"env": "Counter"}, {"env": "Other"}, {"env": "Missing"}]
    rows = [{**row, "question": "q"} for row in rows]
    trajectories, stats = asyncio.run(rollout.run(rows, SamplingParams()))
    counter, other = trajectories
    assert counter.env_name == "Counter" and other.env_name == "Other"
    assert counter.messages[-1]["content"].startswith("Error: unknown tool 'ping'")
    assert other.messages[-1]["content"] == "pong"
    assert stats.num_unrouted == 1


def test_seeded_turns_draw_distinct_keys_per_sample_and_turn(tokenizer):
    seeds = []

    class Recording(ScriptedEngine):
        async def stream(self, requests, sampling):
            seeds.append(sampling.seed)
            async for c in super().stream(requests, sampling):
                yield c

    engine = Recording(
        tokenizer=tokenizer, respond=lambda t: _calls(("bump", {"by": 1})) if _turn(t) < 1 else "."
    )
    rollout = MultiTurnRollout(engine, EnvConfig(max_turns=3), environments=[Counter])
    asyncio.run(rollout.run([{"question": "q"}] * 2, SamplingParams(n=2, seed=7)))
    assert len(seeds) == 8 and len(set(seeds)) == 8  # 2 rows x 2 samples x 2 turns
    seeds_again = list(seeds)
    seeds.clear()
    asyncio.run(rollout.run([{"question": "q"}] * 2, SamplingParams(n=2, seed=7)))
    assert sorted(seeds) == sorted(seeds_again)


def test_a_trajectory_limit_beyond_the_engine_context_is_refused(tokenizer):
    engine = ScriptedEngine(tokenizer=tokenizer, respond=lambda text: "x")
    engine.config = type("Config", (), {"max_seq_len": 512})()
    with pytest.raises(ValueError, match="max_trajectory_tokens=512 does not fit"):
        MultiTurnRollout(engine, EnvConfig(max_trajectory_tokens=512), environments=[Counter])
    MultiTurnRollout(engine, EnvConfig(max_trajectory_tokens=511), environments=[Counter])


class ActionParser:
    """Another model family's format: `CALL name {json}` lines."""

    def parse(self, text):
        from yatt.rollout.env import ParsedTurn, ToolCall

        calls = [
            ToolCall(name=name, arguments=json.loads(args))
            for name, args in re.findall(r"^CALL (\w+) (\{.*\})$", text, re.M)
        ]
        content = re.sub(r"^CALL .*$", "", text, flags=re.M).strip()
        return ParsedTurn(content=content, calls=calls)


def test_a_registered_parser_reads_another_format(tokenizer, tmp_path):
    from yatt.rollout.env import TOOL_PARSERS, register_tool_parser

    register_tool_parser("action-lines", ActionParser)
    try:
        seen = []

        def respond(text):
            if _turn(text) == 0:
                return 'thinking\nCALL bump {"by": 4}'
            seen.extend(_responses(text))
            return "done"

        rollout, _ = _rollout(tokenizer, respond, tool_parser="action-lines")
        (trajectory,), _ = asyncio.run(rollout.run([{"question": "q"}], SamplingParams()))
        assert seen == ["4"] and trajectory.env_reward == 4.0
        assert trajectory.messages[1]["content"] == "thinking"
    finally:
        del TOOL_PARSERS["action-lines"]
    # A parser class named by a spec works too; an unknown name is a ValueError at config time.
    path = tmp_path / "parsers.py"
    path.write_text("class P:\n    def parse(self, text):\n        raise NotImplementedError\n")
    assert EnvConfig(tool_parser=f"{path}:P").tool_parser.endswith(":P")
    with pytest.raises(ValueError, match="tool_parser='action-lines' is unknown"):
        EnvConfig(tool_parser="action-lines")


def test_closing_the_stream_early_ends_running_turns_and_sessions(tokenizer):
    closed = []

    class Tracking(ScriptedEngine):
        async def stream(self, requests, sampling):
            try:
                async for c in super().stream(requests, sampling):
                    yield c
            finally:
                closed.append(requests[0].session_id)

    def delay_s(text):
        return 5.0 if _user(text) == "slow" else 0.0

    engine = Tracking(tokenizer=tokenizer, respond=lambda text: "done", delay_s=delay_s)
    released = []
    engine.release_sessions = released.extend
    rollout = MultiTurnRollout(engine, EnvConfig(), environments=[Counter])
    rows = [{"question": "fast"}, {"question": "slow"}]

    async def first_only():
        stream = rollout.stream(rows, SamplingParams())
        async for trajectory in stream:
            await stream.aclose()  # dynamic sampling has enough: cut the tail
            return trajectory

    start = time.monotonic()
    trajectory = asyncio.run(first_only())
    assert trajectory.row["question"] == "fast" and time.monotonic() - start < 3.0
    # Both engine calls were closed and both sessions released (the slow one cut short).
    assert sorted(closed) == sorted(released) and len(released) == 2
