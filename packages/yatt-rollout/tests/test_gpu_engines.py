"""The vLLM and SGLang adapters on the real engines, on one GPU (skipped without CUDA or the engine).

Verified with vLLM 0.26.0 and SGLang 0.5.17 on torch 2.11.0+cu130. Run one engine per process
(each brings its own dependency set): `YATT_ENGINE=vllm pytest tests/test_gpu_engines.py`.
The model is Qwen2-shaped (random weights, bf16, saved with `save_pretrained`), big enough for
the engines' fused kernels (head_dim 64) and small enough to start in seconds.
"""

NUM_GPUS = 1

import importlib.util
import os

import pytest
import torch

from yatt.rollout import Request, SamplingParams
from yatt.rollout.testing import CONFORMANCE_CHECKS, ConformanceTarget

ENGINE = os.environ.get("YATT_ENGINE", "vllm")
MAX_SEQ_LEN = 256
QWEN2_SHAPE = dict(
    arch="qwen2",
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=512,
    max_position_embeddings=MAX_SEQ_LEN,
    dtype=torch.bfloat16,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec(ENGINE) is None, reason=f"{ENGINE} is not installed"
    ),
]


def used_bytes() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def build_engine(model_dir):
    if ENGINE == "vllm":
        from yatt.rollout import VLLMConfig, VLLMEngine

        config = VLLMConfig(gpu_memory_utilization=0.25, max_model_len=MAX_SEQ_LEN)
        return VLLMEngine(model_dir, config=config)
    from yatt.rollout import SGLangConfig, SGLangEngine

    # FA3 (sgl_kernel's flash_ops) was not carried to the test machine: Triton attention.
    config = SGLangConfig(
        mem_fraction_static=0.25,
        context_length=MAX_SEQ_LEN,
        engine_kwargs={"attention_backend": os.environ.get("YATT_SGLANG_ATTENTION", "triton")},
    )
    return SGLangEngine(model_dir, config=config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from yatt.testing import make_tiny_causal_lm

    path = tmp_path_factory.mktemp(f"qwen2-{ENGINE}")
    make_tiny_causal_lm(path, **QWEN2_SHAPE)
    return path


@pytest.fixture(scope="module")
def target(model_dir):
    from transformers import AutoModelForCausalLM

    from yatt.testing import make_tiny_causal_lm

    before = used_bytes()
    engine = build_engine(model_dir)
    engine_bytes = used_bytes() - before
    # The trainer's side: the same weights in bf16 on the GPU, and a second set to swap in.
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    pinned = {n: t.detach().cpu().pin_memory() for n, t in reference.state_dict().items()}
    other = make_tiny_causal_lm(**QWEN2_SHAPE, seed=1).cuda()

    def reference_logprobs(prompt, response, temperature):
        with torch.no_grad():
            ids = torch.tensor([prompt + response], device="cuda")
            logits = reference(ids).logits[0].float()
        logits = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
        index = torch.tensor(response, device="cuda")[:, None]
        return torch.log_softmax(logits, -1).gather(-1, index)[:, 0].tolist()

    target = ConformanceTarget(
        engine=engine,
        vocab_size=reference.config.vocab_size,
        max_seq_len=engine.max_seq_len,  # SGLang serves one position less than its context
        # GPU tensors of a trainer's model, then pinned CPU tensors to restore the original.
        new_weights=lambda: other.named_parameters(),
        original_weights=lambda: pinned.items(),
        reference_logprobs=reference_logprobs,
        logprob_atol=0.25,  # worst token in bf16; the mean is checked below at 0.01
    )
    target.engine_bytes = engine_bytes
    yield target
    engine.close()


@pytest.mark.parametrize("name", list(CONFORMANCE_CHECKS))
def test_engine_conforms(target, name):
    CONFORMANCE_CHECKS[name](target)


def test_sleep_frees_memory_and_wake_is_bit_identical(target):
    engine = target.engine
    requests = [Request(prompt_ids=p) for p in target.prompts]
    sampling = SamplingParams(n=2, max_new_tokens=24, seed=9, ignore_eos=True)
    before = engine.generate(requests, sampling)
    awake = used_bytes()
    engine.sleep()
    asleep = used_bytes()
    engine.wake_up(tags=("weights",))
    engine.wake_up(tags=("kv_cache",))
    after = engine.generate(requests, sampling)
    freed = awake - asleep
    assert freed >= 0.9 * target.engine_bytes, (
        f"sleep freed {freed / 2**20:.0f} MiB of the engine's {target.engine_bytes / 2**20:.0f} MiB"
    )
    assert [c.response_ids for c in after] == [c.response_ids for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in before], "logprobs not bit-identical"


def test_logprobs_match_the_trainer_after_update_from_gpu_and_pinned_cpu(target):
    """After a bucketed update, the engine's logprobs are the trainer's (mean |diff| <= 0.01)."""
    engine = target.engine
    requests = [Request(prompt_ids=p) for p in target.prompts]
    sampling = SamplingParams(n=4, max_new_tokens=32, seed=21, temperature=1.0, ignore_eos=True)
    for weights in (target.new_weights, target.original_weights):
        engine.update_weights(weights(), bucket_bytes=1 << 16)
        if weights is target.new_weights:
            continue  # the reference model holds the original weights only
        diffs = []
        for c in engine.generate(requests, sampling):
            ref = target.reference_logprobs(c.prompt_ids, c.response_ids, 1.0)
            diffs += [abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)]
        mean = sum(diffs) / len(diffs)
        assert mean <= 0.01, f"mean |engine - trainer| logprob = {mean:.4f} over {len(diffs)}"


# -- LoRA: an adapter synced alone vs the merged weights synced in full ------------------------

LORA_RANK, LORA_SCALING = 8, 2.0
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_engine(model_dir, adapter_dir):
    if ENGINE == "vllm":
        from yatt.rollout import VLLMConfig, VLLMEngine

        config = VLLMConfig(
            gpu_memory_utilization=0.2,
            max_model_len=MAX_SEQ_LEN,
            enable_lora=True,
            max_lora_rank=LORA_RANK,
            lora_adapter_dir=str(adapter_dir),
        )
        return VLLMEngine(model_dir, config=config)
    from yatt.rollout import SGLangConfig, SGLangEngine

    config = SGLangConfig(
        mem_fraction_static=0.2,
        context_length=MAX_SEQ_LEN,
        enable_lora=True,
        max_lora_rank=LORA_RANK,
        engine_kwargs={"attention_backend": os.environ.get("YATT_SGLANG_ATTENTION", "triton")},
    )
    return SGLangEngine(model_dir, config=config)


def lora_adapter(model, seed):
    """yatt.core's wire format, hand-built on every targeted linear layer (float32)."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LORA_TARGETS:
            a = torch.randn(LORA_RANK, module.in_features, generator=generator) * 0.05
            b = torch.randn(module.out_features, LORA_RANK, generator=generator) * 0.05
            pairs += [
                (f"{name}.lora_A", a.cuda()),
                (f"{name}.lora_B", b.cuda()),
                (f"{name}.lora_scaling", torch.tensor(LORA_SCALING)),
            ]
    return pairs


def merged_weights(model, pairs):
    """The model's full weights with W + scaling B A on each adapted layer (bf16, as served)."""
    by_name = dict(pairs)
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        if f"{module}.lora_A" in by_name:
            delta = by_name[f"{module}.lora_B"].float() @ by_name[f"{module}.lora_A"].float()
            tensor = (tensor.float() + LORA_SCALING * delta).to(tensor.dtype)
        yield name, tensor


def test_lora_adapter_sync_matches_the_merged_weights(model_dir, tmp_path):
    """The adapter synced alone (requests with it) gives the greedy tokens and logprobs of the
    merged weights synced in full (requests without it); a second sync replaces the first."""
    from transformers import AutoModelForCausalLM

    engine = build_lora_engine(model_dir, tmp_path)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    original = [(n, t.detach().clone()) for n, t in base.state_dict().items()]
    prompts = [[(7 * i + 3 * k) % 90 + 1 for k in range(12)] for i in range(8)]
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    on = [Request(prompt_ids=p) for p in prompts]
    off = [Request(prompt_ids=p, use_adapter=False) for p in prompts]
    try:
        plain = engine.generate(off, sampling)
        outputs = []
        for seed in (1, 2):
            pairs = lora_adapter(base, seed)
            engine.update_weights(pairs)
            with_adapter = engine.generate(on, sampling)
            engine.update_weights(merged_weights(base, pairs))
            merged = engine.generate(off, sampling)
            engine.update_weights(original)  # the base again, under the adapter
            same = sum(
                a.response_ids == m.response_ids for a, m in zip(with_adapter, merged, strict=True)
            )
            assert same >= 6, f"adapter vs merged: {same} of 8 greedy responses agree"
            diffs = [
                abs(x - y)
                for a, m in zip(with_adapter, merged, strict=True)
                if a.response_ids == m.response_ids
                for x, y in zip(a.logprobs, m.logprobs, strict=True)
            ]
            assert sum(diffs) / len(diffs) <= 0.02, f"mean |logprob diff| {sum(diffs) / len(diffs)}"
            outputs.append([c.response_ids for c in with_adapter])
        assert outputs[0] != outputs[1], "the second adapter did not replace the first"
        assert [c.response_ids for c in plain] != outputs[1], "the adapter changed nothing"
        assert [c.response_ids for c in engine.generate(off, sampling)] == [
            c.response_ids for c in plain
        ]
    finally:
        engine.close()
