"""The vLLM and SGLang adapters against fakes of the engines' public APIs (no GPU, no install)."""

NUM_GPUS = 0

import asyncio
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

from yatt.rollout import Request, SamplingParams, SGLangEngine, VLLMConfig, VLLMEngine
from yatt.rollout._sglang import completion_from_sglang, sglang_memory_tags, sglang_sampling_params
from yatt.rollout._vllm import finish_reason_of, sampled_logprobs, vllm_prompt, vllm_sampling_kwargs

# -- vLLM -------------------------------------------------------------------------------------


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Sample:
    token_ids: list
    logprobs: list
    finish_reason: str | None


@dataclass
class _Output:
    request_id: str
    outputs: list
    finished: bool


@dataclass
class _FakeVLLMEngine:
    """LLMEngine: each step emits one token (id = step + prompt[0]) per request, as a DELTA."""

    requests: dict = field(default_factory=dict)
    aborted: list = field(default_factory=list)

    def add_request(self, rid, prompt, params):
        self.requests[rid] = {"prompt": prompt, "params": params, "n": 0}

    def step(self):
        out = []
        for rid, r in list(self.requests.items()):
            token = r["prompt"]["prompt_token_ids"][0] + r["n"]
            r["n"] += 1
            stop = token in r["params"].stop_token_ids
            done = stop or r["n"] >= r["params"].max_tokens
            reason = ("stop" if stop else "length") if done else None
            lp = [{token: _Logprob(-0.5 - r["n"])}]
            out.append(_Output(rid, [_Sample([token], lp, reason)], done))
            if done:
                del self.requests[rid]
        return out

    def abort_request(self, rids):
        self.aborted += rids
        for rid in rids:
            self.requests.pop(rid, None)


class _FakeLLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.llm_engine = _FakeVLLMEngine()
        self.llm_engine.model_config = types.SimpleNamespace(
            max_model_len=64, get_vocab_size=lambda: 100, is_multimodal_model=False
        )
        self.calls = []

    def get_tokenizer(self):
        return "tok"

    def collective_rpc(self, method, args=()):
        self.calls.append((method, [n for n, _ in args[0]]))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tags))


class _FakeVLLMSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = _FakeLLM
    module.SamplingParams = _FakeVLLMSamplingParams
    module.sampling_params = types.SimpleNamespace(
        RequestOutputKind=types.SimpleNamespace(DELTA="delta")
    )
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return module


def test_vllm_sampling_translation():
    sampling = SamplingParams(
        n=4,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        max_new_tokens=9,
        stop_token_ids=(3,),
        ignore_eos=True,
    )
    kw = vllm_sampling_kwargs(sampling, sample_seed=11)
    assert kw["n"] == 1 and kw["seed"] == 11 and kw["max_tokens"] == 9
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.7, 0.9, 5)
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


class _FakeTokenizerManager:
    def __init__(self):
        self.tokenizer = "tok"
        self.context_len = 32
        self.model_config = types.SimpleNamespace(vocab_size=100, is_multimodal=False)
        self.aborted = []

    def abort_request(self, rid="", abort_all=False):
        self.aborted.append(abort_all)


class _FakeSGLEngine:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.tokenizer_manager = _FakeTokenizerManager()
        self.loop = asyncio.new_event_loop()
        self.calls = []

    async def async_generate(self, input_ids, sampling_params, image_data, return_logprob):
        await asyncio.sleep(0.001 * input_ids[0])
        n = sampling_params["max_new_tokens"]
        return {
            "output_ids": list(range(n)),
            "meta_info": {
                "output_token_logprobs": [(-1.0, t, None) for t in range(n)],
                "finish_reason": {"type": "length"},
            },
        }

    def update_weights_from_tensor(self, named_tensors, flush_cache):
        self.calls.append(("update", [n for n, _ in named_tensors], flush_cache))

    def flush_cache(self):
        self.calls.append(("flush",))

    def release_memory_occupation(self):
        self.calls.append(("release",))

    def resume_memory_occupation(self, tags):
        self.calls.append(("resume", tags))

    def shutdown(self):
        self.loop.close()


@pytest.fixture
def fake_sglang(monkeypatch):
    module = types.ModuleType("sglang")
    module.Engine = _FakeSGLEngine
    srt = types.ModuleType("sglang.srt")
    srt.constants = types.SimpleNamespace(GPU_MEMORY_TYPE_CUDA_GRAPH="cuda_graph")
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setitem(sys.modules, "sglang.srt", srt)
    return module


def test_sglang_engine_maps_calls(fake_sglang):
    engine = SGLangEngine("/models/x")
    inner = engine._engine
    assert inner.kwargs["enable_memory_saver"] is True and inner.kwargs["model_path"] == "/models/x"
    reqs = [Request(prompt_ids=[9]), Request(prompt_ids=[1])]
    out = engine.generate(reqs, SamplingParams(n=2, max_new_tokens=3))
    assert [(c.request_index, c.sample_index) for c in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(c.response_ids == [0, 1, 2] and c.logprobs == [-1.0] * 3 for c in out)
    streamed = asyncio.run(_collect(engine.stream(reqs, SamplingParams(max_new_tokens=2))))
    assert [c.request_index for c in streamed] == [1, 0]  # in finishing order
    engine.update_weights([(f"w{i}", torch.zeros(2)) for i in range(3)], bucket_bytes=16)
    engine.sleep()
    engine.wake_up(tags=["weights"])
    engine.wake_up(tags=["kv_cache"])
    assert inner.calls == [
        ("update", ["w0", "w1"], False),
        ("update", ["w2"], False),
        ("flush",),
        ("release",),
        ("resume", ["weights"]),
        ("resume", ["kv_cache", "cuda_graph"]),
    ]
    engine.close()


def test_adapters_honour_per_request_max_new_tokens(fake_vllm, fake_sglang):
    reqs = [Request(prompt_ids=[10], max_new_tokens=2), Request(prompt_ids=[20])]
    sampling = SamplingParams(n=2, max_new_tokens=5, ignore_eos=True)
    for engine in (VLLMEngine("/models/x"), SGLangEngine("/models/x")):
        lengths = [(c.request_index, len(c.response_ids)) for c in engine.generate(reqs, sampling)]
        assert lengths == [(0, 2), (0, 2), (1, 5), (1, 5)], type(engine).__name__
        with pytest.raises(ValueError, match=r"requests\[0\]\.max_new_tokens=0"):
            engine.generate([Request(prompt_ids=[1], max_new_tokens=0)], sampling)
