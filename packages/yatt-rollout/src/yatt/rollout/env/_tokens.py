"""The token layer: a conversation's ids from the chat template, and the ids a turn appends.

The model's own turns are never re-rendered or re-tokenized: the driver keeps the ids the
engine sampled. What enters between two turns (the rest of the assistant's turn after its
end token, the tool or user messages, the next assistant header) comes from the template:

    prev = ids(template(messages + [assistant]))                 ...<|im_end|>\n
    next = ids(template(messages + [assistant] + new, gen=True))  ...<|im_end|>\n<|im_start|>user...
    appended = next[after the assistant's end token:]             \n<|im_start|>user ... assistant\n

The assistant's end token is found by counting: it is the k-th end token of `next`, where k
is the count in `prev`. So a template that renders earlier turns differently once more follow
(Qwen3 drops an earlier turn's empty <think></think>) still gives the right ids; whether
`prev` was an exact prefix of `next` is reported (`is_prefix_exact`).

Images (a vision-language policy; env/_images.py): a message's image content parts render as
one placeholder token each (Qwen2-VL's <|image_pad|>, `image_token_id`); the ids given back
hold each placeholder expanded to its image's token count (`image_tokens`, in image order), as
the model's processor expands a single-turn prompt's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class TemplateMismatchError(ValueError):
    """The template's rendering cannot be lined up with the sampled turn (no end token)."""


@dataclass(frozen=True)
class Appended:
    ids: list[int]
    is_prefix_exact: bool


class ChatTokens:
    """Renders conversations (with the tools' schemas) through a tokenizer's chat template."""

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[dict[str, Any]] = (),
        template_kwargs: dict[str, Any] | None = None,
        *,
        image_token_id: int | None = None,
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the tokenizer has no chat_template; multi-turn rollouts render tool messages "
                "with it (set tokenizer.chat_template)"
            )
        self.tokenizer = tokenizer
        self.tools = list(tools) or None
        self.template_kwargs = dict(template_kwargs or {})
        self.image_token_id = image_token_id

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        # The template writes special tokens as text; they map back to their ids here.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(
        self, messages: Sequence[dict[str, Any]], *, image_tokens: Sequence[int] = ()
    ) -> list[int]:
        """The first prompt: the conversation so far and the assistant's header, each image
        placeholder expanded to image_tokens[i] tokens (the messages' images, in order)."""
        ids = self.encode(self.render(messages, add_generation_prompt=True))
        return self.expand_images(ids, image_tokens, where="the first prompt")

    def expand_images(
        self, ids: list[int], image_tokens: Sequence[int], *, where: str
    ) -> list[int]:
        """`ids` with its k-th image placeholder repeated image_tokens[k] times.
        TemplateMismatchError when the template wrote another number of placeholders."""
        token = self.image_token_id
        found = 0 if token is None else ids.count(token)
        if found != len(image_tokens):
            raise TemplateMismatchError(
                f"the chat template wrote {found} image placeholder(s) in {where} for "
                f"{len(image_tokens)} image(s); it must render each image content part "
                "({'type': 'image', ...}) as one image token"
                + ("" if token is not None else " (no image token: the policy takes no images)")
            )
        if not image_tokens:
            return ids
        counts = iter(image_tokens)
        out: list[int] = []
        for t in ids:
            if t == token:
                out += [t] * next(counts)
            else:
                out.append(t)
        return out

    def appended_ids(
        self,
        messages: Sequence[dict[str, Any]],
        new_messages: Sequence[dict[str, Any]],
        *,
        end_token_id: int,
        image_tokens: Sequence[int] = (),
    ) -> Appended:
        """The ids after the last assistant turn's `end_token_id` up to the next assistant header.

        `messages` ends with that assistant turn; `new_messages` are what follows it (tool
        results, a user message). TemplateMismatchError when the rendering holds no end token
        for the assistant turn (a template that does not close turns with it), or another
        number of image placeholders after it than `image_tokens` (the new messages' images'
        token counts, in order) has entries.
        """
        prev = self.encode(self.render(messages, add_generation_prompt=False))
        nxt = self.encode(self.render([*messages, *new_messages], add_generation_prompt=True))
        count = prev.count(end_token_id)
        positions = [i for i, t in enumerate(nxt) if t == end_token_id]
        if count == 0 or len(positions) < count:
            raise TemplateMismatchError(
                f"the chat template does not end the assistant's turn with token {end_token_id} "
                "(the token the engine stopped at); add it to SamplingParams.stop_token_ids "
                "only if the template closes turns with it"
            )
        cut = positions[count - 1] + 1
        ids = self.expand_images(nxt[cut:], image_tokens, where="the appended ids")
        return Appended(ids=ids, is_prefix_exact=nxt[: len(prev)] == prev)
