NUM_GPUS = 0

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.rollout import BuiltinEngine, EngineConfig
from yatt.rollout.testing import CONFORMANCE_CHECKS, ConformanceTarget
from yatt.testing import make_tiny_causal_lm


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    engine = BuiltinEngine(tiny_model_dir, config=EngineConfig(max_batch_size=4, max_seq_len=256))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    original = {n: t.clone() for n, t in reference.state_dict().items()}
    other = make_tiny_causal_lm(arch="qwen2", seed=1, max_position_embeddings=512)

    def reference_logprobs(prompt, response, temperature):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + response])).logits[0].float()
        logits = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()

    yield ConformanceTarget(
        engine=engine,
        vocab_size=reference.config.vocab_size,
        max_seq_len=256,
        new_weights=lambda: other.named_parameters(),
        original_weights=lambda: original.items(),
        reference_logprobs=reference_logprobs,
        abort_num_requests=8,
    )
    engine.close()


@pytest.mark.parametrize("name", list(CONFORMANCE_CHECKS))
def test_builtin_engine_conforms(target, name):
    CONFORMANCE_CHECKS[name](target)
