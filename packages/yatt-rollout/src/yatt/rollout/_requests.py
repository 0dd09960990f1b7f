"""Checks on a call's requests that every engine shares, so each gives the same clear errors."""

from __future__ import annotations

from collections.abc import Sequence

from yatt.rollout._types import Request, SamplingParams


def validate_requests(
    requests: Sequence[Request],
    sampling: SamplingParams,
    *,
    vocab_size: int,
    max_seq_len: int,
    accepts_images: bool,
    accepts_adapter_off: bool = False,
) -> None:
    """Raise ValueError naming the request and the field for input no engine can serve.

    A prompt must leave room for at least one new token: len(prompt_ids) < max_seq_len.
    """
    if not isinstance(sampling, SamplingParams):
        raise ValueError(
            f"sampling={sampling!r}: pass a yatt.rollout.SamplingParams (it validates its fields)"
        )
    if isinstance(requests, Request) or not isinstance(requests, Sequence):
        raise ValueError(f"requests={requests!r}: pass a list of yatt.rollout.Request")
    for i, request in enumerate(requests):
        if not isinstance(request, Request):
            raise ValueError(
                f"requests[{i}]={request!r} is not a Request; wrap token ids as "
                "Request(prompt_ids=[...])"
            )
        ids = request.prompt_ids
        if len(ids) == 0:
            raise ValueError(
                f"requests[{i}].prompt_ids is empty; every prompt needs at least one token "
                "(e.g. the BOS token or a chat template's prefix)"
            )
        if len(ids) >= max_seq_len:
            raise ValueError(
                f"requests[{i}].prompt_ids has {len(ids)} tokens, but the engine's context is "
                f"{max_seq_len} tokens and must leave room for one new token; shorten the prompt "
                "or raise the engine's max_seq_len"
            )
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"requests[{i}].prompt_ids has ids outside the vocabulary [0, {vocab_size}): "
                f"{bad[:5]}; tokenize with the engine's tokenizer"
            )
        limit = request.max_new_tokens
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ValueError(
                f"requests[{i}].max_new_tokens={limit!r}: must be an int >= 1, or None to use "
                "SamplingParams.max_new_tokens"
            )
        if request.session_id is not None and sampling.n != 1:
            raise ValueError(
                f"requests[{i}].session_id={request.session_id!r} with SamplingParams.n="
                f"{sampling.n}: a session continues one sample; send each sample of a group as "
                "its own request (its own session_id) with n=1"
            )
        if (request.images or request.image_inputs is not None) and not accepts_images:
            field = "images" if request.images else "image_inputs"
            raise ValueError(
                f"requests[{i}].{field} is set but the served model is text-only; drop the "
                "images or serve a multimodal model with the vLLM or SGLang engine"
            )
        if request.use_adapter is not True:
            if request.use_adapter is not False:
                raise ValueError(
                    f"requests[{i}].use_adapter={request.use_adapter!r}: must be a bool"
                )
            if not accepts_adapter_off:
                raise ValueError(
                    f"requests[{i}].use_adapter=False: this engine cannot serve the base beside "
                    "its LoRA adapter; use the built-in engine with EngineConfig.lora_mode="
                    "'beside'"
                )
    bad_stops = [t for t in sampling.stop_token_ids if t >= vocab_size]
    if bad_stops:
        raise ValueError(
            f"SamplingParams.stop_token_ids has ids outside the vocabulary [0, {vocab_size}): "
            f"{bad_stops}"
        )


def request_id_of(request: Request, index: int) -> str:
    """The id echoed in completions: the request's own, else its index in the call."""
    return request.request_id if request.request_id is not None else str(index)


def max_new_tokens_of(request: Request, sampling: SamplingParams) -> int:
    """The request's own limit if it sets one, else the call's SamplingParams.max_new_tokens."""
    return request.max_new_tokens if request.max_new_tokens is not None else sampling.max_new_tokens
