"""min_p and repetition_penalty in the built-in engine, against their definitions and against
Hugging Face's own logits processors (transformers' generate), on CPU."""

NUM_GPUS = 0

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

PROMPTS = [[5, 6, 7, 5, 6], [8, 9, 10, 11, 12], [13], [40, 41, 40, 41]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = EngineConfig(max_batch_size=4, max_seq_len=128, region_prefix="knobs")
    engine = BuiltinEngine(tiny_model_dir, config=config)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _generate(engine, **sampling):
    requests = [Request(prompt_ids=list(p)) for p in PROMPTS]
    return engine.generate(requests, SamplingParams(ignore_eos=True, **sampling))


def _forward_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("penalty", [1.3, 0.7], ids=["discourage", "encourage"])
def test_greedy_with_repetition_penalty_matches_transformers_generate(engine, model, penalty):
    # transformers' RepetitionPenaltyLogitsProcessor penalizes every token of input_ids, the
    # prompt included (vLLM documents the same): an independent implementation of the rule.
    got = _generate(engine, temperature=0.0, max_new_tokens=12, repetition_penalty=penalty)
    for completion, prompt in zip(got, PROMPTS, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                repetition_penalty=penalty,
                max_new_tokens=12,
                min_new_tokens=12,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert completion.response_ids == out[0, len(prompt) :].tolist()
    plain = _generate(engine, temperature=0.0, max_new_tokens=12)
    assert [c.response_ids for c in got] != [c.response_ids for c in plain], (
        "the penalty changed no greedy response: the test shows nothing"
    )


def test_repetition_penalty_logprobs_are_the_models_own(engine, model):
    # The documented convention: log softmax(logits / T) before the penalty, as top-p/top-k.
    got = _generate(engine, temperature=0.8, n=2, max_new_tokens=10, seed=3, repetition_penalty=1.5)
    for c in got:
        logits = _forward_logits(model, c.prompt_ids + c.response_ids)
        logits = logits[len(c.prompt_ids) - 1 : -1] / 0.8
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.response_ids)[:, None])
        torch.testing.assert_close(torch.tensor(c.logprobs), expected[:, 0], atol=1e-4, rtol=0)


def test_min_p_samples_only_tokens_within_the_ratio(engine, model):
    # min_p 0.6 at T = 1: every sampled token has p >= 0.6 p_max at its position, by the
    # definition, checked against the model's own forward pass.
    got = _generate(engine, temperature=1.0, n=4, max_new_tokens=10, seed=5, min_p=0.6)
    for c in got:
        probs = torch.softmax(_forward_logits(model, c.prompt_ids + c.response_ids), -1)
        probs = probs[len(c.prompt_ids) - 1 : -1]
        chosen = probs.gather(-1, torch.tensor(c.response_ids)[:, None])[:, 0]
        # 1e-4: float32 logits of the engine's cached forward vs the full forward.
        assert bool((chosen >= 0.6 * probs.max(-1).values - 1e-4).all())


@pytest.mark.parametrize(
    "knob", [{"min_p": 0.3}, {"repetition_penalty": 2.0}], ids=["min_p", "repetition_penalty"]
)
def test_each_knob_changes_seeded_sampling(engine, knob):
    base = dict(temperature=1.0, n=4, max_new_tokens=16, seed=11)
    plain = [c.response_ids for c in _generate(engine, **base)]
    assert [c.response_ids for c in _generate(engine, **base)] == plain  # seeded: reproducible
    turned = [c.response_ids for c in _generate(engine, **base, **knob)]
    assert turned != plain
    assert [c.response_ids for c in _generate(engine, **base, **knob)] == turned


def test_a_strong_penalty_prevents_repeating_positive_logit_tokens(engine, model):
    # Penalty 1e3 (greedy): a seen token's positive logit falls near 0 and a negative one far
    # below, so the argmax is a seen token only when no unseen token has a positive logit.
    got = _generate(engine, temperature=0.0, max_new_tokens=10, repetition_penalty=1e3)
    for c in got:
        ids = c.prompt_ids + c.response_ids
        logits = _forward_logits(model, ids)
        for step, token in enumerate(c.response_ids):
            seen = set(ids[: len(c.prompt_ids) + step])
            if token in seen:
                row = logits[len(c.prompt_ids) - 1 + step].clone()
                row[list(seen)] = float("-inf")
                assert float(row.max()) <= 0.0


def test_compiled_decode_step_with_both_knobs_matches_eager(tiny_model_dir):
    # torch.compile (inductor; C++ on CPU) of the whole step, the penalty's scatter included:
    # what CUDA compiles and captures by default.
    from torch._dynamo.utils import counters

    sampling = SamplingParams(
        n=2, temperature=0.9, max_new_tokens=70, seed=4, min_p=0.05, repetition_penalty=1.3
    )
    requests = [Request(prompt_ids=list(p)) for p in PROMPTS]
    outputs = []
    for should_compile in (False, True):
        config = EngineConfig(
            max_batch_size=3,
            max_seq_len=128,
            region_prefix=f"knobs-compiled-{should_compile}",
            compile_decode=should_compile,
        )
        engine = BuiltinEngine(tiny_model_dir, config=config)
        counters.clear()
        outputs.append(engine.generate(requests, sampling))
        if should_compile:
            assert engine._runner._compiled_step is not None, "compiling fell back to eager"
            assert not counters["graph_break"], dict(counters["graph_break"])
        engine.close()
    eager, compiled = outputs
    assert [c.response_ids for c in compiled] == [c.response_ids for c in eager]
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )
