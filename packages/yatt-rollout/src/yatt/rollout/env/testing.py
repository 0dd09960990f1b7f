"""Helpers for testing multi-turn rollouts without the hub: chat templates that render tools
the way Qwen2.5 and Qwen3 do (set one as a local tokenizer's chat_template), and a scripted
engine.

The templates follow the Qwen2.5-Instruct and Qwen3 chat templates' tool handling: the tool
schemas in the system turn, `<tool_call>{json}</tool_call>` in assistant turns, consecutive tool
results in one user turn of `<tool_response>` blocks, and for Qwen3 the `<think>` block that an
assistant turn keeps only after the last real user query.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from yatt.rollout._types import DEFAULT_BUCKET_BYTES, Completion, Request, SamplingParams

__all__ = [
    "COMPACT_TOOL_TEMPLATE",
    "QWEN2_VL_CHAT_TEMPLATE",
    "QWEN3_TOOL_TEMPLATE",
    "QWEN25_TOOL_TEMPLATE",
    "TOOL_TOKENS",
    "ScriptedEngine",
]

_TOOLS_SYSTEM = (
    "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_FORMAT = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)

_TOOL_RESPONSES = (
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
)

_CALLS = (
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- SEP }}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
)

# Qwen2.5-Instruct: a default system prompt, tool calls after "\n".
QWEN25_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- 'You are Qwen, a helpful assistant.' }}{%- endif %}"
    '{{- "' + _TOOLS_SYSTEM + '" }}'
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- "' + _TOOLS_FORMAT + '" }}'
    "{%- else %}"
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    + _CALLS.replace("{{- SEP }}", "{{- '\\n' }}")
    + "{{- '<|im_end|>\\n' }}"
    + _TOOL_RESPONSES
    + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3: no default system prompt; an assistant turn after the last real user query keeps its
# reasoning as <think>...</think> (the last turn always shows the block), earlier ones drop it.
QWEN3_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    '{{- "' + _TOOLS_SYSTEM[4:] + '" }}'
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- "' + _TOOLS_FORMAT + '" }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and "
    "not (message.content.startswith('<tool_response>') and "
    "message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    + _CALLS.replace(
        "{{- SEP }}",
        "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}",
    )
    + "{{- '<|im_end|>\\n' }}"
    + _TOOL_RESPONSES
    + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# A short template in the same tool-call format, for tiny models with short contexts: the
# system turn lists the tools' names only, a tool result is a "tool" turn.
COMPACT_TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}"
    "{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    + _CALLS.replace("{{- SEP }}", "").replace("\\n", "")
    + "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2-VL-Instruct's chat template as published with the model (chat_template.json; Qwen2.5-VL's
# is the same): an image content part ({"type": "image", ...}, or any part with an "image"
# key) is one <|vision_start|><|image_pad|><|vision_end|> whatever the role, a tool message is a
# "tool" turn, and tools and tool calls are not rendered. Set it on a tokenizer with the vision
# tokens (yatt.testing.make_tokenizer(extra_special_tokens=yatt.testing.VISION_TOKENS)).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# What Qwen's tokenizers add as single tokens; a test tokenizer may add them
# (yatt.testing.make_tokenizer(extra_special_tokens=TOOL_TOKENS)) or spell them out in bytes.
TOOL_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)


@dataclass(kw_only=True)
class ScriptedEngine:
    """A RolloutEngine whose response to a prompt is `respond(prompt_text)` plus <|im_end|>.

    Each response token's logprob is -(position + 1) / 100, so tests can check they are kept.
    `delay_s(prompt_text)` sleeps before answering (trajectories that take different times).
    Records every prompt's ids (`prompts`) and every request (`requests`).
    """

    tokenizer: Any
    respond: Callable[[str], str]
    delay_s: Callable[[str], float] = lambda text: 0.0
    prompts: list[list[int]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    finish_reason: str = "stop"

    def _complete(self, request: Request, sampling: SamplingParams) -> Completion:
        text = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        ids = self.tokenizer.encode(self.respond(text), add_special_tokens=False)
        limit = request.max_new_tokens or sampling.max_new_tokens
        reason = self.finish_reason
        if reason == "stop":
            ids = [*ids, self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        if len(ids) > limit:
            ids, reason = ids[:limit], "length"
        return Completion(
            request_index=0,
            sample_index=0,
            prompt_ids=list(request.prompt_ids),
            response_ids=ids,
            logprobs=[-(i + 1) / 100 for i in range(len(ids))],
            finish_reason=reason,
            request_id=request.request_id,
        )

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Completion]:
        out = []
        for i, request in enumerate(requests):
            self.prompts.append(list(request.prompt_ids))
            self.requests.append(request)
            completion = self._complete(request, sampling)
            completion.request_index = i
            out.append(completion)
        return out

    async def stream(
        self, requests: Sequence[Request], sampling: SamplingParams
    ) -> AsyncIterator[Completion]:
        for i, request in enumerate(requests):
            text = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
            await asyncio.sleep(self.delay_s(text))
            self.prompts.append(list(request.prompt_ids))
            self.requests.append(request)
            completion = self._complete(request, sampling)
            completion.request_index = i
            yield completion

    def update_weights(
        self, named_tensors: Iterable[Any], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake_up(self, tags: Sequence[str] | None = ("weights", "kv_cache")) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass
