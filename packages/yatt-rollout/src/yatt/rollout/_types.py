"""The rollout engine protocol and the values that cross it.

Every engine (built-in, vLLM, SGLang) takes `Request`s and `SamplingParams` and returns
`Completion`s; the GenRM and the trainer depend only on this module.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "abort"]

DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    """How to sample; validated on construction so a bad value fails before any GPU work."""

    n: int = 1  # samples per prompt (a GRPO group)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 disables top-k
    # Tokens whose probability is below min_p x the likeliest token's are dropped; 0 = off.
    min_p: float = 0.0
    # CTRL's penalty (Keskar et al. 2019, as HF and vLLM apply it): the logit of every token
    # already in the prompt or the response is divided by it when > 0, multiplied when < 0;
    # 1 = off, > 1 discourages repeats.
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these
    seed: int | None = None  # same seed + same inputs -> same samples
    # False: the model's EOS token(s) (generation_config.eos_token_id) end generation as well,
    # as in vLLM and SGLang. True: only `stop_token_ids` and the length limits do.
    ignore_eos: bool = False
    # Token ids whose logprobs each Completion reports at its first response position
    # (Completion.label_logprobs): a judge's verdict labels ("Yes", "No"), scored from its
    # probabilities instead of its sampled text. () asks for none.
    label_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n!r}: must be an int >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"SamplingParams.temperature={self.temperature!r}: must be finite and >= 0 "
                "(0 for greedy)"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p={self.top_p!r}: must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r}: must be an int >= 0 (0 = off)")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"SamplingParams.min_p={self.min_p!r}: must be in [0, 1] (0 = off)")
        penalty = self.repetition_penalty
        if not (isinstance(penalty, (int, float)) and math.isfinite(penalty) and penalty > 0):
            raise ValueError(
                f"SamplingParams.repetition_penalty={penalty!r}: must be a finite number > 0 "
                "(1 = off)"
            )
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: must be an int >= 1"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids={self.stop_token_ids!r}: must be non-negative ints"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"SamplingParams.seed={self.seed!r}: must be None or an int >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos={self.ignore_eos!r}: must be a bool")
        if any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.label_token_ids
        ):
            raise ValueError(
                f"SamplingParams.label_token_ids={self.label_token_ids!r}: must be "
                "non-negative ints"
            )
        if len(set(self.label_token_ids)) != len(self.label_token_ids):
            raise ValueError(
                f"SamplingParams.label_token_ids={self.label_token_ids!r}: give each id once"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "label_token_ids", tuple(self.label_token_ids))


@dataclass(kw_only=True)
class Request:
    """One prompt. `images` are passed through to multimodal engines (PIL images or tensors).

    `image_inputs`: the same images already through the served model's image processor, so the
    engine does not run it again: any object with `pixel_values` [P, D] and `image_grid_thw`
    [I, 3] (a yatt.core.VisionInputs). The built-in engine uses them (and then needs no
    `images`); vLLM and SGLang run their own processor on `images`.
    """

    prompt_ids: list[int]
    images: list[Any] | None = None
    image_inputs: Any = None
    request_id: str | None = None  # echoed in each Completion; defaults to the request's index
    metadata: dict[str, Any] = field(default_factory=dict)  # opaque to the engine, echoed back
    # Overrides SamplingParams.max_new_tokens for this request's samples (None: use that).
    # With SamplingParams(ignore_eos=True) it forces each response to exactly this length
    # (context permitting): per-request lengths in one call, e.g. for benchmarks.
    max_new_tokens: int | None = None
    # A conversation this request belongs to (a multi-turn trajectory), for engines that keep
    # its KV cache between turns. The built-in engine keeps the finished sample's KV under this
    # id; a later request with the same id whose prompt_ids extend this prompt and response
    # continues from it, prefilling only the new tokens. vLLM and SGLang ignore it (their
    # prefix caches reuse the KV of the full prompt ids). Needs SamplingParams.n == 1.
    session_id: str | None = None
    # False: serve this request from the base model, without the LoRA adapter synced into the
    # engine (a self-judging GenRM on the policy's engine, a reference). The built-in engine
    # takes it with EngineConfig.lora_mode="beside" (rows on and off in one batch); vLLM and
    # SGLang with enable_lora (the request names no adapter); other engines refuse it.
    use_adapter: bool = True


@dataclass(kw_only=True)
class Completion:
    """One sampled response.

    `logprobs[i]` is log softmax(logits / temperature)[response_ids[i]] (unscaled logits when
    temperature is 0), without top-p/top-k truncation: the quantity the trainer recomputes as the
    old policy's logprob.

    `label_logprobs[k]` is log softmax(logits)[SamplingParams.label_token_ids[k]] at the first
    response position (the distribution response_ids[0] was drawn from), from the model's own
    logits: no temperature, top-p or top-k. None when no label ids were asked for, or the
    sample was aborted before its first token.
    """

    request_index: int  # position of the request in the call's `requests`
    sample_index: int  # 0 .. n-1 within the request's group
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    request_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    label_logprobs: list[float] | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What every rollout engine implements. Engines are also placement roles (sleep/wake_up)."""

    tokenizer: Any  # a Hugging Face tokenizer for the served model

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Completion]:
        """All completions, ordered by (request_index, sample_index)."""
        ...

    def stream(
        self, requests: Sequence[Request], sampling: SamplingParams
    ) -> AsyncIterator[Completion]:
        """Each completion as soon as it finishes (any order), every one exactly once."""
        ...

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        """Load new weights given as (Hugging Face name, tensor) pairs, bucket by bucket."""
        ...

    def sleep(self) -> None:
        """Release GPU memory (weights and KV cache) until `wake_up`."""
        ...

    def wake_up(self, tags: Sequence[str] | None = ("weights", "kv_cache")) -> None:
        """Re-create the memory for `tags` (weights before KV cache to avoid a peak)."""
        ...

    def abort(self) -> None:
        """Finish every in-flight request now with finish_reason="abort"."""
        ...

    def close(self) -> None: ...
