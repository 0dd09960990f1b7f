"""Decode steps over the running slots only, in batch buckets (EngineConfig.decode_batch_buckets).

The rule under test: at each host check the engine decodes the slots still generating, in the
smallest batch bucket that holds them (padding rows are other, idle slots), and every sample is
the one the engine without buckets (every step over every slot) produces for the same seed.
"""

NUM_GPUS = 0

import threading

import pytest
import torch

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams
from yatt.rollout.builtin._batcher import batch_buckets

# Prompts of 2+ tokens (a decode forward is the only one with one input column); per-request
# limits make the running count fall step by step, so every bucket is met, and the low slots
# run longest, so padding rows must skip running slots.
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [40, 41, 42, 43], [50, 51], [60, 61, 62]]
LIMITS = [29, 3, 23, 6, 17, 11]


def _requests(limits=LIMITS):
    return [
        Request(prompt_ids=list(p), max_new_tokens=n) for p, n in zip(PROMPTS, limits, strict=True)
    ]


def _engine(tiny_model_dir, prefix, **overrides):
    config = EngineConfig(max_batch_size=8, max_seq_len=128, region_prefix=prefix, **overrides)
    return BuiltinEngine(tiny_model_dir, config=config)


CALLS = [
    SamplingParams(n=2, temperature=0.9, top_p=0.9, top_k=40, max_new_tokens=40, seed=4),
    SamplingParams(n=1, temperature=1.0, max_new_tokens=40, seed=7),
    SamplingParams(temperature=0.0, max_new_tokens=40),
]


def _generate_all(engine, requests=None):
    return [c for sampling in CALLS for c in engine.generate(requests or _requests(), sampling)]


def _assert_same(got, expected, atol=1e-5):
    key = [(c.request_index, c.sample_index) for c in got]
    assert key == [(c.request_index, c.sample_index) for c in expected]
    assert [c.response_ids for c in got] == [c.response_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0
        )


@pytest.fixture(scope="module")
def unbucketed(tiny_model_dir):
    """Every step over every slot: the engine before buckets."""
    engine = _engine(tiny_model_dir, "nobuckets", decode_batch_buckets=())
    assert engine.decode_batch_buckets == [8]
    samples = _generate_all(engine)
    assert set(engine._runner.bucket_steps) == {8}
    engine.close()
    return samples


@pytest.mark.parametrize(
    ("num_slots", "sizes", "expected"),
    [
        (256, None, [8, 16, 32, 64, 128, 256]),  # powers of two from 8, then the slot count
        (200, None, [8, 16, 32, 64, 128, 200]),
        (8, None, [8]),
        (5, None, [5]),
        (9, None, [8, 9]),
        (8, (1, 2, 4), [1, 2, 4, 8]),
        (8, (4, 2, 2, 16, 8), [2, 4, 8]),  # sorted, deduplicated, the slot count closes it
        (8, (), [8]),
    ],
)
def test_batch_buckets(num_slots, sizes, expected):
    assert batch_buckets(num_slots, sizes) == expected


@pytest.mark.parametrize("value", [(0,), (-8,), ("8",), (True,), 8, (8.0,)])
def test_config_rejects_bad_batch_buckets(value):
    with pytest.raises(ValueError, match=r"EngineConfig\.decode_batch_buckets"):
        EngineConfig(decode_batch_buckets=value)


def test_each_step_decodes_the_running_slots_in_the_smallest_bucket(tiny_model_dir):
    engine = _engine(tiny_model_dir, "rows", decode_batch_buckets=(1, 2, 4), steps_per_sync=1)
    runner, model = engine._runner, engine.model
    seen = []  # per decode step: (running slots before it, batch, its rows)
    decode_batches = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: (
            decode_batches.append(kwargs["input_ids"].shape[0])
            if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] == 1
            else None
        ),
        with_kwargs=True,
    )
    original = runner.run_decode_step

    def step(flags, span, **kwargs):
        running = set(torch.nonzero(runner.active_S).flatten().tolist())
        rows = runner.row_slot_S[: runner.batch].tolist()
        seen.append((running, runner.batch, rows))
        original(flags, span, **kwargs)

    runner.run_decode_step = step
    engine.generate(_requests(), SamplingParams(n=1, temperature=0.0, max_new_tokens=40))
    hook.remove()
    engine.close()
    assert seen
    for running, batch, rows in seen:
        # Independent statement of the rule: the smallest of 1, 2, 4, 8 holding the running.
        assert batch == min(b for b in (1, 2, 4, 8) if b >= len(running)), (running, batch)
        assert len(rows) == batch and len(set(rows)) == batch, rows  # distinct rows
        assert running <= set(rows), (running, rows)  # every running slot decodes
    assert {batch for _, batch, _ in seen} == {1, 2, 4, 8}
    # The model really ran that batch (not the slot count) in every decode step, eagerly.
    assert decode_batches == [batch for _, batch, _ in seen]
    counted = dict(runner.bucket_steps)
    assert counted == {b: sum(1 for _, x, _ in seen if x == b) for b in (1, 2, 4, 8)}


@pytest.mark.parametrize(
    "overrides",
    [
        dict(decode_batch_buckets=(1, 2, 4)),
        dict(decode_batch_buckets=(2, 4), steps_per_sync=3),
        dict(decode_batch_buckets=(1, 2, 4), decode_attention="matmul"),
        dict(decode_batch_buckets=(3,), max_prefill_tokens=128),  # refills from the queue
    ],
    ids=["sdpa", "k3", "matmul", "refills"],
)
def test_buckets_give_the_samples_of_every_slot_decoding(tiny_model_dir, unbucketed, overrides):
    engine = _engine(tiny_model_dir, "buckets", **overrides)
    got = _generate_all(engine)
    small = [b for b in engine._runner.bucket_steps if b < 8]
    engine.close()
    assert small, "no step ran a bucket below the slot count: the test would prove nothing"
    _assert_same(got, unbucketed)


def test_buckets_with_more_samples_than_slots(tiny_model_dir):
    # 18 samples through 8 slots: sequences finish and new ones join mid-run, so the running
    # set is never a prefix of the slots (padding rows sit between and after running ones).
    sampling = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_new_tokens=30, seed=11)
    outputs = []
    for buckets in ((), (1, 2, 4)):
        engine = _engine(tiny_model_dir, f"many{len(buckets)}", decode_batch_buckets=buckets)
        outputs.append(engine.generate(_requests(), sampling))
        engine.close()
    _assert_same(*outputs)


def test_joined_calls_with_buckets_match_separate_calls_without(
    tiny_model_dir, stall_first_decode, unbucketed
):
    # Call A runs; call B (same sampling rule, other seed and n) joins its loop at a host
    # check; both are the samples of separate calls on the unbucketed engine.
    requests = _requests()
    sampling_a = CALLS[0]
    sampling_b = SamplingParams(n=1, temperature=0.9, top_p=0.9, top_k=40, seed=8)
    expected_a = unbucketed[: len(requests) * sampling_a.n]
    reference = _engine(tiny_model_dir, "joined-ref", decode_batch_buckets=())
    expected_b = reference.generate(requests, sampling_b)
    reference.close()
    engine = _engine(tiny_model_dir, "joined", decode_batch_buckets=(1, 2, 4))
    counts = stall_first_decode(engine, lambda: engine.num_joined_calls == 1)
    out = {}
    thread = threading.Thread(target=lambda: out.update(a=engine.generate(requests, sampling_a)))
    thread.start()
    got_b = engine.generate(requests, sampling_b)
    thread.join(120)
    assert not thread.is_alive()
    assert engine.num_joined_calls == 1 and counts["loops"] == 1
    assert any(b < 8 for b in engine._runner.bucket_steps)
    engine.close()
    _assert_same(out["a"], expected_a)
    _assert_same(got_b, expected_b)


def test_abort_mid_run_gives_the_same_partial_samples(tiny_model_dir):
    # Abort before the 12th decode step in both engines: the same host check ends both, so
    # the partial responses (finish "abort") and the finished ones must agree.
    outputs = []
    for buckets in ((), (1, 2, 4)):
        engine = _engine(tiny_model_dir, f"abort{len(buckets)}", decode_batch_buckets=buckets)
        runner, original, steps = engine._runner, engine._runner.run_decode_step, [0]

        def step(flags, span, _original=original, _steps=steps, _engine=engine, **kwargs):
            _steps[0] += 1
            if _steps[0] == 12:
                _engine.abort()
            _original(flags, span, **kwargs)

        runner.run_decode_step = step
        sampling = SamplingParams(n=2, temperature=0.9, max_new_tokens=40, seed=3, ignore_eos=True)
        outputs.append(engine.generate(_requests([3, 40, 5, 40, 40, 2]), sampling))
        engine.close()
    reasons = {c.finish_reason for c in outputs[1]}
    assert reasons == {"abort", "length"}, reasons
    _assert_same(*outputs)


def test_decode_steps_outside_a_call_take_a_bucket(tiny_model_dir):
    engine = _engine(tiny_model_dir, "diag", decode_batch_buckets=(2, 4))
    sampling = SamplingParams(n=2, max_new_tokens=12, ignore_eos=True, seed=3)
    before = engine.generate(_requests(), sampling)
    assert engine.decode_batch_buckets == [2, 4, 8]
    with pytest.raises(ValueError, match="decode_batch_buckets"):
        engine.run_decode_steps(span=64, num_steps=1, batch=3)
    runner = engine._runner
    for batch in (2, 4, 8, None):
        runner.bucket_steps.clear()
        engine.run_decode_steps(span=64, num_steps=2, batch=batch)
        assert dict(runner.bucket_steps) == {batch or 8: 2}
    assert engine.generate(_requests(), sampling) == before
    engine.close()


def test_compiled_step_is_dynamic_in_the_batch(tiny_model_dir, unbucketed):
    # One compiled graph per sampling mode for every (span, batch bucket): no recompile per
    # bucket, and the same samples as the eager unbucketed engine.
    from torch._dynamo.utils import counters

    counters.clear()
    engine = _engine(tiny_model_dir, "compiled", decode_batch_buckets=(2, 4), compile_decode=True)
    got = _generate_all(engine)
    assert engine._runner._compiled_step is not None, "compiling fell back to eager"
    assert {2, 4, 8} <= set(engine._runner.bucket_steps)
    engine.close()
    _assert_same(got, unbucketed)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # Sampled with truncation, sampled without, greedy: three modes, one graph each.
    assert counters["stats"]["unique_graphs"] == 3
