"""The vLLM and SGLang adapters against fakes of the engines' public APIs (no GPU, no install).

The fakes (yatt.rollout.testing) mirror vLLM 0.26.0 and SGLang 0.5.17, the versions the adapters were verified on with a
GPU (tests/test_gpu_engines.py): their method signatures, and the behaviours the adapters must
bridge (SGLang refuses prompt + max_new_tokens beyond its context, skips stop_token_ids under
ignore_eos, and reads a sampling_seed only in deterministic mode).
"""

NUM_GPUS = 0

import asyncio
import sys
import types

import pytest
import torch

from yatt.rollout import (
    Request,
    SamplingParams,
    SGLangConfig,
    SGLangEngine,
    VLLMConfig,
    VLLMEngine,
    _sglang,
    _vllm,
)
from yatt.rollout._sglang import (
    completion_from_sglang,
    sglang_memory_tags,
    sglang_sampling_params,
    sglang_status,
)
from yatt.rollout._vllm import (
    finish_reason_of,
    label_logprobs_from_vllm,
    sampled_logprobs,
    vllm_label_probe_kwargs,
    vllm_prompt,
    vllm_sampling_kwargs,
)
from yatt.rollout.testing import VLLMLogprob, sglang_modules, vllm_modules

# -- vLLM -------------------------------------------------------------------------------------


_Logprob = VLLMLogprob


@pytest.fixture
def fake_vllm(monkeypatch):
    modules = vllm_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    for name in ("RANK", "WORLD_SIZE"):  # one process, not launched: the default executor
        monkeypatch.delenv(name, raising=False)
    return modules["vllm"]


def test_vllm_sampling_translation():
    sampling = SamplingParams(
        n=4,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.1,
        max_new_tokens=9,
        stop_token_ids=(3,),
        ignore_eos=True,
    )
    kw = vllm_sampling_kwargs(sampling, sample_seed=11)
    assert kw["n"] == 1 and kw["seed"] == 11 and kw["max_tokens"] == 9
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.7, 0.9, 5)
    assert (kw["min_p"], kw["repetition_penalty"]) == (0.05, 1.1)
    # Off values are vLLM's own defaults (min_p 0, repetition_penalty 1).
    off = vllm_sampling_kwargs(SamplingParams(), sample_seed=None)
    assert (off["min_p"], off["repetition_penalty"]) == (0.0, 1.0)
    assert kw["stop_token_ids"] == [3] and kw["ignore_eos"] is True and kw["logprobs"] == 0
    image = torch.zeros(3, 2, 2)
    assert (
        vllm_prompt(Request(prompt_ids=[1, 2], images=[image]))["multi_modal_data"]["image"][0]
        is image
    )
    assert "multi_modal_data" not in vllm_prompt(Request(prompt_ids=[1]))
    assert sampled_logprobs(
        [7, 9], [{7: _Logprob(-1.0), 1: _Logprob(-2.0)}, {9: _Logprob(-3.0)}]
    ) == [-1.0, -3.0]
    with pytest.raises(RuntimeError, match="logprobs"):
        sampled_logprobs([7], None)
    assert finish_reason_of("abort") == "abort"
    with pytest.raises(RuntimeError, match="unknown"):
        finish_reason_of(None)


def test_vllm_engine_generates_streams_and_syncs_weights(fake_vllm):
    engine = VLLMEngine("/models/x", config=VLLMConfig(sleep_level=2))
    llm = engine._llm
    assert llm.kwargs["enable_sleep_mode"] and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["worker_extension_cls"].endswith("WeightLoaderExtension")
    reqs = [Request(prompt_ids=[10, 1]), Request(prompt_ids=[20], request_id="b")]
    out = engine.generate(reqs, SamplingParams(n=2, max_new_tokens=3, stop_token_ids=(21,), seed=1))
    assert [(c.request_index, c.sample_index) for c in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert out[0].response_ids == [10, 11, 12] and out[0].finish_reason == "length"
    assert out[0].logprobs == [-1.5, -2.5, -3.5]
    assert (
        out[2].response_ids == [20, 21]
        and out[2].finish_reason == "stop"
        and out[2].request_id == "b"
    )
    streamed = asyncio.run(_collect(engine.stream(reqs, SamplingParams(n=2, max_new_tokens=3))))
    assert sorted((c.request_index, c.sample_index) for c in streamed) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    pairs = [(f"w{i}", torch.zeros(4)) for i in range(5)]
    engine.update_weights(iter(pairs), bucket_bytes=32)
    assert llm.calls == [
        ("yatt_load_weights", ["w0", "w1"]),
        ("yatt_load_weights", ["w2", "w3"]),
        ("yatt_load_weights", ["w4"]),
        ("reset_prefix_cache",),
    ]
    llm.calls.clear()
    engine.sleep()
    engine.wake_up(tags=["kv_cache", "weights"])
    assert llm.calls == [
        ("sleep", 2),
        ("wake_up", ["weights", "kv_cache"]),
        ("reset_prefix_cache",),
    ]
    with pytest.raises(ValueError, match="tags"):
        engine.wake_up(tags="weights")
    with pytest.raises(ValueError, match="context"):
        engine.generate([Request(prompt_ids=[1] * 64)], SamplingParams())
    with pytest.raises(ValueError, match="text-only"):
        engine.generate([Request(prompt_ids=[1], images=["img"])], SamplingParams())


def test_vllm_engine_abort_keeps_partial_outputs(fake_vllm):
    engine = VLLMEngine("/models/x")
    original_step = engine._llm.llm_engine.step
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 3:
            engine.abort()
        return original_step()

    engine._llm.llm_engine.step = step
    out = engine.generate([Request(prompt_ids=[5])] * 2, SamplingParams(max_new_tokens=50))
    assert [c.finish_reason for c in out] == ["abort", "abort"]
    assert [c.response_ids for c in out] == [[5, 6, 7]] * 2
    assert len(engine._llm.llm_engine.aborted) == 2


def test_vllm_engine_refuses_multiprocess_mode(fake_vllm, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match="MULTIPROCESSING"):
        VLLMEngine("/models/x")


async def _collect(stream):
    return [c async for c in stream]


# -- SGLang -----------------------------------------------------------------------------------


def test_sglang_sampling_and_output_translation():
    p = sglang_sampling_params(
        SamplingParams(top_k=0, temperature=0.0, max_new_tokens=4, stop_token_ids=(2,)),
        sample_seed=3,
    )
    assert p["top_k"] == -1 and p["temperature"] == 0.0 and p["max_new_tokens"] == 4
    assert p["stop_token_ids"] == [2] and p["sampling_seed"] == 3
    assert sglang_sampling_params(SamplingParams(top_k=7), sample_seed=0)["top_k"] == 7
    p = sglang_sampling_params(SamplingParams(min_p=0.1, repetition_penalty=1.2), sample_seed=None)
    assert (p["min_p"], p["repetition_penalty"]) == (0.1, 1.2)
    # Off values are SGLang's own defaults (min_p 0, repetition_penalty 1).
    p = sglang_sampling_params(SamplingParams(), sample_seed=None)
    assert (p["min_p"], p["repetition_penalty"]) == (0.0, 1.0)
    request = Request(prompt_ids=[1, 2], metadata={"m": 1})
    output = {
        "output_ids": [5, 2],
        "meta_info": {
            "output_token_logprobs": [(-0.1, 5, None), (-0.2, 2, None)],
            "finish_reason": {"type": "stop", "matched": 2},
        },
    }
    c = completion_from_sglang(output, request_index=3, sample_index=1, request=request)
    assert (c.response_ids, c.logprobs, c.finish_reason) == ([5, 2], [-0.1, -0.2], "stop")
    assert c.request_id == "3" and c.metadata == {"m": 1} and c.prompt_ids == [1, 2]
    output["meta_info"]["output_token_logprobs"] = None
    with pytest.raises(RuntimeError, match="return_logprob"):
        completion_from_sglang(output, request_index=0, sample_index=0, request=request)
    assert sglang_memory_tags(["kv_cache", "weights"], has_cuda_graph_tag=True) == [
        "weights",
        "kv_cache",
        "cuda_graph",
    ]
    assert sglang_memory_tags(["weights"], has_cuda_graph_tag=True) == ["weights"]


@pytest.fixture
def fake_sglang(monkeypatch):
    modules = sglang_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules["sglang"]


def _refused_flush():
    message = "Cache not flushed because there are pending requests."
    return types.SimpleNamespace(success=False, message=message)


def test_sglang_weight_update_failures_raise_with_the_engine_message(fake_sglang, monkeypatch):
    monkeypatch.setattr(_sglang, "FLUSH_FIRST_WAIT_S", 0.0)
    engine = SGLangEngine("/models/x")
    inner = engine._engine
    pairs = [(f"w{i}", torch.zeros(2)) for i in range(3)]
    inner.update_results = [(True, "ok"), (False, "Update weights failed: shape mismatch")]
    with pytest.raises(RuntimeError, match=r"bucket 1 \(1 tensors, from 'w2'\): Update weights "):
        engine.update_weights(pairs, bucket_bytes=16)
    assert [c[0] for c in inner.calls] == ["update", "update"]  # no flush after a failure
    # A flush refused while requests drain is tried again; then it succeeds.
    inner.calls.clear()
    inner.flush_results = [_refused_flush(), _refused_flush()]
    engine.update_weights(pairs, bucket_bytes=16)
    assert [c[0] for c in inner.calls] == ["update", "update", "flush", "flush", "flush"]
    # Refused every time: it raises, naming SGLang's message.
    inner.flush_results = [_refused_flush()] * _sglang.FLUSH_TRIES
    with pytest.raises(RuntimeError, match=r"flush_cache failed 5 times: Cache not flushed"):
        engine.update_weights(pairs, bucket_bytes=16)
    assert not inner.flush_results
    engine.close()


def test_sglang_status_reads_what_sglang_returns():
    assert sglang_status((True, "done")) == (True, "done")
    assert sglang_status((False, "bad shape")) == (False, "bad shape")
    assert sglang_status(types.SimpleNamespace(success=False, message="busy")) == (False, "busy")
    assert sglang_status(None) == (True, "")
    with pytest.raises(RuntimeError, match="not a \\(success, message\\) status"):
        sglang_status("weird")


def test_vllm_weight_update_failures_raise(fake_vllm, monkeypatch):
    monkeypatch.setattr(_vllm, "RESET_FIRST_WAIT_S", 0.0)
    engine = VLLMEngine("/models/x")
    llm = engine._llm
    pairs = [(f"w{i}", torch.zeros(4)) for i in range(3)]
    llm.rpc_results = [[2, 2], [0, 1]]  # two workers; the second bucket half loaded
    with pytest.raises(RuntimeError, match=r"loaded \[0, 1\] of the 1 tensors of bucket 1"):
        engine.update_weights(pairs, bucket_bytes=32)
    assert ("reset_prefix_cache",) not in llm.calls
    # A refused reset is tried again, then succeeds.
    llm.calls.clear()
    llm.reset_results = [False, False]
    engine.update_weights(pairs, bucket_bytes=32)
    assert llm.calls.count(("reset_prefix_cache",)) == 3
    llm.reset_results = [False] * _vllm.RESET_TRIES
    with pytest.raises(RuntimeError, match="reset_prefix_cache failed 5 times"):
        engine.update_weights(pairs, bucket_bytes=32)
    # Waking the KV cache resets it too, with the same check.
    llm.reset_results = [False] * _vllm.RESET_TRIES
    with pytest.raises(RuntimeError, match="reset_prefix_cache failed"):
        engine.wake_up(tags=["kv_cache"])


def test_adapters_report_label_logprobs(fake_vllm, fake_sglang):
    reqs = [Request(prompt_ids=[10, 1]), Request(prompt_ids=[20])]
    sampling = SamplingParams(n=2, max_new_tokens=3, label_token_ids=(7, 3))
    for engine in (VLLMEngine("/models/x"), SGLangEngine("/models/x")):
        assert engine.supports_label_logprobs
        out = engine.generate(reqs, sampling)
        # The fakes give id t the logprob -t/10: each completion's labels, in the asked order.
        assert [(c.request_index, c.sample_index) for c in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(c.label_logprobs == [-0.7, -0.3] for c in out)
        plain = engine.generate(reqs, SamplingParams(max_new_tokens=2))
        assert all(c.label_logprobs is None for c in plain)
        engine.close()


def test_vllm_label_probe_is_one_token_over_the_labels_only():
    kwargs = vllm_label_probe_kwargs((7, 3))
    assert (kwargs["max_tokens"], kwargs["allowed_token_ids"], kwargs["logprobs"]) == (1, [7, 3], 2)
    assert kwargs["temperature"] == 1.0
    entry = {7: types.SimpleNamespace(logprob=-0.2), 3: types.SimpleNamespace(logprob=-1.7)}
    assert label_logprobs_from_vllm([entry], (3, 7)) == [-1.7, -0.2]
    assert label_logprobs_from_vllm([entry], (3, 8)) is None
    assert label_logprobs_from_vllm(None, (3,)) is None


def test_adapters_honour_per_request_max_new_tokens(fake_vllm, fake_sglang):
    reqs = [Request(prompt_ids=[10], max_new_tokens=2), Request(prompt_ids=[20])]
    sampling = SamplingParams(n=2, max_new_tokens=5, ignore_eos=True)
    for engine in (VLLMEngine("/models/x"), SGLangEngine("/models/x")):
        lengths = [(c.request_index, len(c.response_ids)) for c in engine.generate(reqs, sampling)]
        assert lengths == [(0, 2), (0, 2), (1, 5), (1, 5)], type(engine).__name__
        with pytest.raises(ValueError, match=r"requests\[0\]\.max_new_tokens=0"):
            engine.generate([Request(prompt_ids=[1], max_new_tokens=0)], sampling)


def test_sglang_engine_bridges_context_stop_tokens_and_seeds(fake_sglang):
    engine = SGLangEngine("/models/x", config=SGLangConfig(context_length=16))
    inner = engine._engine
    assert inner.kwargs["context_length"] == 16 and engine.max_seq_len == 14
    assert inner.kwargs["enable_deterministic_inference"] is True
    assert inner.kwargs["enable_weights_cpu_backup"] is True
    # A prompt of 10 and 50 new tokens: capped at the context, not refused.
    out = engine.generate([Request(prompt_ids=[1] * 10)], SamplingParams(max_new_tokens=50))
    assert len(out[0].response_ids) == 4 and out[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"at most 10 \(its context_length - 6\)"):
        engine.generate([Request(prompt_ids=[1] * 11)], SamplingParams(max_new_tokens=1))
    assert inner.seen_params[-1]["sampling_seed"] is not None
    # ignore_eos makes SGLang skip stop tokens; the adapter cuts after the first one.
    sampling = SamplingParams(max_new_tokens=5, ignore_eos=True, stop_token_ids=(2,))
    out = engine.generate([Request(prompt_ids=[1])], sampling)
    assert out[0].response_ids == [0, 1, 2] and out[0].logprobs == [-1.0] * 3
    assert out[0].finish_reason == "stop"
    engine.close()
    fast = SGLangEngine("/models/x", config=SGLangConfig(seed_each_sample=False))
    assert fast._engine.kwargs["enable_deterministic_inference"] is False
    fast.generate([Request(prompt_ids=[1])], SamplingParams(max_new_tokens=2, seed=3))
    assert "sampling_seed" not in fast._engine.seen_params[-1]
    fast.close()


def test_vllm_engine_without_per_sample_seeds(fake_vllm):
    engine = VLLMEngine("/models/x", config=VLLMConfig(seed_each_sample=False))
    seen = []
    original = engine._llm.llm_engine.add_request
    engine._llm.llm_engine.add_request = lambda rid, p, params: (
        seen.append(params.seed),
        original(rid, p, params),
    )
    engine.generate([Request(prompt_ids=[5])], SamplingParams(n=2, max_new_tokens=2, seed=4))
    assert seen == [None, None]


def test_engine_checks_run_before_the_engine_starts(fake_vllm, fake_sglang, tmp_path, monkeypatch):
    from yatt.rollout._engine_deps import require_engine

    fake_vllm.__version__ = "0.27.1"
    with pytest.raises(ImportError, match=r"tested with vllm 0\.26\.0.*yatt-rollout\[vllm\]"):
        VLLMEngine("/models/x")
    monkeypatch.setenv("YATT_ALLOW_UNTESTED_ENGINE", "1")
    assert require_engine("vllm", "/models/x") is fake_vllm
    monkeypatch.setitem(sys.modules, "sglang", None)  # not installed
    with pytest.raises(ImportError, match=r"pip install 'yatt-rollout\[sglang\]'"):
        SGLangEngine("/models/x")
    fake_vllm.ModelRegistry = types.SimpleNamespace(
        get_supported_archs=lambda: {"Qwen2ForCausalLM"}
    )
    (tmp_path / "config.json").write_text('{"architectures": ["MambaForCausalLM"]}')
    with pytest.raises(ValueError, match="cannot serve architecture"):
        VLLMEngine(tmp_path)


def test_adapters_refuse_a_lora_adapter_sync_by_name(fake_vllm, fake_sglang):
    """An engine built without enable_lora serves no adapter: an adapter-only sync is refused
    before anything loads (test_engine_lora.py: the engines built with it)."""
    pairs = [
        ("model.layers.0.self_attn.q_proj.lora_A", torch.zeros(4, 8)),
        ("model.layers.0.self_attn.q_proj.lora_B", torch.zeros(8, 4)),
        ("model.layers.0.self_attn.q_proj.lora_scaling", torch.tensor(2.0)),
    ]
    vllm_engine = VLLMEngine("/models/x")
    with pytest.raises(ValueError, match=r"q_proj\.lora_A' is a LoRA adapter tensor; the vLLM"):
        vllm_engine.update_weights(pairs)
    assert not [c for c in vllm_engine._llm.calls if c[0] == "yatt_load_weights"]
    vllm_engine.close()
    sglang_engine = SGLangEngine("/models/x")
    with pytest.raises(ValueError, match=r"LoRA adapter tensor; the SGLang engine"):
        sglang_engine.update_weights(pairs)
    assert not [c for c in sglang_engine._engine.calls if c[0] == "update"]
    sglang_engine.close()
    # A bucket holding only a module trained whole beside the adapter (modules_to_save)
    head = [("lm_head.weight.lora_saved", torch.zeros(8, 4))]
    for engine in (VLLMEngine("/models/x"), SGLangEngine("/models/x")):
        with pytest.raises(ValueError, match=r"lm_head\.weight\.lora_saved' is a LoRA adapter"):
            engine.update_weights(head)
        engine.close()
