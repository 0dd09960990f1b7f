"""Data rows -> the policy's prompts (token ids, images included): what a trainer's rollouts read.

    encoder = PromptEncoder(tokenizer, model_dir=..., ...)   before any model loads
    ShardedLoader(..., prompt_encoder=encoder)   the loader's length check: ids kept, so a
                                                 prompt is tokenized once
    encoder.check(loader.first_rows(), source=...)   the data's first rows give prompts
    prompts = encoder.encode(loader.next_batch())    rows -> Prompt(row, ids, images, vision)
    prompt.request_fields()                      prompt_ids, images, image_inputs of a rollout
                                                 request: the images processed once, here

A row's prompt (RowPrompt) is text or a list of {role, content} messages. Messages always go
through the tokenizer's chat template (plain text only when asked: instruct models), with
`chat_template_kwargs` passed to the template (e.g. {"enable_thinking": False} for Qwen3); a
template that refuses a row's messages (an unknown role) makes it a bad_prompt skip.

With an image_key a row's images (opened by the loader) go into the prompt: the chat template
writes one placeholder per image before the prompt's text, the image processor sizes each
image and its placeholder becomes the image's tokens (encode_vision_prompt); the VisionInputs
stay with the prompt, for the train step, the KL reference and the cost model.

A row the loader passed but that cannot be used (messages the chat template refuses, more than
max_images images, an image the processor refuses, a prompt that with its image tokens no
longer fits the rollout engine) is skipped and counted like the loader's skips
(skipped_by_cause), never a crash mid-run.

A vision-language policy may sample its vision special tokens (<|image_pad|>, ...): the policy
refuses an image token without its image, so a response ends before one (cut_token_ids).
Which tokens those are, and whether the policy takes images, is VisionModel's to say.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import jinja2

from yatt.core.data._loader import ROW_INDEX_KEY
from yatt.core.data._row_fields import get_field
from yatt.core.vision._vision_inputs import (
    VisionInputError,
    VisionInputs,
    encode_vision_prompt,
    load_image_processor,
)
from yatt.core.vision._vision_model import VisionModel

logger = logging.getLogger("yatt.core")

# A row's prompt as stored: text, or {role, content} messages.
RowPrompt = str | list[dict[str, str]]
# Skip causes of the images in rows the loader passed; counted beside the loader's own.
IMAGE_SKIP_CAUSES = ("too_many_images", "image_count")
# Prompts the loader counted are kept until encoded, at most this many (a row counted then
# skipped for another cause is never encoded).
MAX_KEPT_PROMPTS = 4096
_MAX_LOGGED_SKIPS = 20
# apply_chat_template's own arguments that prompt encoding sets: not template variables.
RESERVED_TEMPLATE_ARGS = frozenset(
    {"conversation", "messages", "add_generation_prompt", "tokenize", "tools", "chat_template"}
)
# VisionInputError causes -> skip causes.
VISION_ERROR_CAUSES = {
    "no_image": "no_image",
    "bad_image": "bad_image",
    "too_large": "image_too_large",
    "image_count": "image_count",
}


class PromptError(ValueError):
    """The policy's chat template refused a row's messages (a strict template, Gemma or
    Mistral style, raises on a role it does not know or on roles that do not alternate)."""


def prompt_ids(
    prompt: RowPrompt,
    tokenizer: Any,
    should_apply_chat_template: bool,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of a row's prompt: a message list (or, when asked, plain text as one user
    message) through the tokenizer's chat template, with the assistant turn opened and
    chat_template_kwargs given to the template. Raises PromptError when the template refuses
    the messages, or when the text is not valid Unicode: the row is a bad_prompt skip."""
    if isinstance(prompt, str) and not should_apply_chat_template:
        return tokenizer(_checked_text(prompt), add_special_tokens=False)["input_ids"]
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **dict(chat_template_kwargs or {})
        )
    except jinja2.TemplateError as exc:  # raise_exception(...) in the template, or an undefined
        roles = [message.get("role") for message in messages]
        raise PromptError(f"the policy's chat template refused roles {roles}: {exc}") from None
    # The chat template already wrote any BOS it wants; don't add a second one.
    return tokenizer(_checked_text(text), add_special_tokens=False)["input_ids"]


def _checked_text(text: str) -> str:
    """`text`, or PromptError when it holds a lone surrogate (JSON's "\\ud800", in a role or a
    content): a fast tokenizer raises a TypeError naming nothing on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise PromptError(f"the prompt is not valid Unicode text ({err.reason})") from None
    return text


def prompt_token_counter(
    tokenizer: Any,
    should_apply_chat_template: bool,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> Callable[[RowPrompt], int]:
    """A row prompt's token count for a length check; 0 for a prompt the chat template
    refuses (the prompt encoder skips it, counted as bad_prompt)."""

    def count_tokens(prompt: RowPrompt) -> int:
        try:
            return len(
                prompt_ids(prompt, tokenizer, should_apply_chat_template, chat_template_kwargs)
            )
        except PromptError:
            return 0

    return count_tokens


def prompt_text(prompt: RowPrompt) -> str:
    """What a judge reads as the prompt: a message list as "role: content" lines."""
    if isinstance(prompt, list):
        return "\n".join(f"{message['role']}: {message['content']}" for message in prompt)
    return prompt


def with_images(prompt: RowPrompt, num_images: int) -> list[dict]:
    """The prompt as messages whose first user turn starts with one image part per image."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    messages = [dict(message) for message in messages]
    first_user = next((m for m in messages if m["role"] == "user"), messages[0])
    first_user["content"] = [{"type": "image"}] * num_images + [
        {"type": "text", "text": first_user["content"]}
    ]
    return messages


def check_takes_images(model_dir: str, image_key: str) -> None:
    """Before any model loads: an image dataset needs a policy that takes images (a vision
    tower of a family yatt implements, its image processor saved beside it)."""
    why_not = VisionModel.from_pretrained(model_dir).why_no_images()
    if why_not is not None:
        raise ValueError(
            f"data.image_key={image_key!r} gives the prompts images, but policy.model_dir="
            f"{model_dir!r} {why_not}; use a vision-language policy (a Qwen2-VL family model), "
            "or set data.image_key='' for text prompts"
        )


@dataclass(frozen=True)
class Prompt:
    """One row as the policy reads it: token ids (image tokens expanded) and its images."""

    row: dict
    ids: list[int]
    images: list | None = None  # RGB PIL images, as a rollout engine takes them
    vision: VisionInputs | None = None  # the same images as the policy takes them

    def request_fields(self) -> dict[str, Any]:
        """The fields of a rollout request of this prompt (yatt.rollout.Request(**fields)):
        its ids, its images, and the images as processed here (image_inputs), so the built-in
        engine does not run the image processor again."""
        return {"prompt_ids": self.ids, "images": self.images, "image_inputs": self.vision}


class PromptEncoder:
    """Rows -> Prompts for one rank; see the module docstring."""

    # The type encode() builds; a subclass of Prompt may add methods (a trainer's own).
    prompt_type: type[Prompt] = Prompt

    def __init__(
        self,
        tokenizer: Any,
        *,
        model_dir: str,
        prompt_key: str = "prompt",
        image_key: str | None = None,
        max_images: int = 1,
        should_apply_chat_template: bool = True,
        max_prompt_tokens: int | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """model_dir: the policy's folder (its vision config and image processor). prompt_key
        and image_key: the row fields (dotted for nested fields, e.g. "extra.question").
        max_prompt_tokens: the rollout engine's room for a prompt (the loader skips longer
        text prompts; encode skips a prompt whose image tokens make it longer)."""
        if chat_template_kwargs is not None and (
            not isinstance(chat_template_kwargs, Mapping)
            or not all(isinstance(key, str) for key in chat_template_kwargs)
        ):
            raise ValueError(
                f"chat_template_kwargs={chat_template_kwargs!r} must be a mapping of the chat "
                'template\'s variables (names as keys), e.g. {"enable_thinking": false}'
            )
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.image_key = image_key or None
        self.max_images = max_images
        self.should_apply_chat_template = should_apply_chat_template
        self.max_prompt_tokens = max_prompt_tokens
        reserved = sorted(set(chat_template_kwargs or ()) & RESERVED_TEMPLATE_ARGS)
        if reserved:
            raise ValueError(
                f"chat_template_kwargs={dict(chat_template_kwargs)!r}: {reserved} are set by "
                "the prompt encoder itself; give only the template's own variables, e.g. "
                '{"enable_thinking": false}'
            )
        self._chat_template_kwargs = dict(chat_template_kwargs or {})
        vision = VisionModel.from_pretrained(model_dir)
        # Any vision-language policy, images or not: it may sample these tokens.
        self.cut_token_ids = vision.stop_token_ids
        self.skipped: Counter[str] = Counter()
        # count_tokens' ids by (prompt, number of image placeholders), for this encoder's
        # template variables (fixed above).
        self._counted: dict[tuple[tuple[str, str], int], list[int]] = {}
        if self.image_key is not None:
            self.image_processor = load_image_processor(model_dir)
            self.image_token_id = vision.image_token_id

    @property
    def chat_template_kwargs(self) -> Mapping[str, Any]:
        """The template variables, read-only: the ids count_tokens keeps (keyed by the prompt
        alone) were rendered with them, so a change afterwards would let encode() reuse stale
        ids. (A view, not a stored proxy: the encoder still pickles and deep-copies.)"""
        return MappingProxyType(self._chat_template_kwargs)

    @property
    def takes_images(self) -> bool:
        return self.image_key is not None

    def count_tokens(self, prompt: RowPrompt) -> int:
        """The loader's length check: the prompt's tokens as the policy reads them; with
        images, with one image placeholder (a row has at least one, each at least a token: a
        lower bound of the prompt with its images). 0 for a prompt the chat template refuses
        (encode skips it: bad_prompt). The ids are kept for encode: tokenized once."""
        num_images = 0 if self.image_key is None else 1
        try:
            ids = self._tokenize(prompt, num_images)
        except PromptError:
            return 0
        self._counted[_prompt_key(prompt), num_images] = ids
        if len(self._counted) > MAX_KEPT_PROMPTS:  # the oldest: counted, never encoded
            del self._counted[next(iter(self._counted))]
        return len(ids)

    def encode(self, rows: Sequence[dict], *, should_count: bool = True) -> list[Prompt]:
        """The usable rows' prompts; the others skipped (counted when should_count)."""
        prompts = []
        for row in rows:
            prompt, cause, reason = self._encode(row)
            if prompt is not None:
                prompts.append(prompt)
                continue
            if should_count:
                self.skipped[cause] += 1
            if not should_count or sum(self.skipped.values()) <= _MAX_LOGGED_SKIPS:
                logger.warning("skipping dataset row %s: %s", row.get(ROW_INDEX_KEY), reason)
        return prompts

    def check(self, rows: Sequence[dict], *, source: str) -> None:
        """Before any model loads: the data's first usable rows (the loader's first_rows())
        give at least one prompt, else a ValueError with the causes (a chat template that
        refuses every row's roles) instead of a run that skips every row it draws."""
        reasons: Counter[str] = Counter()
        for row in rows:
            prompt, cause, reason = self._encode(row)
            if prompt is not None:
                return
            reasons[f"{cause}: {reason}"] += 1
        raise ValueError(
            f"{source}: none of its first {len(rows)} usable rows gives a prompt the policy "
            f"takes; {dict(reasons)}"
        )

    def skipped_by_cause(self, loader: Any) -> dict[str, int]:
        """The loader's skip counts plus this encoder's (every cause present, zeros too)."""
        counts = dict(loader.skipped_by_cause())
        for cause in IMAGE_SKIP_CAUSES if self.takes_images else ():
            counts.setdefault(cause, 0)
        for cause, count in self.skipped.items():
            counts[cause] = counts.get(cause, 0) + count
        return counts

    def _encode(self, row: dict) -> tuple[Prompt | None, str, str]:
        try:
            return self._encode_row(row)
        except PromptError as err:  # the chat template refused the row's messages
            return None, "bad_prompt", str(err)

    def _encode_row(self, row: dict) -> tuple[Prompt | None, str, str]:
        text = get_field(row, self.prompt_key)
        if self.image_key is None:
            return self.prompt_type(row, self._ids(text, 0)), "", ""
        images = get_field(row, self.image_key)
        images = [
            image.convert("RGB") for image in (images if isinstance(images, list) else [images])
        ]
        if len(images) > self.max_images:
            return (
                None,
                "too_many_images",
                f"{len(images)} images, over data.max_images={self.max_images}",
            )
        try:
            ids, vision = encode_vision_prompt(
                self._ids(text, len(images)),
                images,
                image_processor=self.image_processor,
                image_token_id=self.image_token_id,
            )
        except VisionInputError as err:
            return None, VISION_ERROR_CAUSES.get(err.cause, "bad_image"), str(err)
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            return (
                None,
                "too_long",
                (
                    f"the prompt with its image tokens takes {len(ids)} tokens, over "
                    f"rollout.engine.max_seq_len - rollout.max_new_tokens = {self.max_prompt_tokens}"
                ),
            )
        return self.prompt_type(row, ids, images, vision), "", ""

    def _ids(self, prompt: RowPrompt, num_images: int) -> list[int]:
        """The prompt's ids: those count_tokens made, else tokenized now."""
        counted = self._counted.pop((_prompt_key(prompt), num_images), None)
        return counted if counted is not None else self._tokenize(prompt, num_images)

    def _tokenize(self, prompt: RowPrompt, num_images: int) -> list[int]:
        kwargs = self.chat_template_kwargs
        if num_images == 0:
            return prompt_ids(prompt, self.tokenizer, self.should_apply_chat_template, kwargs)
        return prompt_ids(with_images(prompt, num_images), self.tokenizer, True, kwargs)


def _prompt_key(prompt: RowPrompt) -> tuple[str, str]:
    """A row's prompt (text, or {role, content} messages) as a key of count_tokens' ids."""
    if isinstance(prompt, str):
        return "text", prompt
    return "messages", json.dumps(prompt, sort_keys=True, default=str)
