NUM_GPUS = 0

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.placement import is_paused, resident_bytes
from yatt.rollout import (
    BuiltinEngine,
    EngineConfig,
    Request,
    RolloutEngine,
    SamplingParams,
    map_names,
)
from yatt.rollout.builtin._batcher import span_buckets
from yatt.testing import make_tiny_causal_lm

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [40, 41, 42, 43], [50, 51]]


def _requests(prompts=PROMPTS):
    return [Request(prompt_ids=list(p)) for p in prompts]


def _forward_logprobs(model, prompt, response, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logits = logits[len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = BuiltinEngine(
        tiny_model_dir, config=EngineConfig(max_batch_size=4, max_seq_len=128, region_prefix="t")
    )
    yield engine
    engine.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logprobs_match_forward_for_other_architectures(tmp_path, arch):
    model = make_tiny_causal_lm(tmp_path, arch=arch, seed=2)
    engine = BuiltinEngine(
        tmp_path, config=EngineConfig(max_batch_size=3, max_seq_len=64, region_prefix=arch)
    )
    sampling = SamplingParams(n=2, temperature=0.9, top_p=0.9, top_k=50, max_new_tokens=9, seed=4)
    for c in engine.generate(_requests(), sampling):
        expected = _forward_logprobs(model, c.prompt_ids, c.response_ids, 0.9)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
    engine.close()


@pytest.mark.parametrize(
    ("max_batch_size", "steps_per_sync", "max_prefill_tokens"),
    [(1, 1, 128), (3, 5, 128), (8, 2, 1024)],
    ids=["one-slot", "refills", "all-at-once"],
)
def test_samples_do_not_depend_on_batching(
    tiny_model_dir, max_batch_size, steps_per_sync, max_prefill_tokens
):
    sampling = SamplingParams(n=3, max_new_tokens=10, seed=9, ignore_eos=True)
    reference = BuiltinEngine(
        tiny_model_dir, config=EngineConfig(max_batch_size=2, max_seq_len=128)
    )
    expected = reference.generate(_requests(), sampling)
    reference.close()
    config = EngineConfig(
        max_batch_size=max_batch_size,
        max_seq_len=128,
        steps_per_sync=steps_per_sync,
        max_prefill_tokens=max_prefill_tokens,
    )
    engine = BuiltinEngine(tiny_model_dir, config=config)
    got = engine.generate(_requests(), sampling)
    engine.close()
    assert [c.response_ids for c in got] == [c.response_ids for c in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )


def test_finished_slots_are_refilled_without_waiting_for_the_longest(tiny_model_dir, monkeypatch):
    # Context 48: the 8-token prompt may generate 40 tokens, the 44-token prompts only 4.
    engine = BuiltinEngine(
        tiny_model_dir, config=EngineConfig(max_batch_size=2, max_seq_len=48, steps_per_sync=1)
    )
    steps = []
    runner = engine._runner
    original = runner.run_decode_step
    monkeypatch.setattr(
        runner, "run_decode_step", lambda flags, span: (steps.append(1), original(flags, span))
    )
    requests = _requests([[7] * 8] + [[9] * 44] * 10)
    out = engine.generate(requests, SamplingParams(max_new_tokens=40, ignore_eos=True, seed=0))
    assert [len(c.response_ids) for c in out] == [40] + [4] * 10
    # Waiting for the longest per batch of 2 would take 39 + 4 * 3 + 4 * 3 = 63 decode steps;
    # refilling overlaps the short requests with the long one.
    assert len(steps) <= 45, len(steps)
    engine.close()


def test_attention_span_grows_with_the_sequences(tiny_model_dir, monkeypatch):
    # Prompt 50 + 40 new tokens crosses the 64-position bucket: steps must switch to 128 in
    # time (a span too short would hide keys and change the logprobs), and never read all 512.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = BuiltinEngine(model, config=EngineConfig(max_batch_size=2, max_seq_len=512))
    assert engine.attention_spans == [64, 128, 256, 512]
    spans = []
    runner = engine._runner
    original = runner.run_decode_step
    monkeypatch.setattr(
        runner, "run_decode_step", lambda flags, span: (spans.append(span), original(flags, span))
    )
    prompts = [list(range(10, 60)), list(range(70, 80))]
    sampling = SamplingParams(n=2, max_new_tokens=40, ignore_eos=True, seed=5)
    for c in engine.generate(_requests(prompts), sampling):
        expected = _forward_logprobs(model, c.prompt_ids, c.response_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
    assert set(spans) == {64, 128}, sorted(set(spans))
    engine.close()


def test_decode_steps_run_outside_a_call_change_no_later_sample(tiny_model_dir):
    # The diagnostics bench/rollout/rollout_gpu.py times and profiles the decode step with.
    config = EngineConfig(max_batch_size=2, max_seq_len=128)
    engine = BuiltinEngine(tiny_model_dir, config=config)
    with pytest.raises(RuntimeError, match="call generate first"):
        engine.run_decode_steps(span=64, num_steps=1)
    sampling = SamplingParams(n=2, max_new_tokens=12, ignore_eos=True, seed=3)
    before = engine.generate(_requests(), sampling)
    with pytest.raises(ValueError, match="attention_spans"):
        engine.run_decode_steps(span=65, num_steps=1)
    for span in engine.attention_spans:
        engine.run_decode_steps(span=span, num_steps=3, use_graph=False)
    assert engine.generate(_requests(), sampling) == before
    text = engine.model.config.get_text_config()
    head_dim = text.hidden_size // text.num_attention_heads
    per_layer = 2 * config.max_batch_size * text.num_key_value_heads * 128 * head_dim * 4
    assert engine.kv_cache_bytes == text.num_hidden_layers * per_layer  # keys + values, float32
    engine.close()


@pytest.mark.parametrize(
    ("max_seq_len", "expected"),
    [(2, [2]), (64, [64]), (65, [64, 65]), (640, [64, 128, 256, 512, 640])],
)
def test_span_buckets_end_at_the_context(max_seq_len, expected):
    assert span_buckets(max_seq_len) == expected


def test_eos_stops_unless_ignored(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    probe = BuiltinEngine(model, config=EngineConfig(max_batch_size=2, max_seq_len=64))
    first = probe.generate(_requests(PROMPTS[:1]), greedy)[0].response_ids
    probe.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.generation_config.eos_token_id = [first[2]]
    engine = BuiltinEngine(model, config=EngineConfig(max_batch_size=2, max_seq_len=64))
    stopped = engine.generate(
        _requests(PROMPTS[:1]), SamplingParams(temperature=0.0, max_new_tokens=6)
    )[0]
    assert stopped.response_ids == first[: first.index(first[2]) + 1]
    assert stopped.finish_reason == "stop"
    ignored = engine.generate(_requests(PROMPTS[:1]), greedy)[0]
    assert ignored.response_ids == first and ignored.finish_reason == "length"
    engine.close()


def test_context_limit_ends_generation_with_length(engine):
    prompt = list(range(5, 5 + 120))
    out = engine.generate(_requests([prompt]), SamplingParams(max_new_tokens=50, ignore_eos=True))
    assert len(out[0].response_ids) == 128 - 120 and out[0].finish_reason == "length"


def test_sampling_filters_restrict_tokens(engine, tiny_model_dir):
    greedy = engine.generate(
        _requests(), SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    )
    top1 = engine.generate(
        _requests(), SamplingParams(top_k=1, max_new_tokens=8, ignore_eos=True, seed=1)
    )
    tiny_p = engine.generate(
        _requests(), SamplingParams(top_p=1e-6, max_new_tokens=8, ignore_eos=True, seed=1)
    )
    assert [c.response_ids for c in top1] == [c.response_ids for c in greedy]
    assert [c.response_ids for c in tiny_p] == [c.response_ids for c in greedy]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for c in engine.generate(
        _requests(), SamplingParams(top_k=3, n=4, max_new_tokens=6, seed=2, ignore_eos=True)
    ):
        with torch.no_grad():
            logits = model(torch.tensor([c.prompt_ids + c.response_ids])).logits[0]
        top3 = logits[len(c.prompt_ids) - 1 : -1].topk(3).indices
        assert all(t in row for t, row in zip(c.response_ids, top3.tolist(), strict=True))


def test_sleep_releases_regions_and_guards_use(engine, tiny_model_dir):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = engine.generate(_requests(), greedy)
    assert resident_bytes("t/weights") > 0 and resident_bytes("t/kv_cache") > 0
    engine.sleep()
    assert is_paused("t/weights") and is_paused("t/kv_cache")
    assert resident_bytes("t/weights") == resident_bytes("t/kv_cache") == 0
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(_requests(), greedy)
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.update_weights([])
    # The RL order: weights first, sync new weights, then the KV cache.
    engine.wake_up(tags=["weights"])
    new = make_tiny_causal_lm(arch="qwen2", seed=5, max_position_embeddings=512)
    engine.update_weights(new.named_parameters())
    engine.wake_up(tags=["kv_cache"])
    after = engine.generate(_requests(), greedy)
    for c in after:
        expected = _forward_logprobs(new, c.prompt_ids, c.response_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine.update_weights(original.named_parameters())
    assert [c.response_ids for c in engine.generate(_requests(), greedy)] == [
        c.response_ids for c in before
    ]
    with pytest.raises(ValueError, match="tags"):
        engine.wake_up(tags=["optimizer"])


def test_update_weights_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(ValueError, match="not a parameter"):
        engine.update_weights([("model.layers.0.mlp.nope.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="pairs"):
        engine.update_weights([torch.zeros(3)])
    with pytest.raises(ValueError, match="bucket_bytes"):
        engine.update_weights([], bucket_bytes=0)


def test_name_mapper_translates_fused_weights(engine, tiny_model_dir):
    """A Megatron-style fused QKV weight is split by a mapper into HF q/k/v names."""
    new = make_tiny_causal_lm(arch="qwen2", seed=6, max_position_embeddings=512)
    fused = {}
    for name, tensor in new.state_dict().items():
        if ".self_attn.q_proj." in name:
            prefix, kind = name.split(".self_attn.q_proj.")
            parts = [new.state_dict()[f"{prefix}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
            fused[f"{prefix}.self_attn.linear_qkv.{kind}"] = torch.cat(parts)
        elif ".self_attn.k_proj." not in name and ".self_attn.v_proj." not in name:
            fused[name] = tensor
    sizes = [new.state_dict()[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0] for p in "qkv"]

    def to_hf(name, tensor):
        if ".linear_qkv." not in name:
            return [(name, tensor)]
        prefix, kind = name.split(".linear_qkv.")
        q, k, v = tensor.split(sizes)
        return [(f"{prefix}.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v), strict=True)]

    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    engine.update_weights(map_names(fused.items(), to_hf), bucket_bytes=1 << 14)
    via_mapper = engine.generate(_requests(), greedy)
    engine.update_weights(new.named_parameters())
    direct = engine.generate(_requests(), greedy)
    engine.update_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert [c.response_ids for c in via_mapper] == [c.response_ids for c in direct]


def test_stream_closed_early_aborts_and_frees_the_engine(engine):
    sampling = SamplingParams(max_new_tokens=100, ignore_eos=True, seed=3)

    async def take_first():
        stream = engine.stream(_requests() * 4, sampling)
        async for completion in stream:
            await stream.aclose()
            return completion

    assert asyncio.run(take_first()) is not None
    out = engine.generate(_requests(), SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert [c.finish_reason for c in out] == ["length"] * len(PROMPTS)


def test_abort_from_another_thread_ends_generate(tiny_model_dir):
    engine = BuiltinEngine(tiny_model_dir, config=EngineConfig(max_batch_size=2, max_seq_len=512))
    # The 5th decode step waits until another thread has aborted: no wall-clock race.
    reached, aborted = threading.Event(), threading.Event()
    runner, original_step, steps = engine._runner, engine._runner.run_decode_step, [0]

    def step(*args):
        steps[0] += 1
        if steps[0] == 5:
            reached.set()
            assert aborted.wait(30), "abort never came"
        original_step(*args)

    def abort_when_reached():
        assert reached.wait(30)
        engine.abort()
        aborted.set()

    runner.run_decode_step = step
    aborter = threading.Thread(target=abort_when_reached, daemon=True)
    aborter.start()
    out = engine.generate(
        _requests() * 2, SamplingParams(max_new_tokens=500, ignore_eos=True, seed=1)
    )
    aborter.join(30)
    assert [(c.request_index, c.sample_index) for c in out] == [(i, 0) for i in range(10)]
    reasons = [c.finish_reason for c in out]
    assert set(reasons) == {"abort"}, reasons
    assert sum(len(c.response_ids) for c in out) > 0  # in-flight samples keep partial output
    engine.close()


def test_stream_checks_input_before_iterating(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.stream([Request(prompt_ids=[])], SamplingParams())


def test_concurrent_generate_calls_each_get_their_outputs(engine):
    sampling = SamplingParams(n=2, max_new_tokens=12, seed=8, ignore_eos=True)
    expected = [c.response_ids for c in engine.generate(_requests(), sampling)]
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(engine.generate(_requests(), sampling)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and all([c.response_ids for c in r] == expected for r in results)


def test_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.tokenizer is not None


def test_closed_engine_refuses_work(tiny_model_dir):
    engine = BuiltinEngine(tiny_model_dir, config=EngineConfig(max_batch_size=1, max_seq_len=32))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(_requests(), SamplingParams())


def test_an_engine_closed_asleep_leaves_its_prefix_to_the_next_engine(tiny_model_dir):
    # An evaluation engine slept and closed, then built again in the same process: the second
    # one takes the tags over (they were left paused) and generates what a fresh engine does.
    config = EngineConfig(max_batch_size=2, max_seq_len=64, region_prefix="again")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    first = BuiltinEngine(tiny_model_dir, config=config)
    want = [c.response_ids for c in first.generate(_requests(), greedy)]
    first.sleep()
    first.close()
    assert is_paused("again/weights")  # the memory stays given back until a new owner
    second = BuiltinEngine(tiny_model_dir, config=config)
    assert not is_paused("again/weights") and not is_paused("again/kv_cache")
    assert [c.response_ids for c in second.generate(_requests(), greedy)] == want
    second.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("device", "tpu"),
        ("dtype", "int8"),
        ("max_batch_size", 0),
        ("max_seq_len", 1),
        ("steps_per_sync", 0),
        ("max_prefill_tokens", 8),
        ("region_prefix", "a/b"),
        ("device_memory_bytes", 0),
        ("stream_priority", 0.5),
        ("stream_priority", True),
    ],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_model_path_must_be_a_model_directory(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json"):
        BuiltinEngine(tmp_path)


# -- the decode step's fast path (issue 28): compiled step, decode attention kernels ----------


@pytest.mark.parametrize(
    ("field", "value"),
    [("compile_decode", "yes"), ("compile_prefill", "yes"), ("decode_attention", "flash")],
)
def test_fast_decode_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(**{field: value})


def test_fast_decode_is_off_on_cpu_by_default():
    config = EngineConfig()
    assert not config.should_compile_decode and config.decode_attention_kernel == "sdpa"
    assert EngineConfig(compile_decode=True).should_compile_decode
    assert EngineConfig(decode_attention="matmul").decode_attention_kernel == "matmul"


def _generate_both(tiny_model_dir, prefix, **overrides):
    config = EngineConfig(max_batch_size=3, max_seq_len=128, region_prefix=prefix, **overrides)
    engine = BuiltinEngine(tiny_model_dir, config=config)
    return engine, _generate_calls(engine)


def _generate_calls(engine):
    # 2-5 prompt tokens + 70 new ones cross the 64-position span bucket mid-run.
    sampled = engine.generate(
        _requests(PROMPTS[:4]),
        SamplingParams(n=2, temperature=0.9, top_k=40, max_new_tokens=70, seed=4, ignore_eos=True),
    )
    greedy = engine.generate(
        _requests(PROMPTS[:4]), SamplingParams(temperature=0, max_new_tokens=9)
    )
    return sampled + greedy


def _assert_same_samples(got, expected, atol):
    assert [c.response_ids for c in got] == [c.response_ids for c in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0
        )


@pytest.fixture(scope="module")
def eager_sdpa_samples(tiny_model_dir):
    engine, samples = _generate_both(tiny_model_dir, "ref-sdpa")
    engine.close()
    return samples


@pytest.mark.parametrize("attention", ["matmul", "triton"])  # triton: SDPA on CPU (logged)
def test_decode_attention_kernels_give_the_same_samples(
    tiny_model_dir, eager_sdpa_samples, attention
):
    engine, samples = _generate_both(tiny_model_dir, f"att-{attention}", decode_attention=attention)
    engine.close()
    _assert_same_samples(samples, eager_sdpa_samples, atol=1e-5)


def test_compiled_decode_step_gives_the_same_samples(tiny_model_dir, eager_sdpa_samples):
    # torch.compile (inductor, C++ on CPU) of the whole step: forward, sampling, bookkeeping.
    from torch._dynamo.utils import counters

    counters.clear()
    engine, samples = _generate_both(tiny_model_dir, "compiled", compile_decode=True)
    assert engine._runner._compiled_step is not None, "compiling fell back to eager"
    engine.close()
    _assert_same_samples(samples, eager_sdpa_samples, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # One graph per sampling mode (sampled, greedy): spans 64 and 128 share one (dynamic).
    assert counters["stats"]["unique_graphs"] == 2


def test_layer_compile_traces_one_layer_for_every_layer(tmp_path):
    """compile_scope="layers" on a 12-layer model: the same samples as eager, and fewer of
    dynamo's graphs than layers. Graphs come per shape specialisation (one row or several,
    a decode step, a span that grew, a mask or none), each shared by every layer; indexing the
    cache by module.layer_idx would make at least one per layer."""
    from torch._dynamo.utils import counters

    from yatt.rollout.builtin._layer_compile import BOUND_KEYS

    num_layers = 12
    model_dir = tmp_path / "twelve-layers"
    make_tiny_causal_lm(model_dir, arch="qwen2", seed=0, num_layers=num_layers)
    eager, want = _generate_both(model_dir, "layers-eager")
    eager.close()
    counters.clear()
    engine, got = _generate_both(
        model_dir, "layers", compile_decode=True, compile_prefill=True, compile_scope="layers"
    )
    _assert_same_samples(got, want, atol=1e-5)
    # The decode step's two ends (state in; sampling and state out) compiled too, not fallen
    # back to eager; they add graphs per sampling mode, not per layer.
    assert engine._runner._compiled_decode_ends is not None
    assert 1 <= counters["stats"]["unique_graphs"] < num_layers, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    model = engine.model
    assert sum(BOUND_KEYS in m.__dict__ for m in model.modules()) == num_layers
    engine.close()
    # Closed: no attention module keeps the cache alive.
    assert not any(BOUND_KEYS in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(
    "compile_config",
    [{}, {"compile_decode": True, "compile_prefill": True, "compile_scope": "layers"}],
    ids=["eager", "layers"],
)
def test_prefills_skip_transformers_packed_sequence_check(
    tiny_model_dir, monkeypatch, compile_config
):
    # Given no mask, transformers checks the positions it builds for packed sequences with a
    # .all() on the device: a host sync every prefill chunk on a GPU, whenever the forward is
    # not traced whole (eager, or compile_scope="layers", whose model forward runs eagerly).
    # Fresh prompts, a kept conversation's continuation and decode must never reach it.
    import transformers.masking_utils as masking

    real, calls = masking.find_packed_sequence_indices, []

    def recording(position_ids):
        calls.append(tuple(position_ids.shape))
        return real(position_ids)

    monkeypatch.setattr(masking, "find_packed_sequence_indices", recording)
    config = EngineConfig(
        max_batch_size=3,
        max_seq_len=16,
        max_prefill_tokens=16,
        region_prefix="nopack",
        **compile_config,
    )
    engine = BuiltinEngine(tiny_model_dir, config=config)
    runner, continued = engine._runner, []
    real_continuations = runner.prefill_continuations

    def counting_continuations(items, *args):
        continued.extend(items)
        return real_continuations(items, *args)

    monkeypatch.setattr(runner, "prefill_continuations", counting_continuations)
    # What stands in for the mask of a fresh prefill (T > 1 tokens in the first turn): a
    # placeholder, not a [T, T] mask in memory (1 GB a chunk at a 32k context).
    prefill_mask_bytes = []

    def record_mask(module, args, kwargs):
        if kwargs["input_ids"].shape[1] > 1:
            prefill_mask_bytes.append(kwargs["attention_mask"].untyped_storage().nbytes())

    hook = engine.model.register_forward_pre_hook(record_mask, with_kwargs=True)
    sampling = SamplingParams(temperature=0, max_new_tokens=3)
    first = engine.generate(
        [Request(prompt_ids=list(p), session_id=f"s{i}") for i, p in enumerate(PROMPTS[:3])],
        sampling,
    )
    hook.remove()
    history = [c.prompt_ids + c.response_ids + [20, 21] for c in first]
    engine.generate(
        [Request(prompt_ids=h, session_id=f"s{i}") for i, h in enumerate(history)], sampling
    )
    engine.close()
    assert not calls, f"transformers checked positions for packing {len(calls)} times: {calls}"
    assert len(continued) == 3, "the second turn continues every kept conversation"
    assert prefill_mask_bytes and max(prefill_mask_bytes) == 1, prefill_mask_bytes


@pytest.mark.parametrize(
    "compile_config",
    [
        {"compile_decode": True, "compile_prefill": True, "compile_scope": "layers"},
        {"compile_decode": True},
    ],
    ids=["layers", "step"],
)
def test_compiled_calls_survive_another_threads_fx_trace(
    tiny_model_dir, eager_sdpa_samples, monkeypatch, compile_config
):
    """torch marks an FX trace (part of every compile) in one process-wide flag, so an engine's
    compiled forward runs while that flag is up whenever another thread's engine compiles. Such
    calls run eagerly: same samples, no error, and the whole-step compile is kept for later
    calls (not dropped as a failed compile). The engine is built in this thread and driven from
    another: dynamo's settings are per thread in recent torch, so a setting made where the
    engine was built does not reach the thread that generates."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.fx._symbolic_trace as symbolic_trace

    monkeypatch.setattr(symbolic_trace, "_is_fx_tracing_flag", True)  # the other thread's trace
    config = EngineConfig(
        max_batch_size=3, max_seq_len=128, region_prefix="under-trace", **compile_config
    )
    # From dynamo's default, whatever an earlier engine of this process set.
    with torch._dynamo.config.patch(error_on_nested_fx_trace=True):
        engine = BuiltinEngine(tiny_model_dir, config=config)
    with ThreadPoolExecutor(1) as pool:  # a fresh thread: dynamo's defaults
        samples = pool.submit(_generate_calls, engine).result()
    _assert_same_samples(samples, eager_sdpa_samples, atol=1e-5)
    if "compile_scope" not in compile_config:
        assert engine._runner._compiled_step is not None, "the compiled step was dropped"
    engine.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"compile_scope": "graph"}, "compile_scope='graph'"),
        ({"compile_scope": "layers", "lora_mode": "beside"}, "lora_mode='beside'"),
    ],
)
def test_bad_compile_scope_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)


@pytest.mark.parametrize(
    ("field", "attribute", "message"),
    [
        ("compile_decode", "_compiled_step", "decoding eagerly"),
        ("compile_prefill", "_compiled_prefill", "prefilling eagerly"),
    ],
)
def test_falls_back_to_eager_when_compiling_fails(
    tiny_model_dir, eager_sdpa_samples, monkeypatch, caplog, field, attribute, message
):
    import yatt.rollout.builtin._batcher as batcher

    def broken_compile(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("inductor: no C++ compiler (planted)")

        return compiled

    monkeypatch.setattr(batcher.torch, "compile", broken_compile)
    with caplog.at_level("WARNING", logger=batcher.__name__):
        engine, samples = _generate_both(tiny_model_dir, f"fallback-{field}", **{field: True})
    assert getattr(engine._runner, attribute) is None
    engine.close()
    _assert_same_samples(samples, eager_sdpa_samples, atol=0.0)
    warnings = [r for r in caplog.records if message in r.getMessage()]
    assert len(warnings) == 1, "the fallback is logged once"
    assert f"EngineConfig.{field}=False" in warnings[0].getMessage()


@pytest.mark.parametrize("field", ["compile_decode", "compile_prefill"])
def test_compiled_calls_hold_the_capture_guard(
    tiny_model_dir, eager_sdpa_samples, monkeypatch, field
):
    # A compiled function's first calls compile and autotune, synchronising the device; in
    # another engine's thread that invalidated a CUDA-graph capture (H200, 16ea75f). Every
    # compiled call must run inside yatt.placement's may_sync section.
    import threading

    import yatt.rollout.builtin._batcher as batcher
    from yatt.placement import _capture_guard

    inside: list[bool] = []

    def recording_compile(fn, **kwargs):
        def compiled(*args, **kw):
            inside.append(threading.get_ident() in _capture_guard._GUARD._open)
            return fn(*args, **kw)

        return compiled

    monkeypatch.setattr(batcher.torch, "compile", recording_compile)
    engine, samples = _generate_both(tiny_model_dir, f"guarded-{field}", **{field: True})
    engine.close()
    _assert_same_samples(samples, eager_sdpa_samples, atol=0.0)
    assert inside, "the compiled function never ran"
    assert all(inside), f"{inside.count(False)} of {len(inside)} compiled calls outside may_sync"


def test_compiled_prefill_gives_the_same_samples(tiny_model_dir, eager_sdpa_samples):
    # 8 samples of 2-5-token prompts through 3 slots: prefill chunks of several row counts,
    # padded lengths and kept columns, all through the one dynamic compile.
    from torch._dynamo.utils import counters

    counters.clear()
    engine, samples = _generate_both(tiny_model_dir, "compiled-prefill", compile_prefill=True)
    assert engine._runner._compiled_prefill is not None, "compiling fell back to eager"
    engine.close()
    _assert_same_samples(samples, eager_sdpa_samples, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1, "the compiled prefill never ran"


def test_compiled_prefill_traces_the_opaque_causal_attention(tiny_model_dir, monkeypatch):
    # Traced, HF passes its causal mask and SDPA left flash on an H200 (prefill_profile_*.md):
    # the compiled prefill must keep attention as the opaque op, one per layer.
    import yatt.rollout.builtin._batcher as batcher

    real_compile = torch.compile
    seen = []

    def recording_backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    def compile_recording(fn, **kwargs):
        return real_compile(fn, backend=recording_backend, **kwargs)

    monkeypatch.setattr(batcher.torch, "compile", compile_recording)
    config = EngineConfig(
        max_batch_size=2, max_seq_len=64, region_prefix="opaque", compile_prefill=True
    )
    engine = BuiltinEngine(tiny_model_dir, config=config)
    engine.generate(_requests(PROMPTS[:2]), SamplingParams(temperature=0, max_new_tokens=2))
    num_layers = len(engine._runner.cache.keys)
    engine.close()
    calls = [t for t in seen if "prefill_kv_attention" in t]
    assert calls and len(calls) % num_layers == 0, (len(calls), num_layers)
    assert not [t for t in seen if "scaled_dot_product" in t], "SDPA traced into the graph"


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2)])
def test_prefill_kv_attention_writes_the_rows_and_is_causal_softmax_attention(
    num_heads, num_kv_heads
):
    from yatt.rollout.builtin._static_kv import prefill_kv_attention

    g = torch.Generator().manual_seed(0)
    B, T, D, S, L = 2, 7, 8, 4, 12
    q = torch.randn(B, num_heads, T, D, generator=g)
    k = torch.randn(B, num_kv_heads, T, D, generator=g)
    v = torch.randn(B, num_kv_heads, T, D, generator=g)
    k_cache = torch.full((S, num_kv_heads, L, D), 7.0)
    v_cache = torch.full((S, num_kv_heads, L, D), 7.0)
    # Three samples: row 1 into slots 3 and 0 (two samples of one prompt), row 0 into slot 2.
    slot_J, row_J = torch.tensor([3, 0, 2]), torch.tensor([1, 1, 0])
    out = prefill_kv_attention(q, k, v, k_cache, v_cache, slot_J, row_J, 0.3)
    # From the definition: head h reads key/value head h // (H_q / H_kv); position t sees <= t.
    rep = num_heads // num_kv_heads
    k_full, v_full = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k_full.transpose(-1, -2) * 0.3
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    expected = (scores.softmax(-1) @ v_full).transpose(1, 2)
    assert out.shape == (B, T, num_heads, D)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for cache, new in ((k_cache, k), (v_cache, v)):
        for slot, row in ((3, 1), (0, 1), (2, 0)):
            assert torch.equal(cache[slot, :, :T], new[row])
        assert (cache[1] == 7.0).all(), "a slot no sample owns was written"
        assert (cache[:, :, T:] == 7.0).all(), "positions past the prompt were written"
    # row_J None: row j into slot slot_J[j] (one sample per prompt), the same attention.
    k_cache.fill_(7.0)
    v_cache.fill_(7.0)
    out = prefill_kv_attention(q, k, v, k_cache, v_cache, torch.tensor([2, 0]), None, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for cache, new in ((k_cache, k), (v_cache, v)):
        assert torch.equal(cache[2, :, :T], new[0]) and torch.equal(cache[0, :, :T], new[1])
        assert (cache[[1, 3]] == 7.0).all() and (cache[:, :, T:] == 7.0).all()


def test_prefill_attention_never_runs_on_cudnn(tiny_model_dir, monkeypatch):
    """cuDNN's attention builds a graph per new shape (hundreds of ms), and prompt batches change
    shape from call to call (a judge's prompts hold the responses): prefill must not pick it.
    The flags are read at every prefill SDPA call (the engine's prefill op's and HF's)."""
    import yatt.rollout.builtin._static_kv as static_kv

    seen = []
    sdpa = static_kv.F.scaled_dot_product_attention
    decode_attention = static_kv.decode_attention
    in_decode = []

    def spy(query, *args, **kwargs):
        if not in_decode:  # decode's shapes are fixed per graph: cuDNN may serve it
            seen.append((query.shape[-2], torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(query, *args, **kwargs)

    def decode_spy(*args, **kwargs):
        in_decode.append(True)
        try:
            return decode_attention(*args, **kwargs)
        finally:
            in_decode.pop()

    monkeypatch.setattr(static_kv.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(static_kv, "decode_attention", decode_spy)
    engine = BuiltinEngine(tiny_model_dir, config=EngineConfig(max_batch_size=4, max_seq_len=128))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    engine.generate(_requests(), SamplingParams(max_new_tokens=3, ignore_eos=True, seed=0))
    engine.close()
    assert max(n for n, _ in seen) == max(len(p) for p in PROMPTS), "no prefill seen"
    assert not any(cudnn for _, cudnn in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
