"""Trajectories judged whole: the judge reads the transcript (turns, calls, results), and the
environment's reward, functions of the trajectory and the judge combine by weights."""

NUM_GPUS = 0

from yatt.genrm import (
    CombinedRM,
    EnvReward,
    GenRM,
    TrajectoryReward,
    YesNoParser,
    trajectory_sample,
    trajectory_template,
)
from yatt.genrm.testing import FakeJudgeEngine
from yatt.rollout.env import ToolCall, Trajectory


def _trajectory(env_reward=3.0):
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
            ],
        },
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    return Trajectory(
        row_index=0,
        sample_index=0,
        env_name="Calc",
        prompt_ids=[1],
        response_ids=[2],
        loss_mask=[1],
        logprobs=[0.0],
        messages=messages,
        tool_calls=[
            [ToolCall(name="add", arguments={"a": 2, "b": 3})],
            [ToolCall(name="", error="bad")],
        ],
        num_turns=2,
        end_cause="stop",
        env_reward=env_reward,
    )


def test_a_trajectory_as_a_judge_sample():
    sample = trajectory_sample(_trajectory(), reference="5")
    assert sample.prompt == "Use tools.\n\n2+3?"
    assert sample.response == (
        '[assistant]\nLet me add.\n[calls add({"a": 2, "b": 3})]\n\n'
        "[tool result of add]\n5\n\n"
        "[assistant]\nIt is 5."
    )
    assert sample.reference == "5" and sample.metadata["env_reward"] == 3.0
    text = trajectory_template(with_reference=True).render_messages(sample)[0]["content"]
    assert "Reference answer:\n5" in text and "[tool result of add]\n5" in text


def test_env_reward_functions_and_judge_combine_by_weights():
    def failed_calls(messages, tool_calls, row):
        return -float(sum(c["error"] is not None for turn in tool_calls for c in turn))

    seen = []

    def judge(prompt_text, vote_index):
        seen.append(prompt_text)
        return "Yes" if "[tool result of add]\n5" in prompt_text else "No"

    genrm = GenRM(
        FakeJudgeEngine(judge=judge), template=trajectory_template(), parser=YesNoParser()
    )
    rules = [(EnvReward(), 0.5), (TrajectoryReward(failed_calls), 2.0)]
    (verdict,) = CombinedRM(genrm, rules, judge_weight=4.0).score(
        [trajectory_sample(_trajectory())]
    )
    # 4 * judge(Yes = 1) + 0.5 * env(3) + 2 * (-1 failed call)
    assert verdict.reward == 4.0 * 1.0 + 0.5 * 3.0 + 2.0 * -1.0
    assert len(seen) == 1 and "It is 5." in seen[0]
    # No environment reward: the rule adds 0 (as a None rule does for single turns).
    (verdict,) = CombinedRM(None, rules).score([trajectory_sample(_trajectory(env_reward=None))])
    assert verdict.reward == 2.0 * -1.0


def test_trajectories_are_judged_as_they_end():
    # Partial colocation's overlap for multi-turn: a trajectory that ends early is judged while
    # another still waits for its slow tool.
    import asyncio
    import time

    from yatt.genrm import score_as_completed
    from yatt.rollout import SamplingParams
    from yatt.rollout.env import EnvConfig, MultiTurnRollout
    from yatt.rollout.env.testing import COMPACT_TOOL_TEMPLATE, ScriptedEngine
    from yatt.testing import make_tokenizer

    class Slow:
        def reset(self, **row):
            self.seconds = row["seconds"]

        def wait(self) -> str:
            """Wait a while."""
            time.sleep(self.seconds)
            return "done"

    call = '<tool_call>{"name": "wait", "arguments": {}}</tool_call>'
    tokenizer = make_tokenizer()
    tokenizer.chat_template = COMPACT_TOOL_TEMPLATE
    engine = ScriptedEngine(
        tokenizer=tokenizer, respond=lambda text: "ok" if "<|im_start|>tool" in text else call
    )
    rollout = MultiTurnRollout(engine, EnvConfig(tool_timeout_s=5.0), environments=[Slow])
    judged_at = {}

    def judge(prompt_text, vote_index):
        judged_at[prompt_text.count("slow")] = time.monotonic()
        return "Yes"

    genrm = GenRM(
        FakeJudgeEngine(judge=judge), template=trajectory_template(), parser=YesNoParser()
    )
    rows = [{"prompt": "slow", "seconds": 1.5}, {"prompt": "fast", "seconds": 0.0}]

    async def main():
        stream = rollout.stream(rows, SamplingParams())
        scored = await score_as_completed(stream, genrm, trajectory_sample)
        return scored, time.monotonic()

    scored, end = asyncio.run(main())
    assert [t.row["prompt"] for t in scored.completions] == ["fast", "slow"]
    assert [v.reward for v in scored.verdicts] == [1.0, 1.0]
    # The fast trajectory's verdict came about 1.5 s before the slow one ended.
    assert end - judged_at[0] > 1.0
