NUM_GPUS = 0

import asyncio

import pytest

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [40, 41, 42, 43]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # 2 slots for 4 requests x 2 samples: refilled slots must take the new occupant's limit.
    engine = BuiltinEngine(
        tiny_model_dir,
        config=EngineConfig(max_batch_size=2, max_seq_len=64, steps_per_sync=3, region_prefix="m"),
    )
    yield engine
    engine.close()


def test_each_request_gets_exactly_its_own_length(engine):
    limits = [3, None, 17, 1]
    requests = [
        Request(prompt_ids=p, max_new_tokens=m) for p, m in zip(PROMPTS, limits, strict=True)
    ]
    sampling = SamplingParams(n=2, max_new_tokens=9, seed=1, ignore_eos=True)
    completions = engine.generate(requests, sampling)
    assert len(completions) == 8
    for c in completions:
        expected = limits[c.request_index] or sampling.max_new_tokens
        assert len(c.response_ids) == expected
        assert len(c.logprobs) == expected
        assert c.finish_reason == "length"


def test_stream_honours_per_request_lengths(engine):
    requests = [Request(prompt_ids=p, max_new_tokens=2 + 5 * i) for i, p in enumerate(PROMPTS)]
    sampling = SamplingParams(n=1, max_new_tokens=4, seed=2, ignore_eos=True)

    async def collect():
        return [c async for c in engine.stream(requests, sampling)]

    lengths = {c.request_index: len(c.response_ids) for c in asyncio.run(collect())}
    assert lengths == {i: 2 + 5 * i for i in range(len(PROMPTS))}


def test_context_still_caps_a_request_limit(engine):
    prompt = list(range(5, 5 + 60))  # 60 of the 64 context tokens
    (c,) = engine.generate(
        [Request(prompt_ids=prompt, max_new_tokens=50)],
        SamplingParams(max_new_tokens=50, seed=0, ignore_eos=True),
    )
    assert len(c.response_ids) == 64 - 60


def test_same_samples_as_the_call_wide_limit(engine):
    sampling = SamplingParams(n=2, max_new_tokens=6, seed=5, ignore_eos=True)
    wide = engine.generate([Request(prompt_ids=p) for p in PROMPTS], sampling)
    per_request = engine.generate(
        [Request(prompt_ids=p, max_new_tokens=6) for p in PROMPTS],
        SamplingParams(n=2, max_new_tokens=30, seed=5, ignore_eos=True),
    )
    assert [c.response_ids for c in wide] == [c.response_ids for c in per_request]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"], ids=repr)
def test_bad_request_limit_is_a_clear_error(engine, bad):
    requests = [Request(prompt_ids=[5, 6]), Request(prompt_ids=[7], max_new_tokens=bad)]
    with pytest.raises(ValueError, match=r"requests\[1\]\.max_new_tokens"):
        engine.generate(requests, SamplingParams(max_new_tokens=4))
