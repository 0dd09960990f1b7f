"""Images through one RL step on the CPU: the built-in engine generates on a tiny Qwen2-VL, the
policy recomputes the sampler's logprobs from the same images (the same processed pixels: they
travel with the request), trains, and pushes its weights (the vision tower's included) back into
the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from yatt.core import (
    PolicyLoss,
    TorchPolicy,
    TorchPolicyConfig,
    compute_grpo_advantages,
    encode_vision_prompt,
    load_image_processor,
    rollout_batch,
    rollout_samples,
)
from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

NUM_GPUS = 0


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from yatt.testing import make_tiny_vlm

    path = tmp_path_factory.mktemp("qwen2_vl")
    make_tiny_vlm(path, arch="qwen2_vl")
    return str(path)


ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
def test_engine_samples_train_the_policy_and_weights_return(vlm_dir, device):
    from transformers import AutoTokenizer

    # The policy takes the GPU when there is one: then engine and policy kernels differ.
    atol = 1e-4 if torch.cuda.is_available() else 1e-5

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    image_processor = load_image_processor(vlm_dir)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rng = np.random.default_rng(0)
    requests, visions = [], []
    for i, num_images in enumerate((1, 0, 2)):
        images = [
            rng.integers(0, 256, (16, 16 + 8 * k, 3), dtype=np.uint8) for k in range(num_images)
        ]
        content = [{"type": "image"}] * num_images + [{"type": "text", "text": f"how many? {i}"}]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        vision = None
        if images:
            ids, vision = encode_vision_prompt(
                ids, images, image_processor=image_processor, image_token_id=image_id
            )
        # As the trainer sends them: the processed pixels too, so the engine does not redo them.
        requests.append(Request(prompt_ids=ids, images=images or None, image_inputs=vision))
        visions.append(vision)
    engine = BuiltinEngine(
        vlm_dir, config=EngineConfig(device=device, dtype="float32", max_seq_len=128)
    )
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    completions = engine.generate(requests, sampling)
    rewards = [float(len(c.response_ids) % 2) + 0.1 * c.sample_index for c in completions]
    samples = rollout_samples(
        completions,
        rewards,
        [c.request_index for c in completions],
        vision_inputs=[visions[c.request_index] for c in completions],
    )
    batch = rollout_batch(samples)
    batch.samples["advantages"] = compute_grpo_advantages(batch["reward"], batch["group_id"])
    policy = TorchPolicy(
        TorchPolicyConfig(
            model_dir=vlm_dir, parallel="none", dtype="float32", lr=1e-2, should_train_vision=True
        )
    )
    old = policy.logprobs(batch)
    # The trainer sees the sampler's numbers: same weights, same images, same positions.
    on_response = batch["loss_mask"].bool()
    torch.testing.assert_close(
        old.cpu()[on_response], batch["rollout_logprobs"][on_response], atol=atol, rtol=0
    )
    batch.tokens["old_logprobs"] = old
    metrics = policy.train_step(batch, PolicyLoss())
    assert metrics["is_skipped"] == 0.0 and metrics["grad_norm"] > 0
    engine.update_weights(policy.named_weights())
    served = dict(engine.model.named_parameters())
    trained = dict(policy.named_weights())
    assert set(trained) <= set(served)
    for name, tensor in trained.items():
        assert torch.equal(served[name].cpu(), tensor.cpu()), name
    # After the sync the engine's logprobs are the trained policy's again.
    again = engine.generate(requests, sampling)
    resampled = rollout_batch(
        rollout_samples(
            again,
            [0.0] * len(again),
            [c.request_index for c in again],
            vision_inputs=[visions[c.request_index] for c in again],
        )
    )
    new = policy.logprobs(resampled)
    mask = resampled["loss_mask"].bool()
    torch.testing.assert_close(
        new.cpu()[mask], resampled["rollout_logprobs"][mask], atol=atol, rtol=0
    )
