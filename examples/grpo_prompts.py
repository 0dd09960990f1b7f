"""Data rows -> the policy's prompts, images included: what the trainer's rollouts read.

    encoder = PromptEncoder(cfg, tokenizer)      before any model loads: checks the policy
    ShardedLoader(..., count_tokens=encoder.count_tokens)   the ids kept: tokenized once
    encoder.check(loader.first_rows(), source=...)  and that the data's first rows give prompts
    prompts = encoder.encode(loader.next_batch())  rows -> Prompt(row, ids, images, vision)
    p.request()                                   Request(prompt_ids, images, image_inputs):
                                                  the images processed once, here
    rollout_samples(..., vision_inputs=[p.vision ...], cut_at_token_ids=encoder.cut_token_ids)

With data.image_key a row's images (opened by the loader: a path relative to the data file,
bytes, a `datasets` Image, or a list of them) go into the prompt: the chat template writes one
placeholder per image before the prompt's text, the image processor sizes each image and its
placeholder becomes the image's tokens (yatt.core.encode_vision_prompt); the VisionInputs stay
with the prompt's samples, for the train step, the KL reference and the cost model.

A row the loader passed but that cannot be used (messages the chat template refuses, more than
data.max_images images, an image the processor refuses, a prompt that with its image tokens no
longer fits the rollout engine) is skipped and counted like the loader's skips
(data/skipped_rows/<cause>), never a crash mid-run.
A policy that takes no images given an image dataset is refused here, before models load.

A vision-language policy may sample its vision special tokens (<|image_pad|>, ...): the policy
refuses an image token without its image, so a response ends before one (cut_token_ids: the
engine stops there, rollout_samples cuts it; counted as response/cut_at_vision_token). Which
tokens those are, and whether the policy takes images, is yatt.core.VisionModel's to say (from
the model's own config): this module reads no model config itself.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grpo_data import PromptError, prompt_ids

from yatt import core, rollout

logger = logging.getLogger("train_grpo")
# Skip causes of the images in rows the loader passed; counted beside the loader's own.
IMAGE_SKIP_CAUSES = ("too_many_images", "image_count")
# Prompts the loader counted (count_tokens) are kept until encoded, at most this many (a row
# counted then skipped for another cause is never encoded).
MAX_KEPT_PROMPTS = 4096
# yatt.core.VisionInputError causes -> skip causes.
VISION_ERROR_CAUSES = {
    "no_image": "no_image",
    "bad_image": "bad_image",
    "too_large": "image_too_large",
    "image_count": "image_count",
}


@dataclass(frozen=True)
class Prompt:
    """One row as the policy reads it: token ids (image tokens expanded) and its images."""

    row: dict
    ids: list[int]
    images: list | None = None  # RGB PIL images, as the rollout engine takes them
    vision: core.VisionInputs | None = None  # the same images as the policy takes them

    def request(self, **fields: Any) -> rollout.Request:
        """A rollout request of this prompt (`fields` override or add Request fields): its ids,
        its images, and the images as processed here (Request.image_inputs), so the built-in
        engine does not run the image processor again."""
        prompt = {"prompt_ids": self.ids, "images": self.images, "image_inputs": self.vision}
        return rollout.Request(**{**prompt, **fields})


def check_takes_images(model_dir: str, image_key: str) -> None:
    """Before any model loads: an image dataset needs a policy that takes images (a vision
    tower of a family yatt implements, its image processor saved beside it; TrainConfig checks
    the backend is "torch"). What the model takes is yatt.core.VisionModel's to say."""
    why_not = core.VisionModel.from_pretrained(model_dir).why_no_images()
    if why_not is not None:
        raise ValueError(
            f"data.image_key={image_key!r} gives the prompts images, but policy.model_dir="
            f"{model_dir!r} {why_not}; use a vision-language policy (a Qwen2-VL family model), "
            "or set data.image_key='' for text prompts"
        )


def with_images(prompt: Any, num_images: int) -> list[dict]:
    """The prompt as messages whose first user turn starts with one image part per image."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    messages = [dict(message) for message in messages]
    first_user = next((m for m in messages if m["role"] == "user"), messages[0])
    first_user["content"] = [{"type": "image"}] * num_images + [
        {"type": "text", "text": first_user["content"]}
    ]
    return messages


class PromptEncoder:
    """Rows -> Prompts for one rank; see the module docstring."""

    def __init__(self, cfg, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.prompt_key = cfg.data.prompt_key
        self.image_key = cfg.data.image_key or None
        self.max_images = cfg.data.max_images
        self.should_apply_chat_template = cfg.data.apply_chat_template
        self.max_prompt_tokens = cfg.rollout.max_prompt_tokens
        vision = core.VisionModel.from_pretrained(cfg.policy.model_dir)
        # Any vision-language policy, images or not: it may sample these tokens.
        self.cut_token_ids = vision.stop_token_ids
        self.skipped: Counter[str] = Counter()
        self._counted: dict[
            tuple[tuple[str, str], int], list[int]
        ] = {}  # count_tokens' ids, for encode
        if self.image_key is not None:  # checked when the config was built (checked_images)
            self.image_processor = core.load_image_processor(cfg.policy.model_dir)
            self.image_token_id = vision.image_token_id

    @property
    def takes_images(self) -> bool:
        return self.image_key is not None

    def count_tokens(self, prompt: Any) -> int:
        """The loader's length check (ShardedLoader(count_tokens=...)): the prompt's tokens as
        the policy reads them; with images, with one image placeholder (a row has at least
        one, each at least a token: a lower bound of the prompt with its images). 0 for a
        prompt the chat template refuses (encode skips it: bad_prompt). The ids are kept for
        encode, so a prompt is tokenized once."""
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
            if not should_count or sum(self.skipped.values()) <= 20:
                logger.warning("skipping dataset row %s: %s", row.get(core.ROW_INDEX_KEY), reason)
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

    def _encode(self, row: dict) -> tuple[Prompt | None, str, str]:
        try:
            return self._encode_row(row)
        except PromptError as err:  # the chat template refused the row's messages
            return None, "bad_prompt", str(err)

    def _encode_row(self, row: dict) -> tuple[Prompt | None, str, str]:
        if self.image_key is None:
            return Prompt(row, self._ids(row[self.prompt_key], 0)), "", ""
        images = row[self.image_key]
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
            ids, vision = core.encode_vision_prompt(
                self._ids(row[self.prompt_key], len(images)),
                images,
                image_processor=self.image_processor,
                image_token_id=self.image_token_id,
            )
        except core.VisionInputError as err:
            return None, VISION_ERROR_CAUSES.get(err.cause, "bad_image"), str(err)
        if len(ids) > self.max_prompt_tokens:
            return (
                None,
                "too_long",
                (
                    f"the prompt with its image tokens takes {len(ids)} tokens, over "
                    f"rollout.engine.max_seq_len - rollout.max_new_tokens = {self.max_prompt_tokens}"
                ),
            )
        return Prompt(row, ids, images, vision), "", ""

    def _ids(self, prompt: Any, num_images: int) -> list[int]:
        """The prompt's ids: those count_tokens made, else tokenized now."""
        counted = self._counted.pop((_prompt_key(prompt), num_images), None)
        return counted if counted is not None else self._tokenize(prompt, num_images)

    def _tokenize(self, prompt: Any, num_images: int) -> list[int]:
        if num_images == 0:
            return prompt_ids(prompt, self.tokenizer, self.should_apply_chat_template)
        return prompt_ids(with_images(prompt, num_images), self.tokenizer, True)

    def skipped_by_cause(self, loader: core.ShardedLoader) -> dict[str, int]:
        """The loader's skip counts plus this encoder's (every cause present, zeros too)."""
        counts = dict(loader.skipped_by_cause())
        for cause in IMAGE_SKIP_CAUSES if self.takes_images else ():
            counts.setdefault(cause, 0)
        for cause, count in self.skipped.items():
            counts[cause] = counts.get(cause, 0) + count
        return counts


def _prompt_key(prompt: Any) -> tuple[str, str]:
    """A row's prompt (text, or {role, content} messages) as a key of count_tokens' ids."""
    if isinstance(prompt, str):
        return "text", prompt
    return "messages", json.dumps(prompt, sort_keys=True, default=str)
