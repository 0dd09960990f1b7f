"""The behaviour every rollout engine must show, as plain functions any test runner can call.

    target = ConformanceTarget(engine=..., vocab_size=..., max_seq_len=..., ...)
    for name, check in CONFORMANCE_CHECKS.items():
        check(target)                      # raises AssertionError with a message on failure

The checks share one engine (building a vLLM engine takes a minute) and leave it as they found
it: awake, with its original weights. They need no pytest.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from yatt.rollout._types import Completion, Request, RolloutEngine, SamplingParams

NamedTensorsFactory = Callable[[], Iterable[tuple[str, torch.Tensor]]]
# (prompt_ids, response_ids, temperature) -> logprob of each response token from a forward pass
ReferenceLogprobs = Callable[[list[int], list[int], float], list[float]]


@dataclass(kw_only=True)
class ConformanceTarget:
    """An engine under test and what the checks need to know about it."""

    engine: RolloutEngine
    vocab_size: int
    max_seq_len: int  # the engine's context: prompt + response tokens
    new_weights: NamedTensorsFactory  # weights that change the outputs, Hugging Face names
    original_weights: NamedTensorsFactory  # the engine's weights at the start
    reference_logprobs: ReferenceLogprobs | None = None
    logprob_atol: float = 1e-4  # float32 on CPU; about 5e-2 for bf16 engines
    abort_num_requests: int = (
        8  # requests in the abort check (more than the engine's slots is fine)
    )
    is_multimodal: bool = False
    prompts: list[list[int]] = field(
        default_factory=lambda: [[5, 6, 7], [8, 9, 10, 11, 12], [13], [40, 41, 42, 43]]
    )


def _requests(target: ConformanceTarget) -> list[Request]:
    return [Request(prompt_ids=list(p)) for p in target.prompts]


def _tokens(completions: Sequence[Completion]) -> list[list[int]]:
    return [c.response_ids for c in completions]


def _greedy(max_new_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **kwargs)


def check_output_fields(target: ConformanceTarget) -> None:
    """Ordered by (request, sample); ids, metadata and prompts echoed; logprobs per token."""
    requests = _requests(target)
    requests[1] = Request(prompt_ids=requests[1].prompt_ids, request_id="r1", metadata={"k": 1})
    sampling = SamplingParams(n=3, max_new_tokens=6, seed=7, ignore_eos=True)
    out = target.engine.generate(requests, sampling)
    expected = [(i, j) for i in range(len(requests)) for j in range(3)]
    assert [(c.request_index, c.sample_index) for c in out] == expected, "order or count wrong"
    for c in out:
        request = requests[c.request_index]
        assert c.prompt_ids == request.prompt_ids
        assert c.request_id == (request.request_id or str(c.request_index))
        assert c.metadata == request.metadata
        assert len(c.logprobs) == len(c.response_ids) == 6, (c.response_ids, c.logprobs)
        assert all(math.isfinite(x) and x <= 1e-6 for x in c.logprobs), c.logprobs
        assert all(0 <= t < target.vocab_size for t in c.response_ids)
        assert c.finish_reason == "length"
    for i in range(len(requests)):
        group = _tokens(out[3 * i : 3 * i + 3])
        assert len({tuple(g) for g in group}) > 1, f"n=3 samples of request {i} are identical"


def check_seeded_determinism(target: ConformanceTarget) -> None:
    """Same seed, same samples; another seed, other samples."""
    sampling = SamplingParams(n=2, max_new_tokens=16, seed=123, ignore_eos=True)
    first = target.engine.generate(_requests(target), sampling)
    second = target.engine.generate(_requests(target), sampling)
    assert _tokens(first) == _tokens(second), "same seed gave different tokens"
    for a, b in zip(first, second, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= (
            target.logprob_atol
        )
    other = target.engine.generate(
        _requests(target), SamplingParams(n=2, max_new_tokens=16, seed=124, ignore_eos=True)
    )
    assert _tokens(other) != _tokens(first), "a different seed gave the same samples"


def check_max_new_tokens(target: ConformanceTarget) -> None:
    out = target.engine.generate(
        _requests(target), SamplingParams(max_new_tokens=7, ignore_eos=True, seed=1)
    )
    assert all(len(c.response_ids) == 7 and c.finish_reason == "length" for c in out), [
        (len(c.response_ids), c.finish_reason) for c in out
    ]


def check_stop_tokens(target: ConformanceTarget) -> None:
    """Generation ends right after the first stop token, which is kept, with reason "stop"."""
    base = target.engine.generate(_requests(target), _greedy())
    stop = base[0].response_ids[3]
    out = target.engine.generate(_requests(target), _greedy(stop_token_ids=(stop,)))
    for b, c in zip(base, out, strict=True):
        if stop in b.response_ids:
            end = b.response_ids.index(stop) + 1
            assert c.response_ids == b.response_ids[:end], (b.response_ids, c.response_ids)
            assert c.finish_reason == "stop"
        else:
            assert c.response_ids == b.response_ids and c.finish_reason == "length"
    assert out[0].finish_reason == "stop" and len(out[0].response_ids) <= 4


def check_logprobs_match_forward(target: ConformanceTarget) -> None:
    """Reported logprobs equal log softmax(logits / T) of a plain forward pass."""
    if target.reference_logprobs is None:
        return
    for sampling in (
        _greedy(),
        SamplingParams(temperature=0.7, max_new_tokens=12, seed=3, ignore_eos=True),
    ):
        for c in target.engine.generate(_requests(target), sampling):
            ref = target.reference_logprobs(c.prompt_ids, c.response_ids, sampling.temperature)
            worst = max(abs(x - y) for x, y in zip(ref, c.logprobs, strict=True))
            assert worst <= target.logprob_atol, (
                f"logprobs differ from a forward pass by {worst:.2e} (T={sampling.temperature})"
            )


def check_sampling_knobs(target: ConformanceTarget) -> None:
    """min_p and repetition_penalty reach the engine's sampler. min_p=1 at temperature 1 keeps
    only the likeliest token, so a seeded sample follows the greedy response; where it leaves
    it, the two tokens must tie (equal logprobs in a forward pass of the shared prefix: bf16
    logits tie often). A repetition penalty of 2 (within every backend's range) changes some
    greedy response, reproducibly."""
    engine, requests = target.engine, _requests(target)
    greedy = engine.generate(requests, _greedy())
    only_top = SamplingParams(
        n=2, temperature=1.0, min_p=1.0, max_new_tokens=12, seed=9, ignore_eos=True
    )
    for c in engine.generate(requests, only_top):
        g = greedy[c.request_index].response_ids
        i = next(
            (i for i, (a, b) in enumerate(zip(c.response_ids, g, strict=True)) if a != b), None
        )
        if i is None:
            continue
        assert target.reference_logprobs is not None, f"min_p=1 left the greedy path: {c}"
        sampled = target.reference_logprobs(c.prompt_ids, c.response_ids[: i + 1], 1.0)[i]
        top = target.reference_logprobs(c.prompt_ids, g[: i + 1], 1.0)[i]
        assert abs(sampled - top) <= target.logprob_atol, (
            f"min_p=1 sampled a token of logprob {sampled:.3f} where the top one has {top:.3f}"
        )
    plain = _tokens(greedy)
    penalized = _tokens(engine.generate(requests, _greedy(repetition_penalty=2.0)))
    assert penalized != plain, "repetition_penalty=2 changed no greedy response"
    assert _tokens(engine.generate(requests, _greedy(repetition_penalty=2.0))) == penalized


async def _collect(stream) -> list[Completion]:
    return [c async for c in stream]


def check_stream_yields_each_once(target: ConformanceTarget) -> None:
    sampling = SamplingParams(n=2, max_new_tokens=10, seed=11, ignore_eos=True)
    streamed = asyncio.run(_collect(target.engine.stream(_requests(target), sampling)))
    keys = [(c.request_index, c.sample_index) for c in streamed]
    expected = {(i, j) for i in range(len(target.prompts)) for j in range(2)}
    assert len(keys) == len(set(keys)) == len(expected) and set(keys) == expected, keys
    by_key = {(c.request_index, c.sample_index): c.response_ids for c in streamed}
    generated = target.engine.generate(_requests(target), sampling)
    assert [by_key[(c.request_index, c.sample_index)] for c in generated] == _tokens(generated)


def check_abort(target: ConformanceTarget) -> None:
    """abort() ends a run early: in-flight samples keep partial output, all come back once.

    Request 0 fills the context but for 8 tokens, so it finishes first; the consumer aborts
    as soon as it arrives, while the other requests still have many tokens to go. (8, not 2:
    SGLang takes prompts up to 4 tokens short of its serving length.)
    """
    short = target.prompts[0]
    max_new_tokens = target.max_seq_len - len(short) - 1
    requests = [Request(prompt_ids=[short[0]] * (target.max_seq_len - 8))] + [
        Request(prompt_ids=list(short)) for _ in range(target.abort_num_requests - 1)
    ]
    sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, seed=5)

    async def run() -> tuple[list[Completion], float]:
        got: list[Completion] = []
        aborted_at = None
        async for completion in target.engine.stream(requests, sampling):
            got.append(completion)
            if aborted_at is None:
                target.engine.abort()
                aborted_at = time.monotonic()
        return got, time.monotonic() - aborted_at

    got, seconds_after_abort = asyncio.run(run())
    keys = sorted(c.request_index for c in got)
    assert keys == list(range(len(requests))), f"each request once, got {keys}"
    assert got[0].request_index == 0 and got[0].finish_reason == "length"
    aborted = [c for c in got if c.finish_reason == "abort"]
    assert len(aborted) == len(requests) - 1, [c.finish_reason for c in got]
    assert all(len(c.response_ids) < max_new_tokens for c in aborted)
    assert all(len(c.logprobs) == len(c.response_ids) for c in got)
    assert seconds_after_abort < 10.0, f"abort took {seconds_after_abort:.1f}s to take effect"
    again = target.engine.generate(
        _requests(target), SamplingParams(max_new_tokens=3, ignore_eos=True)
    )
    assert all(c.finish_reason == "length" for c in again), "a stale abort leaked into a new run"


def check_update_weights(target: ConformanceTarget) -> None:
    """New weights change greedy outputs; the original weights bring them back exactly."""
    before = target.engine.generate(_requests(target), _greedy())
    target.engine.update_weights(target.new_weights(), bucket_bytes=1 << 12)
    changed = target.engine.generate(_requests(target), _greedy())
    target.engine.update_weights(target.original_weights())
    restored = target.engine.generate(_requests(target), _greedy())
    assert _tokens(changed) != _tokens(before), "update_weights did not change the outputs"
    assert _tokens(restored) == _tokens(before), "restoring the weights did not restore outputs"


def check_sleep_wake(target: ConformanceTarget) -> None:
    before = target.engine.generate(_requests(target), _greedy())
    target.engine.sleep()
    target.engine.wake_up(tags=("weights",))
    target.engine.wake_up(tags=("kv_cache",))
    after = target.engine.generate(_requests(target), _greedy())
    assert _tokens(after) == _tokens(before), "outputs changed across sleep/wake_up"


def _expect_value_error(call: Callable[[], object], what: str) -> None:
    try:
        call()
    except ValueError as exc:
        assert str(exc), f"{what}: empty error message"
        return
    raise AssertionError(f"{what}: expected ValueError")


def check_bad_input(target: ConformanceTarget) -> None:
    engine, ok = target.engine, SamplingParams(max_new_tokens=2)
    _expect_value_error(lambda: engine.generate([Request(prompt_ids=[])], ok), "empty prompt")
    too_long = Request(prompt_ids=[5] * target.max_seq_len)
    _expect_value_error(lambda: engine.generate([too_long], ok), "prompt longer than context")
    outside = Request(prompt_ids=[target.vocab_size])
    _expect_value_error(lambda: engine.generate([outside], ok), "token id outside vocabulary")
    for bad in (
        {"n": 0},
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("inf")},
        {"max_new_tokens": 0},
        {"stop_token_ids": (-3,)},
    ):
        _expect_value_error(lambda bad=bad: SamplingParams(**bad), f"SamplingParams({bad})")
    if not target.is_multimodal:
        with_image = Request(prompt_ids=[5, 6], images=[torch.zeros(3, 4, 4)])
        _expect_value_error(lambda: engine.generate([with_image], ok), "image to text model")
    assert len(engine.generate(_requests(target), ok)) == len(target.prompts)


CONFORMANCE_CHECKS: dict[str, Callable[[ConformanceTarget], None]] = {
    "output_fields": check_output_fields,
    "seeded_determinism": check_seeded_determinism,
    "max_new_tokens": check_max_new_tokens,
    "stop_tokens": check_stop_tokens,
    "logprobs_match_forward": check_logprobs_match_forward,
    "sampling_knobs": check_sampling_knobs,
    "stream_yields_each_once": check_stream_yields_each_once,
    "abort": check_abort,
    "update_weights": check_update_weights,
    "sleep_wake": check_sleep_wake,
    "bad_input": check_bad_input,
}


def run_conformance(target: ConformanceTarget) -> None:
    """Every check in turn; the first failure raises."""
    for check in CONFORMANCE_CHECKS.values():
        check(target)
