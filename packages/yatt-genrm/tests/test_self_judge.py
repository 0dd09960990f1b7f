"""A self-judging GenRM on the policy's engine (issue 45, item 4): the judge reads the policy's
base model through BuiltinEngine.without_adapter() (EngineConfig.lora_mode="beside"), the
same resident weights that serve the policy's adapter. Its verdicts (2 P(Yes) - 1 from the
label probabilities) equal a separate judge engine's on the base model, bit for bit."""

NUM_GPUS = 0

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.genrm import GenRM, JudgeSpec, Sample, verification_template
from yatt.rollout import BuiltinEngine, Completion, EngineConfig, SamplingParams
from yatt.testing import make_tiny_causal_lm

# The judge's text, scripted (a tiny random model writes no verdicts): the label decides where
# its probability is read; the probability is the engine's.
TEXTS = ["Yes", "No", "The answer matches.\nYes", "It does not.\nNo"]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("self-judge")
    make_tiny_causal_lm(path, arch="qwen2", seed=3, max_position_embeddings=1024)
    return path


class ScriptedJudge:
    """Writes TEXTS[i]; the label probabilities (first token and forced steps) come from
    `engine`, a real one."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.supports_label_logprobs = True

    def generate(self, requests, sampling):
        if sampling.max_new_tokens == 1 and sampling.label_token_ids:
            return self.engine.generate(requests, sampling)
        first = self.engine.generate(
            requests, SamplingParams(max_new_tokens=1, label_token_ids=sampling.label_token_ids)
        )
        out = []
        for c in first:
            ids = self.tokenizer.encode(TEXTS[c.request_index], add_special_tokens=False)
            out.append(
                Completion(
                    request_index=c.request_index,
                    sample_index=0,
                    prompt_ids=c.prompt_ids,
                    response_ids=ids,
                    logprobs=[0.0] * len(ids),
                    finish_reason="stop",
                    request_id=c.request_id,
                    label_logprobs=c.label_logprobs,
                )
            )
        return out


def _samples():
    return [Sample(prompt=f"{i}+{i}=", response=str(2 * i), reference=str(2 * i)) for i in range(4)]


def _adapter_pairs(model_dir, seed=1, rank=4, std=0.05):
    """A random LoRA adapter for every decoder linear, in the sync's wire format."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for name, module in base.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            yield name + ".lora_A", torch.randn(rank, module.in_features, generator=gen) * std
            yield name + ".lora_B", torch.randn(module.out_features, rank, generator=gen) * std
            yield name + ".lora_scaling", torch.tensor(2.0)


def _engine(model_dir, prefix, device="cpu"):
    config = EngineConfig(
        max_batch_size=8, max_seq_len=1024, region_prefix=prefix, lora_mode="beside", device=device
    )
    return BuiltinEngine(model_dir, config=config)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])], ids=["cpu", "cuda"]
)
def test_the_judge_on_the_policys_engine_gives_the_base_models_verdicts(model_dir, device):
    """On CPU bit for bit; on CUDA (graphs, compiled steps: the two engines' compiled graphs
    may fuse differently, float32 model) within 1e-4 of the reward."""
    policy_engine = _engine(model_dir, f"sj-policy-{device}", device)
    separate = _engine(model_dir, f"sj-judge-{device}", device)  # the base model, a second copy
    policy_engine.update_weights((n, t.to(device)) for n, t in _adapter_pairs(model_dir))
    template = verification_template()
    shared = GenRM(ScriptedJudge(policy_engine.without_adapter()), template=template)
    own = GenRM(ScriptedJudge(separate), template=template)
    assert shared.verdict_from == own.verdict_from == "label_logprobs"
    got, want = shared.score(_samples()), own.score(_samples())
    assert [v.status for v in got] == ["ok"] * 4
    if device == "cpu":
        assert [v.reward for v in got] == [v.reward for v in want]  # bit for bit
    else:
        for a, b in zip(got, want, strict=True):
            assert a.reward == pytest.approx(b.reward, abs=1e-4, rel=0)
    # The adapter is there for the policy's rows: judged with it on, the verdicts move.
    with_adapter = GenRM(ScriptedJudge(policy_engine), template=template).score(_samples())
    assert [v.reward for v in with_adapter] != [v.reward for v in want]
    policy_engine.close()
    separate.close()


def test_judge_dir_policy_needs_the_builtin_backend():
    assert JudgeSpec(judge_dir="policy").shares_policy
    assert not JudgeSpec(judge_dir="/models/judge").shares_policy
    with pytest.raises(ValueError, match=r"JudgeSpec\.judge_dir='policy'.*backend='vllm'"):
        JudgeSpec(judge_dir="policy", backend="vllm")
