NUM_GPUS = 0

# SamplingParams.label_token_ids: the logprobs of chosen ids at the first response position,
# checked against an independent forward pass (Hugging Face, log_softmax of the last prompt
# position's logits).

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [13], [40, 41, 42, 43], [50, 51]]
LABELS = (3, 17, 250, 99)


def _next_token_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    return torch.log_softmax(logits, -1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # Fewer slots than samples: slots are refilled, so a stale row would show.
    engine = BuiltinEngine(
        tiny_model_dir, config=EngineConfig(max_batch_size=3, max_seq_len=64, region_prefix="lab")
    )
    yield engine
    engine.close()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_label_logprobs_match_a_forward_pass(engine, tiny_model_dir, temperature) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sampling = SamplingParams(
        n=2, temperature=temperature, max_new_tokens=4, seed=1, label_token_ids=LABELS
    )
    completions = engine.generate([Request(prompt_ids=p) for p in PROMPTS], sampling)
    assert len(completions) == 2 * len(PROMPTS)
    for c in completions:
        expected = _next_token_logprobs(model, c.prompt_ids)[list(LABELS)]
        # The model's own distribution: the sampling temperature does not scale it.
        torch.testing.assert_close(torch.tensor(c.label_logprobs), expected, atol=1e-4, rtol=0)
        if temperature == 0:
            # Greedy: the first token is the argmax of that same distribution.
            full = _next_token_logprobs(model, c.prompt_ids)
            assert c.response_ids[0] == int(full.argmax())
            assert c.logprobs[0] == pytest.approx(float(full.max()), abs=1e-4)


def test_each_call_gets_its_own_labels_and_none_when_not_asked(engine, tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    requests = [Request(prompt_ids=p) for p in PROMPTS]
    plain = engine.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=2))
    assert all(c.label_logprobs is None for c in plain)
    two = engine.generate(
        requests, SamplingParams(temperature=0.0, max_new_tokens=2, label_token_ids=(250, 3))
    )
    for c in two:
        expected = _next_token_logprobs(model, c.prompt_ids)[[250, 3]]
        torch.testing.assert_close(torch.tensor(c.label_logprobs), expected, atol=1e-4, rtol=0)


def test_engine_says_it_supports_label_logprobs(engine) -> None:
    assert engine.supports_label_logprobs is True


@pytest.mark.parametrize(
    "labels", [(-1,), (1, 1), (True,), (1.5,)], ids=["negative", "duplicate", "bool", "float"]
)
def test_bad_label_ids_fail_at_construction(labels) -> None:
    with pytest.raises(ValueError, match="label_token_ids"):
        SamplingParams(label_token_ids=labels)


def test_the_builtin_engine_refuses_ids_outside_the_vocabulary(engine) -> None:
    with pytest.raises(ValueError, match="label_token_ids"):
        engine.generate(
            [Request(prompt_ids=[1, 2])], SamplingParams(label_token_ids=(engine.vocab_size,))
        )
    with pytest.raises(ValueError, match="at most 16"):
        engine.generate([Request(prompt_ids=[1, 2])], SamplingParams(label_token_ids=range(17)))
