"""min_p and repetition_penalty on the engine's CUDA fast path: the decode step captured in
CUDA graphs and compiled (inductor), against the eager path, against transformers' own
generate, and the sampler on the GPU against the definitions (skipped on CPU machines)."""

NUM_GPUS = 1

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams
from yatt.rollout._keys import derive_key
from yatt.rollout.builtin import sample_tokens

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# 1-3 prompt tokens + 90 new ones cross the 64-position span bucket: two graphs per mode.
REQUESTS = [Request(prompt_ids=[5 + i, 6, 7, 5 + i][: 1 + i % 4]) for i in range(6)]
KNOBS = {
    "min_p": dict(min_p=0.1),
    "penalty": dict(repetition_penalty=1.3),
    "both": dict(min_p=0.05, repetition_penalty=1.2, top_k=50),
}
CALLS = [
    dict(n=2, temperature=0.9, max_new_tokens=90, seed=3),
    dict(temperature=0.0, max_new_tokens=90),
]


def _generate(tiny_model_dir, prefix, knobs, **config):
    config = EngineConfig(
        device="cuda", max_batch_size=4, max_seq_len=256, region_prefix=prefix, **config
    )
    engine = BuiltinEngine(tiny_model_dir, config=config)
    try:
        out = [
            c
            for call in CALLS
            for c in engine.generate(REQUESTS, SamplingParams(ignore_eos=True, **call, **knobs))
        ]
        runner = engine._runner
        # read before close(): closing releases the graphs
        return out, SimpleNamespace(
            graph_keys=set(runner._graphs), compiled_step=runner._compiled_step
        )
    finally:
        engine.close()


def _assert_same(got, expected, atol):
    assert [c.response_ids for c in got] == [c.response_ids for c in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0
        )


@pytest.mark.parametrize("knobs", list(KNOBS.values()), ids=list(KNOBS))
def test_graphs_and_compiled_step_match_eager(tiny_model_dir, knobs):
    eager, _ = _generate(tiny_model_dir, "eager", knobs, use_cuda_graph=False, compile_decode=False)
    graphs, runner = _generate(tiny_model_dir, "graphs", knobs, compile_decode=False)
    # The penalized mode is its own graph (its flag is part of the key).
    is_penalized = knobs.get("repetition_penalty", 1.0) != 1.0
    assert {key[2] for key in runner.graph_keys} == {is_penalized}
    _assert_same(graphs, eager, atol=1e-4)
    compiled, runner = _generate(tiny_model_dir, "compiled", knobs)
    assert runner.compiled_step is not None, "compiling fell back to eager"
    _assert_same(compiled, eager, atol=1e-3)  # inductor's fused kernels round differently


def test_penalized_samples_do_not_depend_on_batch_buckets(tiny_model_dir):
    knobs = KNOBS["both"]
    every_slot, _ = _generate(tiny_model_dir, "every", knobs, decode_batch_buckets=())
    bucketed, _ = _generate(tiny_model_dir, "buckets", knobs, decode_batch_buckets=(1, 2))
    _assert_same(bucketed, every_slot, atol=1e-4)


def test_greedy_repetition_penalty_matches_transformers_generate_on_cuda(tiny_model_dir):
    config = EngineConfig(
        device="cuda", max_batch_size=4, max_seq_len=256, region_prefix="hf", dtype="float32"
    )
    engine = BuiltinEngine(tiny_model_dir, config=config)
    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=24, repetition_penalty=1.3, ignore_eos=True
    )
    got = engine.generate(REQUESTS, sampling)
    engine.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval().cuda()
    for completion, request in zip(got, REQUESTS, strict=True):
        prompt = torch.tensor([request.prompt_ids], device="cuda")
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                repetition_penalty=1.3,
                max_new_tokens=24,
                min_new_tokens=24,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert completion.response_ids == out[0, prompt.shape[1] :].tolist()


def test_sampler_on_the_gpu_follows_the_definitions():
    # The CPU tests' hand-built logits: a penalty of 1.5 on tokens 0 and 4 gives logits 2/1.5
    # and -1*1.5, then min-p 0.2; logprobs stay the model's own.
    logits_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], device="cuda")
    S = 20000
    seen_V = torch.zeros(6, dtype=torch.bool, device="cuda")
    seen_V[[0, 4]] = True
    token_S, logprob_S = sample_tokens(
        logits_V.expand(S, -1),
        temperature_S=torch.ones(S, device="cuda"),
        top_p_S=torch.ones(S, device="cuda"),
        top_k_S=torch.zeros(S, dtype=torch.long, device="cuda"),
        key_S=torch.tensor([derive_key(0, i, 0) for i in range(S)], device="cuda"),
        counter_S=torch.zeros(S, dtype=torch.long, device="cuda"),
        is_greedy=False,
        is_truncated=True,
        min_p_S=torch.full((S,), 0.2, device="cuda"),
        repetition_penalty_S=torch.full((S,), 1.5, device="cuda"),
        seen_SV=seen_V.expand(S, -1),
    )
    penalized = torch.tensor([2.0 / 1.5, 1.0, 0.5, 0.0, -1.5, -3.0])
    probs = torch.softmax(penalized, -1)
    # min-p on the penalized distribution: ratios to its top token (0, at 1.33) are
    # exp(l - 1.33) = 1, .72, .43, .26, .06, .01, so tokens 0..3 are kept.
    kept = [0, 1, 2, 3]
    expected = torch.zeros(6)
    expected[kept] = probs[kept] / probs[kept].sum()
    freq = torch.bincount(token_S.cpu(), minlength=6).float() / S
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    torch.testing.assert_close(
        logprob_S.cpu(), torch.log_softmax(logits_V.cpu(), -1)[token_S.cpu()]
    )
