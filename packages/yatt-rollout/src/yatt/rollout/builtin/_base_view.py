"""The base model under a built-in engine's LoRA adapter, as an engine of its own.

    judge_engine = policy_engine.without_adapter()   # EngineConfig(lora_mode="beside")
    GenRM(judge_engine, ...)                          # a self-judging GenRM on the policy's base

Every request it takes runs on the same engine with Request.use_adapter=False: the same
resident weights and the same KV cache (slots are shared; no second region), rows with and
without the adapter in one batch when their calls sample alike (EngineConfig.should_join_calls).
Calls that sample differently (a greedy judge beside a sampling policy) take turns with the
policy's calls, one loop at a time.

It is no placement role (it owns no memory): a trainer places the policy's engine alone and
judges while that engine is awake. abort() aborts the shared engine's running loop, the
policy's samples in it too. close() leaves the engine to its owner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from yatt.rollout._types import Completion, Request, SamplingParams


class BaseModelView:
    """An engine serving `engine`'s base (its LoRA adapter off); see the module docstring."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def _base_requests(self, requests: Sequence[Request]) -> list[Request]:
        return [
            dataclasses.replace(r, use_adapter=False) if isinstance(r, Request) else r
            for r in requests
        ]

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Completion]:
        return self.engine.generate(self._base_requests(requests), sampling)

    def stream(
        self, requests: Sequence[Request], sampling: SamplingParams
    ) -> AsyncIterator[Completion]:
        return self.engine.stream(self._base_requests(requests), sampling)

    def abort(self) -> None:
        self.engine.abort()

    def update_weights(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "update_weights on the base model's view: the base is the policy's engine's; "
            "sync the policy's engine itself"
        )

    def close(self) -> None:
        """Nothing: the engine belongs to whoever built it."""

    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def supports_label_logprobs(self) -> bool:
        return self.engine.supports_label_logprobs

    @property
    def accepts_images(self) -> bool:
        return self.engine.accepts_images

    @property
    def image_processor(self) -> Any:
        return self.engine.image_processor

    @property
    def image_token_id(self) -> int | None:
        return self.engine.image_token_id

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return self.engine.eos_token_ids
