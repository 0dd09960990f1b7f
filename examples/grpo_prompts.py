"""The trainer's prompt encoding, now yatt.core's (yatt.core.PromptEncoder, yatt.core.Prompt):
this module keeps the trainer's names working while its callers move to the core API.

    encoder = PromptEncoder(cfg, tokenizer)          the core encoder, built from TrainConfig
    ShardedLoader(..., prompt_encoder=encoder)        the loader counts tokens through it
    prompts = encoder.encode(loader.next_batch())     rows -> Prompt(row, ids, images, vision)
    p.request()                                       rollout.Request(**p.request_fields())

Prompt.request() stays here because yatt-core does not depend on yatt-rollout; a caller can
write rollout.Request(**p.request_fields(), ...) and drop it.
"""

from __future__ import annotations

from typing import Any

from yatt import core, rollout
from yatt.core import check_takes_images  # noqa: F401  (the trainer's name)


class Prompt(core.Prompt):
    """yatt.core.Prompt with the rollout request the trainer sends."""

    def request(self, **fields: Any) -> rollout.Request:
        """A rollout request of this prompt (`fields` override or add Request fields)."""
        return rollout.Request(**{**self.request_fields(), **fields})


class PromptEncoder(core.PromptEncoder):
    """yatt.core.PromptEncoder configured from the trainer's config."""

    prompt_type = Prompt

    def __init__(self, cfg: Any, tokenizer: Any) -> None:
        super().__init__(
            tokenizer,
            model_dir=cfg.policy.model_dir,
            prompt_key=cfg.data.prompt_key,
            image_key=cfg.data.image_key or None,
            max_images=cfg.data.max_images,
            should_apply_chat_template=cfg.data.apply_chat_template,
            max_prompt_tokens=cfg.rollout.max_prompt_tokens,
            # checked by the encoder; a config from before the field has none
            chat_template_kwargs=getattr(cfg.data, "chat_template_kwargs", None) or {},
        )
