"""Multi-turn rollouts on the built-in engine and a tiny model (CPU): the sampled ids are the
model's own continuations of the exact sequence (observations included) and each logprob is
the model's, checked against a plain forward pass of the same model."""

NUM_GPUS = 0

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from yatt.rollout import BuiltinEngine, EngineConfig, SamplingParams
from yatt.rollout.env import ChatTokens, EnvConfig, MultiTurnRollout
from yatt.rollout.env.testing import COMPACT_TOOL_TEMPLATE
from yatt.testing import make_tiny_causal_lm

CALL = '<tool_call>{"name": "bump", "arguments": {"by": 1}}</tool_call>'
PROMPT = [{"role": "user", "content": "count"}]


class Tally:
    def reset(self, **row):
        self.total = 0

    def bump(self, by: int) -> int:
        """Add to the total.

        Args:
            by: how much
        """
        self.total += by
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


def _fit_tool_caller(path, steps=120):
    """A tiny model fitted to answer every turn with CALL (loss on its turns only)."""
    model = make_tiny_causal_lm(path, arch="qwen2", seed=0, max_position_embeddings=512)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = COMPACT_TOOL_TEMPLATE
    tokenizer.save_pretrained(path)
    from transformers.utils import get_json_schema

    tokens = ChatTokens(tokenizer, [get_json_schema(Tally.bump)])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call_ids = [*tokens.encode(CALL), im_end]
    ids, labels = tokens.prompt_ids(PROMPT), None
    labels = [-100] * len(ids)
    messages = list(PROMPT)
    for total in range(1, 4):  # three rounds of call -> result
        ids, labels = ids + call_ids, labels + call_ids
        call = {"type": "function", "function": {"name": "bump", "arguments": {"by": 1}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        result = [{"role": "tool", "content": str(total)}]
        appended = tokens.appended_ids(messages, result, end_token_id=im_end).ids
        messages += result
        ids, labels = ids + appended, labels + [-100] * len(appended)
    torch.manual_seed(0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.tensor([ids]), torch.tensor([labels])
    for _ in range(steps):
        loss = model(input_ids=batch[0], labels=batch[1]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(path)
    return loss.item()


@pytest.fixture(scope="module")
def tool_caller_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool-caller")
    assert _fit_tool_caller(path) < 0.05
    return path


def test_builtin_engine_multi_turn_is_token_exact(tool_caller_dir):
    engine = BuiltinEngine(
        tool_caller_dir,
        config=EngineConfig(max_batch_size=4, max_seq_len=512, region_prefix="multiturn"),
    )
    try:
        rollout = MultiTurnRollout(
            engine, EnvConfig(max_turns=3, max_trajectory_tokens=500), environments=[Tally]
        )
        rows = [{"messages": PROMPT}] * 2
        # The tiny tokenizer's EOS is <|eos|>; its template closes turns with <|im_end|>.
        im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
        sampling = SamplingParams(n=2, temperature=0.0, max_new_tokens=80, stop_token_ids=(im_end,))
        trajectories, stats = asyncio.run(rollout.run(rows, sampling))
    finally:
        engine.close()
    assert len(trajectories) == 4 and stats.num_tool_calls == 12
    model = AutoModelForCausalLM.from_pretrained(tool_caller_dir).eval()
    for trajectory in trajectories:
        assert (trajectory.end_cause, trajectory.num_turns, trajectory.env_reward) == (
            "max_turns",
            3,
            3.0,
        )
        assert [[(c.name, c.arguments) for c in turn] for turn in trajectory.tool_calls] == [
            [("bump", {"by": 1})]
        ] * 3
        # The third turn's result is in the messages; its tokens were not appended.
        assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == ["1", "2", "3"]
        sequence = trajectory.prompt_ids + trajectory.response_ids
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        start = len(trajectory.prompt_ids)
        positions = [start + i for i, m in enumerate(trajectory.loss_mask) if m]
        # Greedy: each sampled id is the model's argmax given everything before it, tool
        # results and template tokens included; its logprob is the model's (float32 sums).
        assert all(sequence[p] == int(logits[p - 1].argmax()) for p in positions)
        expected = torch.tensor([float(logprobs[p - 1, sequence[p]]) for p in positions])
        got = torch.tensor([trajectory.logprobs[p - start] for p in positions])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
