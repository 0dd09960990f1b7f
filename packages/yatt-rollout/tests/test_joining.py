"""Concurrent calls on one built-in engine: compatible calls join the running loop."""

NUM_GPUS = 0

import asyncio
import threading
import time

import pytest

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

TIMEOUT_S = 60.0

GREEDY = dict(temperature=0.0, ignore_eos=True)
SEEDED = dict(temperature=0.9, top_p=0.95, ignore_eos=True)


def _requests(tag: str, prompts) -> list[Request]:
    return [
        Request(prompt_ids=list(p), request_id=f"{tag}{i}", metadata={"call": tag})
        for i, p in enumerate(prompts)
    ]


A_PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [13], [40, 41, 42]]
B_PROMPTS = [[50, 51], [60, 61, 62, 63, 64], [70]]


def _engine(tiny_model_dir, **overrides) -> BuiltinEngine:
    config = dict(max_batch_size=4, max_seq_len=128, steps_per_sync=2, region_prefix="join")
    return BuiltinEngine(tiny_model_dir, config=EngineConfig(**(config | overrides)))


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def work():
        try:
            out["result"] = fn()
        except BaseException as exc:  # surfaced by the test
            out["error"] = exc
        out["done_at"] = time.monotonic()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, out


def _join(thread: threading.Thread, out: dict):
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), "a call hung"
    if "error" in out:
        raise out["error"]
    return out["result"]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_concurrent_generates_join_and_match_separate_calls(
    tiny_model_dir, stall_first_decode, kind, assert_same_samples
):
    engine = _engine(tiny_model_dir)
    extra = GREEDY if kind == "greedy" else SEEDED
    # Different n, seeds and lengths: all per sample, so the calls are compatible.
    sampling_a = SamplingParams(n=2, max_new_tokens=24, seed=1, **extra)
    sampling_b = SamplingParams(n=3, max_new_tokens=9, seed=2, **extra)
    requests_a, requests_b = _requests("a", A_PROMPTS), _requests("b", B_PROMPTS)
    expected_a = engine.generate(requests_a, sampling_a)
    expected_b = engine.generate(requests_b, sampling_b)
    assert engine.num_joined_calls == 0

    counts = stall_first_decode(engine, lambda: engine.num_joined_calls == 1)
    thread, out = _in_thread(lambda: engine.generate(requests_a, sampling_a))
    got_b = engine.generate(requests_b, sampling_b)  # joins A's loop
    got_a = _join(thread, out)
    assert engine.num_joined_calls == 1 and counts["loops"] == 1
    assert_same_samples(got_a, expected_a)
    assert_same_samples(got_b, expected_b)
    assert {c.metadata["call"] for c in got_a} == {"a"}
    engine.close()


def test_a_call_returns_when_its_own_samples_are_done(tiny_model_dir, stall_first_decode):
    # The leader is short and the joiner long: the leader hands the loop over and returns.
    engine = _engine(tiny_model_dir)
    short = SamplingParams(max_new_tokens=3, **GREEDY)
    long = SamplingParams(n=4, max_new_tokens=100, **GREEDY)
    stall_first_decode(engine, lambda: engine.num_joined_calls == 1)
    leader, leader_out = _in_thread(lambda: engine.generate(_requests("a", [[5, 6]]), short))
    joiner, joiner_out = _in_thread(lambda: engine.generate(_requests("b", B_PROMPTS), long))
    assert [len(c.response_ids) for c in _join(leader, leader_out)] == [3]
    assert [len(c.response_ids) for c in _join(joiner, joiner_out)] == [100] * 12
    assert leader_out["done_at"] < joiner_out["done_at"]
    engine.close()


def test_concurrent_streams_get_only_their_own_completions(
    tiny_model_dir, stall_first_decode, assert_same_samples
):
    engine = _engine(tiny_model_dir)
    sampling_a = SamplingParams(n=2, max_new_tokens=20, seed=3, **SEEDED)
    sampling_b = SamplingParams(n=2, max_new_tokens=12, seed=4, **SEEDED)
    requests_a, requests_b = _requests("a", A_PROMPTS), _requests("b", B_PROMPTS)
    expected_a = engine.generate(requests_a, sampling_a)
    expected_b = engine.generate(requests_b, sampling_b)
    stall_first_decode(engine, lambda: engine.num_joined_calls == 1)

    async def collect(requests, sampling):
        got = [c async for c in engine.stream(requests, sampling)]
        return sorted(got, key=lambda c: (c.request_index, c.sample_index))

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(collect(requests_a, sampling_a), collect(requests_b, sampling_b)),
            TIMEOUT_S,
        )

    got_a, got_b = asyncio.run(main())
    assert engine.num_joined_calls == 1
    assert_same_samples(got_a, expected_a)
    assert_same_samples(got_b, expected_b)
    engine.close()


@pytest.mark.parametrize(
    "other",
    [
        SEEDED,  # another temperature
        # Only the knob differs: a joined call would sample with the running call's settings.
        GREEDY | {"repetition_penalty": 1.5},
        GREEDY | {"min_p": 0.3},
    ],
    ids=["temperature", "repetition_penalty", "min_p"],
)
def test_incompatible_sampling_waits_and_completes(
    tiny_model_dir, stall_first_decode, assert_same_samples, other
):
    engine = _engine(tiny_model_dir)
    greedy = SamplingParams(n=2, max_new_tokens=16, **GREEDY)
    sampled = SamplingParams(n=2, max_new_tokens=16, seed=5, **other)
    requests_a, requests_b = _requests("a", A_PROMPTS), _requests("b", B_PROMPTS)
    expected_a = engine.generate(requests_a, greedy)
    expected_b = engine.generate(requests_b, sampled)
    counts = stall_first_decode(engine, lambda: bool(engine._scheduler._waiting))
    thread, out = _in_thread(lambda: engine.generate(requests_a, greedy))
    got_b = engine.generate(requests_b, sampled)
    got_a = _join(thread, out)
    assert engine.num_joined_calls == 0 and counts["loops"] == 2
    assert_same_samples(got_a, expected_a)
    assert_same_samples(got_b, expected_b)
    engine.close()


def test_joining_disabled_runs_one_call_at_a_time(
    tiny_model_dir, stall_first_decode, assert_same_samples
):
    engine = _engine(tiny_model_dir, should_join_calls=False)
    sampling = SamplingParams(n=2, max_new_tokens=16, seed=6, **SEEDED)
    requests_a, requests_b = _requests("a", A_PROMPTS), _requests("b", B_PROMPTS)
    expected_a = engine.generate(requests_a, sampling)
    expected_b = engine.generate(requests_b, sampling)
    counts = stall_first_decode(engine, lambda: bool(engine._scheduler._waiting))
    thread, out = _in_thread(lambda: engine.generate(requests_a, sampling))
    got_b = engine.generate(requests_b, sampling)  # waits for A's whole loop
    got_a = _join(thread, out)
    assert engine.num_joined_calls == 0 and counts["loops"] == 2
    assert_same_samples(got_a, expected_a)
    assert_same_samples(got_b, expected_b)
    engine.close()


@pytest.mark.parametrize("closed", ["joiner", "leader"])
def test_closing_one_joined_stream_leaves_the_other_call_intact(
    tiny_model_dir, stall_first_decode, closed, assert_same_samples
):
    engine = _engine(tiny_model_dir)
    sampling = SamplingParams(n=2, max_new_tokens=40, seed=7, **SEEDED)
    requests_kept, requests_closed = _requests("k", A_PROMPTS), _requests("c", B_PROMPTS * 3)
    expected = engine.generate(requests_kept, sampling)
    joined = threading.Event()
    counts = stall_first_decode(engine, joined.is_set)

    async def take_one_and_close():
        stream = engine.stream(requests_closed, sampling)
        first = await anext(stream)
        await asyncio.wait_for(stream.aclose(), TIMEOUT_S)  # drops the rest, returns promptly
        return first

    async def main():
        if closed == "leader":  # the stream leads; generate (in a thread) joins it
            task = asyncio.create_task(take_one_and_close())
            while not engine._is_running:
                await asyncio.sleep(0.005)
            thread, out = _in_thread(lambda: engine.generate(requests_kept, sampling))
        else:  # generate leads; the stream joins
            thread, out = _in_thread(lambda: engine.generate(requests_kept, sampling))
            while not engine._is_running:
                await asyncio.sleep(0.005)
            task = asyncio.create_task(take_one_and_close())
        while engine.num_joined_calls < 1:
            await asyncio.sleep(0.005)
        joined.set()
        first = await asyncio.wait_for(task, TIMEOUT_S)
        return first, await asyncio.to_thread(_join, thread, out)

    first, kept = asyncio.run(main())
    assert first.request_id.startswith("c")
    assert_same_samples(kept, expected)
    # The closed call's queued samples were dropped, not generated for nobody.
    assert counts["prefilled"] < len(requests_kept) * 2 + len(requests_closed) * 2
    # The engine is free and serves new calls.
    again = engine.generate(requests_kept, sampling)
    assert_same_samples(again, expected)
    engine.close()


def test_abort_ends_every_joined_call(tiny_model_dir, stall_first_decode):
    engine = _engine(tiny_model_dir, max_seq_len=512)
    sampling = SamplingParams(max_new_tokens=400, seed=8, **SEEDED)

    def joined_then_abort() -> bool:
        # Abort from inside the stalled first step once B joined: no sample can reach its
        # 400 tokens first, however fast the machine (a timer raced fast CI machines).
        if engine.num_joined_calls < 1:
            return False
        engine.abort()
        return True

    stall_first_decode(engine, joined_then_abort)
    thread, out = _in_thread(lambda: engine.generate(_requests("a", A_PROMPTS * 2), sampling))
    got_b = engine.generate(_requests("b", B_PROMPTS), sampling)
    got_a = _join(thread, out)
    assert [(c.request_index, c.request_id) for c in got_a] == [(i, f"a{i}") for i in range(8)]
    assert [(c.request_index, c.request_id) for c in got_b] == [(i, f"b{i}") for i in range(3)]
    assert {c.finish_reason for c in got_a + got_b} == {"abort"}
    after = engine.generate(_requests("a", A_PROMPTS), SamplingParams(max_new_tokens=2))
    assert {c.finish_reason for c in after} <= {"length", "stop"}
    engine.close()


def test_many_short_concurrent_calls_all_complete(tiny_model_dir):
    # Calls arrive while loops start, run and end: each must be served exactly once (no call
    # lost between "nothing left" and "loop over").
    engine = _engine(tiny_model_dir, steps_per_sync=1)
    sampling = SamplingParams(max_new_tokens=2, **GREEDY)
    prompts = [[5 + i, 6] for i in range(8)]
    expected = {
        i: engine.generate(_requests(f"r{i}-", [p]), sampling)[0].response_ids
        for i, p in enumerate(prompts)
    }
    results: dict[tuple[int, int], list] = {}

    def call(round_: int, i: int) -> None:
        results[round_, i] = engine.generate(_requests(f"r{i}-", [prompts[i]]), sampling)

    async def stream_call(round_: int, i: int) -> None:
        requests = _requests(f"r{i}-", [prompts[i]])
        results[round_, i] = [c async for c in engine.stream(requests, sampling)]

    async def streams(round_: int) -> None:
        calls = asyncio.gather(stream_call(round_, 6), stream_call(round_, 7))
        await asyncio.wait_for(calls, TIMEOUT_S)

    for round_ in range(15):
        threads = [threading.Thread(target=call, args=(round_, i), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        asyncio.run(streams(round_))
        for t in threads:
            t.join(TIMEOUT_S)
            assert not t.is_alive(), f"round {round_}: a call hung"
    assert len(results) == 15 * 8
    for (_, i), got in results.items():
        assert [(c.request_id, c.response_ids) for c in got] == [(f"r{i}-0", expected[i])]
    assert engine.num_joined_calls > 0  # some did join
    engine.close()
