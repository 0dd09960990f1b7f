"""The conformance suite and CUDA-graph decoding on a GPU (skipped on CPU machines)."""

NUM_GPUS = 1

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams
from yatt.rollout.testing import CONFORMANCE_CHECKS, ConformanceTarget
from yatt.testing import make_tiny_causal_lm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def cuda_target(tiny_model_dir):
    config = EngineConfig(device="cuda", max_batch_size=4, max_seq_len=256, region_prefix="cuda")
    engine = BuiltinEngine(tiny_model_dir, config=config)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval().cuda()
    original = {n: t.clone() for n, t in reference.state_dict().items()}
    other = make_tiny_causal_lm(arch="qwen2", seed=1, max_position_embeddings=512).cuda()

    def reference_logprobs(prompt, response, temperature):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + response], device="cuda")).logits[0].float()
        logits = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
        ids = torch.tensor(response, device="cuda")[:, None]
        return torch.log_softmax(logits, -1).gather(-1, ids)[:, 0].tolist()

    yield ConformanceTarget(
        engine=engine,
        vocab_size=reference.config.vocab_size,
        max_seq_len=256,
        new_weights=lambda: other.named_parameters(),
        original_weights=lambda: original.items(),
        reference_logprobs=reference_logprobs,
        logprob_atol=1e-3,  # TF32/kernel differences on GPU
    )
    engine.close()


@pytest.mark.parametrize("name", list(CONFORMANCE_CHECKS))
def test_builtin_engine_conforms_on_cuda(cuda_target, name):
    CONFORMANCE_CHECKS[name](cuda_target)


def test_decode_steps_outside_a_call_replay_the_graphs_and_change_no_later_sample(tiny_model_dir):
    # What bench/rollout/_decode_profile.py times and profiles: graph replays and eager steps per span.
    config = EngineConfig(device="cuda", max_batch_size=4, max_seq_len=256, region_prefix="diag")
    engine = BuiltinEngine(tiny_model_dir, config=config)
    requests = [Request(prompt_ids=[5 + i, 6, 7]) for i in range(6)]
    sampling = SamplingParams(n=2, max_new_tokens=20, seed=3, ignore_eos=True)
    before = engine.generate(requests, sampling)
    graphs = dict(engine._runner._graphs)
    assert engine.attention_spans == [64, 128, 256]
    for span in engine.attention_spans:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.run_decode_steps(span=span, num_steps=3)
        end.record()
        end.synchronize()
        assert start.elapsed_time(end) > 0
        engine.run_decode_steps(span=span, num_steps=2, use_graph=False)
    assert engine._runner._graphs.keys() == graphs.keys()
    assert all(engine._runner._graphs[k] is g for k, g in graphs.items()), "recaptured"
    after = engine.generate(requests, sampling)
    assert [c.response_ids for c in after] == [c.response_ids for c in before]
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )
    engine.close()


def test_cuda_graph_matches_eager(tiny_model_dir):
    # 3 + 90 tokens cross the 64-position span bucket: two graphs per engine, switched mid-run.
    requests = [Request(prompt_ids=[5 + i, 6, 7]) for i in range(6)]
    sampling = SamplingParams(n=2, max_new_tokens=90, seed=3, ignore_eos=True)
    outputs = []
    for use_graph in (False, True):
        config = EngineConfig(
            device="cuda", max_batch_size=4, max_seq_len=256, use_cuda_graph=use_graph
        )
        engine = BuiltinEngine(tiny_model_dir, config=config)
        outputs.append(engine.generate(requests, sampling))
        assert engine._runner.use_cuda_graph == use_graph
        engine.close()
    eager, graph = outputs
    assert [c.response_ids for c in graph] == [c.response_ids for c in eager]
    for g, e in zip(graph, eager, strict=True):
        torch.testing.assert_close(
            torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_slots", "span"), [(1, 64), (5, 200), (64, 640)])
def test_triton_decode_attention_matches_softmax_over_visible_positions(dtype, num_slots, span):
    # Reference, in float64: slot s's query head h attends to cache positions 0..min(pos_s,
    # span - 1) of KV head h // G (grouped-query attention, HF's repeat_kv order).
    from yatt.rollout.builtin._decode_kernel import triton_decode_attention

    g = torch.Generator(device="cuda").manual_seed(num_slots)
    Hq, Hkv, D, L = 14, 2, 64, span + 37
    q, k, v = (
        torch.randn(shape, device="cuda", generator=g).to(dtype)
        for shape in ((num_slots, Hq, 1, D), (num_slots, Hkv, L, D), (num_slots, Hkv, L, D))
    )
    # Idle slots may sit past the span (everything in the span visible); slot 0 sees one.
    pos = torch.randint(0, L, (num_slots,), device="cuda", generator=g)
    pos[0] = 0
    out = triton_decode_attention(q, k, v, pos, span=span, scale=D**-0.5)
    assert out is not None and out.shape == (num_slots, 1, Hq, D) and out.dtype == dtype
    ref = torch.empty(num_slots, 1, Hq, D, dtype=torch.float64, device="cuda")
    for s in range(num_slots):
        n = min(int(pos[s]) + 1, span)
        keys = k[s, :, :n].double().repeat_interleave(Hq // Hkv, dim=0)  # [Hq, n, D]
        values = v[s, :, :n].double().repeat_interleave(Hq // Hkv, dim=0)
        weights = torch.softmax((q[s, :, 0].double()[:, None] * keys).sum(-1) * D**-0.5, -1)
        ref[s, 0] = (weights[:, :, None] * values).sum(1)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


def _cuda_samples(tiny_model_dir, name, requests, calls, check=None, **overrides):
    """Every call's completions on a fresh CUDA engine of `overrides`; check(engine) after."""
    config = EngineConfig(
        device="cuda", max_batch_size=4, max_seq_len=256, region_prefix=name, **overrides
    )
    engine = BuiltinEngine(tiny_model_dir, config=config)
    samples = [c for sampling in calls for c in engine.generate(requests, sampling)]
    if check is not None:
        check(engine)
    engine.close()
    return samples


def _assert_same_cuda_samples(new, old):
    """Same tokens; logprobs equal to float32 noise."""
    assert [c.response_ids for c in new] == [c.response_ids for c in old]
    for a, b in zip(new, old, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )


def _span_crossing_calls():
    """Six prompts of 1-3 tokens; a sampled call (top-p, 2 samples each) whose 3 + 90 tokens
    cross the 64-position span bucket, then a greedy one."""
    requests = [Request(prompt_ids=[5 + i, 6, 7][: 1 + i % 3]) for i in range(6)]
    calls = [
        SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=90, seed=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=40),
    ]
    return requests, calls


def test_compiled_triton_decode_matches_the_eager_sdpa_path(tiny_model_dir):
    # The default CUDA path (compiled step, Triton decode attention) against the path before
    # it (eager step, SDPA) on the same seeds: same tokens, logprobs equal to float32 noise.
    # 3 + 90 tokens cross the 64-position span bucket (the compiled step is span-dynamic).
    requests, calls = _span_crossing_calls()

    def check_new(engine):
        config = engine.config
        assert config.should_compile_decode and config.decode_attention_kernel == "triton"
        assert engine._runner._compiled_step is not None, "compiling fell back to eager"

    old = _cuda_samples(
        tiny_model_dir, "old", requests, calls, compile_decode=False, decode_attention="sdpa"
    )
    new = _cuda_samples(tiny_model_dir, "new", requests, calls, check=check_new)  # the defaults
    _assert_same_cuda_samples(new, old)


def test_layer_compile_scope_matches_the_whole_step_compile_on_cuda(tiny_model_dir):
    # compile_scope="layers" (each decoder layer compiled once, the step eager around it, still
    # captured in CUDA graphs) against the default whole-step compile, on the same seeds: same
    # tokens, logprobs to float32 noise. 3 + 90 tokens cross the 64-position span bucket.
    from yatt.rollout.builtin._layer_compile import BOUND_KEYS

    requests, calls = _span_crossing_calls()

    def check_layers(engine):
        assert engine._runner.use_cuda_graph, "layers scope fell back from CUDA graphs"
        assert engine._runner._compiled_step is None, "the whole step was compiled too"
        assert engine._runner._compiled_decode_ends is not None, "sampling fell back to eager"
        assert any(BOUND_KEYS in m.__dict__ for m in engine.model.modules())

    step = _cuda_samples(tiny_model_dir, "scope-step", requests, calls)
    layers = _cuda_samples(
        tiny_model_dir, "scope-layers", requests, calls, check_layers, compile_scope="layers"
    )
    _assert_same_cuda_samples(layers, step)


def test_compiled_prefill_matches_the_eager_prefill_on_cuda(tiny_model_dir):
    # The default CUDA prefill (compiled, its attention the opaque prefill_kv_attention op)
    # against the eager one. Prompts of 1-36 tokens through 4 slots: prefill chunks of several
    # row counts, padded lengths and kept columns through the one dynamic compile.
    requests = [Request(prompt_ids=[5 + (i * j) % 90 for j in range(1 + 7 * i)]) for i in range(6)]
    calls = [
        SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=30, seed=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=20),
    ]

    def check_compiled(engine):
        assert engine._runner._compiled_prefill is not None, "compiling fell back to eager"

    old = _cuda_samples(tiny_model_dir, "eager-prefill", requests, calls, compile_prefill=False)
    new = _cuda_samples(tiny_model_dir, "compiled-prefill", requests, calls, check_compiled)
    _assert_same_cuda_samples(new, old)


@pytest.mark.parametrize("compile_prefill", [False, True, "layers"])
def test_prefill_never_waits_for_the_gpu(
    tiny_model_dir, monkeypatch, compile_prefill, recording_device_syncs
):
    # The host must queue prefill chunk after chunk while the GPU runs them: a copy to the GPU
    # from pageable memory (or a .item(), a .cpu()) waits for the stream to drain, and the GPU
    # then idles while the host builds the next chunk (13% of a judge-like prefill on an
    # H200). Prompts of 2-29 tokens in chunks of at most 64 padded tokens, 2 samples each
    # (then 1: the one-sample-per-row write); label logprobs and a stop token on the path.
    config = EngineConfig(
        device="cuda",
        max_batch_size=4,
        max_seq_len=64,
        max_prefill_tokens=64,
        region_prefix=f"nosync-{compile_prefill}",
        compile_prefill=bool(compile_prefill),
        compile_scope="layers" if compile_prefill == "layers" else "step",
    )
    engine = BuiltinEngine(tiny_model_dir, config=config)
    requests = [Request(prompt_ids=[5 + j for j in range(2 + 9 * i)]) for i in range(4)]
    calls = [
        SamplingParams(n=n, max_new_tokens=3, seed=0, label_token_ids=[3, 4], stop_token_ids=[9])
        for n in (2, 1)
    ]
    for sampling in calls:  # compiles and captures: those may synchronise
        engine.generate(requests, sampling)
    runner = engine._runner
    prefill, chunks, syncs = runner.prefill, [], []

    def counting_prefill(*args, **kwargs):
        chunks.append(len(args[0]))
        return prefill(*args, **kwargs)

    monkeypatch.setattr(runner, "prefill", recording_device_syncs(counting_prefill, syncs))
    completions = [c for sampling in calls for c in engine.generate(requests, sampling)]
    engine.close()
    # Eager and under compile_scope="layers" too: the prefill passes a placeholder 4D mask, so
    # transformers never checks its positions for packed sequences (a .all() on the GPU).
    assert not syncs, f"a prefill synchronised with the GPU {len(syncs)} times:\n" + "\n".join(
        sorted(set(syncs))
    )
    assert len(chunks) >= 4, "prompts this long fill several chunks"
    assert sum(chunks) == 12 and len(completions) == 12
    assert all(len(c.label_logprobs) == 2 for c in completions)


def test_memory_fraction_resizes_the_kv_cache_on_cuda(tiny_model_dir):
    # Sized from the GPU's total memory: the fraction that holds the weights and 2 slots.
    config = EngineConfig(device="cuda", max_batch_size=8, max_seq_len=256, region_prefix="frac")
    engine = BuiltinEngine(tiny_model_dir, config=config)
    requests = [Request(prompt_ids=[5 + i, 6, 7]) for i in range(6)]
    sampling = SamplingParams(n=2, max_new_tokens=90, seed=3, ignore_eos=True)
    eight = engine.generate(requests, sampling)
    layout, total = engine._kv_layout, torch.cuda.mem_get_info()[1]
    share = engine._weight_bytes + layout.fixed_bytes + 2 * layout.slot_bytes
    engine.set_memory_fraction(share / total * 1.0001)
    assert engine.num_slots == 8  # applied at the next allocation
    engine.sleep()
    engine.wake_up(tags=("weights",))
    engine.wake_up(tags=("kv_cache",))
    assert engine.num_slots == 2
    two = engine.generate(requests, sampling)  # graphs recaptured for the new slot count
    assert [c.response_ids for c in two] == [c.response_ids for c in eight]
    engine.set_memory_fraction(1.0)
    assert [c.response_ids for c in engine.generate(requests, sampling)] == [
        c.response_ids for c in eight
    ]
    assert engine.num_slots == 8
    engine.sleep()
    engine.close()


def test_kept_graphs_survive_sleep_and_wake(tiny_model_dir):
    # keep_graphs_asleep: weights and KV cache come back at the same addresses, so the graphs
    # captured before sleep() replay correctly after wake_up(), with no recapture.
    from yatt.placement import is_paused

    config = EngineConfig(
        device="cuda",
        max_batch_size=4,
        max_seq_len=256,
        region_prefix="keep",
        keep_graphs_asleep=True,
    )
    engine = BuiltinEngine(tiny_model_dir, config=config)
    requests = [Request(prompt_ids=[5 + i, 6, 7]) for i in range(6)]
    sampling = SamplingParams(n=2, max_new_tokens=90, seed=3, ignore_eos=True)
    before = engine.generate(requests, sampling)
    graphs = dict(engine._runner._graphs)
    assert len(graphs) >= 2  # 93 tokens cross a span bucket
    engine.sleep()
    assert is_paused("keep/weights") and is_paused("keep/kv_cache")
    engine.wake_up()
    after = engine.generate(requests, sampling)
    assert engine._runner._graphs.keys() == graphs.keys()
    assert all(engine._runner._graphs[k] is g for k, g in graphs.items()), "recaptured"
    assert [c.response_ids for c in after] == [c.response_ids for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in before]
    engine.sleep()
    engine.close()


def test_engine_work_runs_on_its_own_stream(tiny_model_dir):
    # Prefill, graph replays and harvest copies go to the engine's stream, not the default one:
    # that is what lets two engines on one GPU overlap.
    engines = [
        BuiltinEngine(
            tiny_model_dir,
            config=EngineConfig(device="cuda", max_batch_size=4, max_seq_len=256, region_prefix=p),
        )
        for p in ("stream_a", "stream_b")
    ]
    streams = [engine._dev.stream for engine in engines]
    assert None not in streams and streams[0] != streams[1]
    default = torch.cuda.default_stream()
    assert all(s != default for s in streams)
    seen = []
    runner = engines[0]._runner
    for name in ("prefill", "run_decode_step", "read_slots", "read_responses"):
        original = getattr(runner, name)

        def spy(*args, _original=original, _name=name):
            seen.append((_name, torch.cuda.current_stream()))
            return _original(*args)

        setattr(runner, name, spy)
    engines[0].generate(
        [Request(prompt_ids=[5, 6, 7])], SamplingParams(max_new_tokens=20, ignore_eos=True)
    )
    assert {name for name, _ in seen} == {
        "prefill",
        "run_decode_step",
        "read_slots",
        "read_responses",
    }
    assert all(stream == streams[0] for _, stream in seen), seen
    for engine in engines:
        engine.close()


def test_stream_priority_reaches_the_engine_stream(tiny_model_dir):
    least, greatest = torch.cuda.Stream.priority_range()
    urgent = BuiltinEngine(
        tiny_model_dir,
        config=EngineConfig(device="cuda", max_seq_len=64, stream_priority=-1, region_prefix="hi"),
    )
    normal = BuiltinEngine(
        tiny_model_dir, config=EngineConfig(device="cuda", max_seq_len=64, region_prefix="lo")
    )
    assert normal._dev.stream.priority == least
    assert urgent._dev.stream.priority == max(greatest, -1) < least
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    requests = [Request(prompt_ids=[5, 6, 7])]
    assert urgent.generate(requests, sampling)[0].response_ids == (
        normal.generate(requests, sampling)[0].response_ids
    )
    urgent.close()
    normal.close()


def _two_engines(tiny_model_dir, **overrides):
    config = dict(device="cuda", max_batch_size=8, max_seq_len=256)
    return [
        BuiltinEngine(tiny_model_dir, config=EngineConfig(region_prefix=p, **(config | overrides)))
        for p in ("pair_a", "pair_b")
    ]


def test_two_engines_in_two_threads_match_one_after_another(tiny_model_dir):
    import threading

    requests = [Request(prompt_ids=[5 + i, 6, 7]) for i in range(6)]
    sampling = [
        SamplingParams(n=2, temperature=0.0, max_new_tokens=120, ignore_eos=True),
        SamplingParams(n=2, max_new_tokens=100, seed=3, ignore_eos=True),
    ]
    engines = _two_engines(tiny_model_dir)
    expected = [e.generate(requests, s) for e, s in zip(engines, sampling, strict=True)]
    for engine in engines:
        engine.close()
    # Fresh engines: both first calls capture their graphs at once (one at a time inside).
    engines = _two_engines(tiny_model_dir)
    results: dict[int, list] = {}
    start = threading.Barrier(2)

    def work(i):
        start.wait()
        results[i] = engines[i].generate(requests, sampling[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    for i in range(2):
        assert [c.response_ids for c in results[i]] == [c.response_ids for c in expected[i]]
        for got, want in zip(results[i], expected[i], strict=True):
            torch.testing.assert_close(
                torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0
            )
    for engine in engines:
        engine.close()


def test_two_engines_overlap_on_one_gpu(tmp_path):
    # A latency-bound decode (small batch, many small kernels) on two engines at once should
    # take clearly less than the two one after another; printed for the benchmark notes.
    import threading
    import time

    from yatt.testing import make_tiny_causal_lm

    make_tiny_causal_lm(
        tmp_path, arch="qwen2", hidden_size=512, num_layers=8, intermediate_size=1536, seed=0
    )
    engines = _two_engines(tmp_path, max_seq_len=512)
    requests = [Request(prompt_ids=[5 + i, 6, 7]) for i in range(8)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    for engine in engines:  # graphs captured, allocator warm
        engine.generate(requests, sampling)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for engine in engines:
        engine.generate(requests, sampling)
    sequential_s = time.perf_counter() - t0
    start = threading.Barrier(3)
    threads = [
        threading.Thread(target=lambda e=e: (start.wait(), e.generate(requests, sampling)))
        for e in engines
    ]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join(120)
    concurrent_s = time.perf_counter() - t0
    ratio = concurrent_s / sequential_s
    print(
        f"two engines: sequential {sequential_s:.3f}s, concurrent {concurrent_s:.3f}s ({ratio:.2f}x)"
    )
    assert ratio < 0.85, (
        f"no overlap: sequential {sequential_s:.3f}s, concurrent {concurrent_s:.3f}s"
    )
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_joined_calls_match_separate_calls_with_cuda_graphs(
    tiny_model_dir, stall_first_decode, assert_same_samples, kind
):
    import threading

    config = EngineConfig(device="cuda", max_batch_size=4, max_seq_len=256, region_prefix="cj")
    engine = BuiltinEngine(tiny_model_dir, config=config)
    extra = dict(temperature=0.0) if kind == "greedy" else dict(temperature=0.9, top_p=0.95)
    requests_a = [Request(prompt_ids=[5 + i, 6, 7]) for i in range(5)]
    requests_b = [Request(prompt_ids=[50 + i, 51]) for i in range(3)]
    sampling_a = SamplingParams(n=2, max_new_tokens=90, seed=1, ignore_eos=True, **extra)
    sampling_b = SamplingParams(n=3, max_new_tokens=40, seed=2, ignore_eos=True, **extra)
    expected_a = engine.generate(requests_a, sampling_a)
    expected_b = engine.generate(requests_b, sampling_b)
    assert engine._runner.use_cuda_graph
    counts = stall_first_decode(engine, lambda: engine.num_joined_calls == 1)
    out = {}
    thread = threading.Thread(target=lambda: out.update(a=engine.generate(requests_a, sampling_a)))
    thread.start()
    got_b = engine.generate(requests_b, sampling_b)
    thread.join(120)
    assert not thread.is_alive()
    assert engine.num_joined_calls == 1 and counts["loops"] == 1
    assert_same_samples(out["a"], expected_a)
    assert_same_samples(got_b, expected_b)
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_slots", "slots", "span"), [(4, [2], 64), (9, [7, 0, 3, 8, 5], 200)])
def test_triton_decode_attention_reads_through_slot_indices(dtype, num_slots, slots, span):
    # Batch row b is cache slot slot_B[b] at position pos_B[b] (a bucket of the running slots):
    # the reference, in float64, reads that slot's row for positions 0..min(pos_B[b], span-1).
    from yatt.rollout.builtin._decode_kernel import triton_decode_attention

    g = torch.Generator(device="cuda").manual_seed(num_slots)
    B, Hq, Hkv, D, L = len(slots), 14, 2, 64, span + 37
    q = torch.randn((B, Hq, 1, D), device="cuda", generator=g).to(dtype)
    k, v = (torch.randn((num_slots, Hkv, L, D), device="cuda", generator=g).to(dtype) for _ in "kv")
    slot_B = torch.tensor(slots, device="cuda")
    pos_B = torch.randint(0, L, (B,), device="cuda", generator=g)
    pos_B[0] = 0
    out = triton_decode_attention(q, k, v, pos_B, span=span, scale=D**-0.5, slot_B=slot_B)
    assert out is not None and out.shape == (B, 1, Hq, D) and out.dtype == dtype
    ref = torch.empty(B, 1, Hq, D, dtype=torch.float64, device="cuda")
    for b, s in enumerate(slots):
        n = min(int(pos_B[b]) + 1, span)
        keys = k[s, :, :n].double().repeat_interleave(Hq // Hkv, dim=0)  # [Hq, n, D]
        values = v[s, :, :n].double().repeat_interleave(Hq // Hkv, dim=0)
        weights = torch.softmax((q[b, :, 0].double()[:, None] * keys).sum(-1) * D**-0.5, -1)
        ref[b, 0] = (weights[:, :, None] * values).sum(1)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


# Per-request limits, low slots longest: the running count falls through every bucket mid-run
# (and the running slots are never a prefix of the slots).
_BUCKET_LIMITS = [90, 7, 70, 12, 50, 20, 33, 3, 61, 15]


@pytest.mark.parametrize(
    "path",
    [
        dict(),  # the CUDA defaults: compiled step, Triton attention, CUDA graphs
        dict(compile_decode=False, decode_attention="sdpa"),  # gathers a bucket's KV rows
        dict(compile_decode=False, decode_attention="matmul", use_cuda_graph=False),
    ],
    ids=["default", "sdpa-graphs", "matmul-eager"],
)
def test_batch_buckets_match_every_slot_decoding_on_cuda(tiny_model_dir, path):
    # The bucketed engine against the same engine without buckets (every step over every
    # slot, the engine before buckets) on the same seeds: same tokens, logprobs to float32
    # noise (a bucket's GEMMs and split-K attention may round differently from the full batch).
    requests = [
        Request(prompt_ids=[5 + i, 6, 7][: 1 + i % 3], max_new_tokens=n)
        for i, n in enumerate(_BUCKET_LIMITS)
    ]
    calls = [
        SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=90, seed=3, ignore_eos=True),
        SamplingParams(n=1, temperature=1.0, max_new_tokens=90, seed=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=90, ignore_eos=True),
    ]
    outputs, steps = {}, {}
    for name, buckets in (("every-slot", ()), ("bucketed", (1, 2, 4, 8))):
        config = EngineConfig(
            device="cuda",
            max_batch_size=16,
            max_seq_len=256,
            region_prefix=f"b{name}",
            decode_batch_buckets=buckets,
            **path,
        )
        engine = BuiltinEngine(tiny_model_dir, config=config)
        outputs[name] = [c for sampling in calls for c in engine.generate(requests, sampling)]
        runner = engine._runner
        steps[name] = dict(runner.bucket_steps)
        if name == "bucketed":
            assert engine.decode_batch_buckets == [1, 2, 4, 8, 16]
            if config.should_compile_decode:
                assert runner._compiled_step is not None, "compiling fell back to eager"
            if runner.use_cuda_graph:  # one graph per (sampling mode, span, batch bucket)
                spans, buckets_all = engine.attention_spans, engine.decode_batch_buckets
                modes = {key[:2] for key in runner._graphs}
                assert len(modes) == 3
                assert len(runner._graphs) == 3 * len(spans) * len(buckets_all)
        engine.close()
    assert set(steps["every-slot"]) == {16}
    assert {1, 2, 4, 8, 16} <= set(steps["bucketed"]), steps["bucketed"]
    # The host checks are the same, so the number of steps is too; only their width differs.
    assert sum(steps["bucketed"].values()) == sum(steps["every-slot"].values())
    old, new = outputs["every-slot"], outputs["bucketed"]
    assert [c.response_ids for c in new] == [c.response_ids for c in old]
    for a, b in zip(new, old, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )
