"""Token-exact trajectories on two real chat templates (Qwen2.5's tools, Qwen3's with <think>),
built locally: each turn's appended ids are what the template gives for the same conversation,
the sampled ids are kept as sampled, and the loss mask marks exactly the sampled tokens."""

NUM_GPUS = 0

import asyncio

import pytest

from yatt.rollout import SamplingParams
from yatt.rollout.env import ChatTokens, EnvConfig, HermesToolParser, MultiTurnRollout
from yatt.rollout.env.testing import (
    QWEN3_TOOL_TEMPLATE,
    QWEN25_TOOL_TEMPLATE,
    TOOL_TOKENS,
    ScriptedEngine,
)
from yatt.testing import make_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first
        b: the second
    """
    return a * b


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# The conversation the scripted model holds: two tool turns (the second with two calls, so two
# tool results share one user turn), then an answer.
CONVERSATION = [
    {"role": "user", "content": "What is (2 + 3) * 4, and 1 + 1?"},
    {
        "role": "assistant",
        "content": "<think>\nFirst the sum.\n</think>\n\nLet me add.",
        "tool_calls": [_call("add", a=2, b=3)],
    },
    {"role": "tool", "content": "5", "name": "add"},
    {
        "role": "assistant",
        "content": "<think>\nNow both.\n</think>",
        "tool_calls": [_call("mul", a=5, b=4), _call("add", a=1, b=1)],
    },
    {"role": "tool", "content": "20", "name": "mul"},
    {"role": "tool", "content": "2", "name": "add"},
    {"role": "assistant", "content": "<think>\nDone.\n</think>\n\nIt is 20, and 2."},
]
ASSISTANT_AT = [i for i, m in enumerate(CONVERSATION) if m["role"] == "assistant"]


def _tokenizer(template, should_add_tool_tokens):
    tokenizer = make_tokenizer(extra_special_tokens=TOOL_TOKENS if should_add_tool_tokens else ())
    tokenizer.chat_template = template
    return tokenizer


TEMPLATES = pytest.mark.parametrize(
    ("template", "should_add_tool_tokens"),
    [
        (QWEN25_TOOL_TEMPLATE, False),
        (QWEN25_TOOL_TEMPLATE, True),
        (QWEN3_TOOL_TEMPLATE, False),
        (QWEN3_TOOL_TEMPLATE, True),
    ],
    ids=["qwen2.5-bytes", "qwen2.5-tool-tokens", "qwen3-bytes", "qwen3-tool-tokens"],
)


@TEMPLATES
def test_turns_appended_ids_and_mask_match_the_template(template, should_add_tool_tokens):
    tokenizer = _tokenizer(template, should_add_tool_tokens)
    tokens = ChatTokens(tokenizer, [_schema(add), _schema(mul)])

    def ids(messages, gen=False):
        return tokens.encode(tokens.render(messages, add_generation_prompt=gen))

    # What the model "samples" for assistant turn k: the template's text for that message,
    # without its closing <|im_end|>\n (the engine adds the stop token).
    turn_texts = []
    for at in ASSISTANT_AT:
        before = tokens.render(CONVERSATION[:at], add_generation_prompt=True)
        full = tokens.render(CONVERSATION[: at + 1], add_generation_prompt=False)
        assert full.startswith(before) and full.endswith("<|im_end|>\n")
        turn_texts.append(full[len(before) : -len("<|im_end|>\n")])

    def respond(prompt_text):
        return turn_texts[prompt_text.count("<|im_start|>assistant") - 1]

    engine = ScriptedEngine(tokenizer=tokenizer, respond=respond)
    rollout = MultiTurnRollout(
        engine, EnvConfig(max_turns=5, max_trajectory_tokens=4096), tools=[add, mul]
    )
    rows = [{"prompt": CONVERSATION[0]["content"]}]
    (trajectory,), stats = asyncio.run(rollout.run(rows, SamplingParams(max_new_tokens=200)))

    # The whole sequence is the template's rendering of the conversation, up to the final
    # <|im_end|> (what follows it is not part of the sample).
    expected = ids(CONVERSATION)
    tail = len(expected) - 1 - max(i for i, t in enumerate(expected) if t == _im_end(tokenizer))
    assert trajectory.prompt_ids + trajectory.response_ids == expected[: len(expected) - tail]
    assert trajectory.prompt_ids == ids(CONVERSATION[:1], gen=True)
    # Mask 1 exactly on each assistant turn's body and its <|im_end|>.
    expected_mask = [0] * (len(expected) - tail)
    for at in ASSISTANT_AT:
        start = len(ids(CONVERSATION[:at], gen=True))
        end = len(ids(CONVERSATION[: at + 1])) - tail
        expected_mask[start:end] = [1] * (end - start)
    assert [0] * len(trajectory.prompt_ids) + trajectory.loss_mask == expected_mask
    # The engine's logprobs at sampled positions, in order; 0 between turns.
    expected_logprobs = []
    for text in turn_texts:
        n = len(tokens.encode(text)) + 1
        expected_logprobs += [-(i + 1) / 100 for i in range(n)]
    sampled = [lp for lp, m in zip(trajectory.logprobs, trajectory.loss_mask, strict=True) if m]
    assert sampled == expected_logprobs
    assert all(
        lp == 0.0 for lp, m in zip(trajectory.logprobs, trajectory.loss_mask, strict=True) if not m
    )
    # The conversation the driver kept is the one the model held.
    assert trajectory.messages == CONVERSATION
    assert trajectory.num_turns == 3 and trajectory.end_cause == "stop"
    assert stats.num_tool_calls == 3 and not stats.tool_errors
    assert stats.num_template_rewrites == 0


@pytest.mark.parametrize("template", [QWEN25_TOOL_TEMPLATE, QWEN3_TOOL_TEMPLATE], ids=["q25", "q3"])
def test_appended_ids_written_out_by_hand(template):
    tokenizer = _tokenizer(template, False)
    tokens = ChatTokens(tokenizer, [_schema(add)])
    messages = [
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "<think>\nx\n</think>",
            "tool_calls": [_call("add", a=2, b=3)],
        },
    ]
    new = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}]
    appended = tokens.appended_ids(messages, new, end_token_id=_im_end(tokenizer))
    assert tokenizer.decode(appended.ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert appended.is_prefix_exact


def test_qwen3_turn_without_reasoning_is_rendered_differently_later_and_still_lines_up():
    # Qwen3 shows an empty <think></think> on the last assistant turn only: once a tool result
    # follows, the earlier rendering is not a prefix. The ids after its <|im_end|> are still
    # exactly the template's.
    tokenizer = _tokenizer(QWEN3_TOOL_TEMPLATE, False)
    tokens = ChatTokens(tokenizer, [_schema(add)])
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("add", a=2, b=3)]},
    ]
    new = [{"role": "tool", "content": "5"}]
    appended = tokens.appended_ids(messages, new, end_token_id=_im_end(tokenizer))
    assert not appended.is_prefix_exact
    assert tokenizer.decode(appended.ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_template_without_the_end_token_is_a_mismatch():
    from yatt.rollout.env import TemplateMismatchError

    tokenizer = _tokenizer(QWEN25_TOOL_TEMPLATE, False)
    tokens = ChatTokens(tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(TemplateMismatchError):
        tokens.appended_ids(messages, [{"role": "user", "content": "x"}], end_token_id=2)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain answer", "plain answer", []),
        (
            'ok\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
            "ok",
            [("add", {"a": 1, "b": 2}, None)],
        ),
        (
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>',
            "",
            [("a", {}, None), ("b", {"x": 1}, None)],
        ),
        ("<tool_call>{not json}</tool_call>", "", [("", {}, "not valid JSON")]),
        ('<tool_call>{"arguments": {}}</tool_call>', "", [("", {}, '"name"')]),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "", [("a", {}, "object")]),
        ('before <tool_call>{"name": "a"', "before", [("", {}, "not closed")]),
    ],
    ids=["none", "one", "two-string-args", "bad-json", "no-name", "list-args", "unclosed"],
)
def test_hermes_parser(text, content, calls):
    parsed = HermesToolParser().parse(text)
    assert parsed.content == content
    got = [(c.name, c.arguments, c.error) for c in parsed.calls]
    assert len(got) == len(calls)
    for (name, arguments, error), (want_name, want_args, want_error) in zip(
        got, calls, strict=True
    ):
        assert (name, arguments) == (want_name, want_args)
        assert (error is None) if want_error is None else (want_error in error)


def test_chat_template_kwargs_reach_the_first_prompt_and_every_turn():
    # Qwen3's enable_thinking=False opens each assistant turn with an empty think block: the
    # first prompt and the ids appended after a tool turn both end with it, and nothing else
    # changes (the sampled turn is the same text).
    tokenizer = _tokenizer(QWEN3_TOOL_TEMPLATE, True)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

    def respond(prompt_text):
        return call if "<tool_response>" not in prompt_text else "It is 5."

    def run(**config):
        engine = ScriptedEngine(tokenizer=tokenizer, respond=respond)
        env_config = EnvConfig(max_turns=3, max_trajectory_tokens=4096, **config)
        rollout = MultiTurnRollout(engine, env_config, tools=[add])
        rows = [{"prompt": "What is 2 + 3?"}]
        asyncio.run(rollout.run(rows, SamplingParams(max_new_tokens=200)))
        return engine.prompts

    plain = run()
    quiet = run(chat_template_kwargs={"enable_thinking": False})
    assert len(plain) == len(quiet) == 2
    # By the template: <think>, two newlines, </think>, two newlines after the header.
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    empty_think = [think, newline, newline, end_think, newline, newline]
    assert quiet[0] == plain[0] + empty_think
    turn = [*tokenizer.encode(call, add_special_tokens=False), _im_end(tokenizer)]
    assert plain[1][: len(plain[0]) + len(turn)] == plain[0] + turn
    appended = plain[1][len(plain[0]) + len(turn) :]
    assert quiet[1] == quiet[0] + turn + appended + empty_think


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            "enable_thinking",
            r"EnvConfig\.chat_template_kwargs='enable_thinking': must be a mapping",
        ),
        ({1: True}, r"EnvConfig\.chat_template_kwargs=\{1: True\}: must be a mapping"),
        ({"tools": []}, r"\['tools'\] are set by the token layer"),
    ],
    ids=["text", "int-key", "reserved"],
)
def test_bad_chat_template_kwargs_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EnvConfig(tools=("x.py:f",), chat_template_kwargs=kwargs)


def _schema(fn):
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def _im_end(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|im_end|>")
