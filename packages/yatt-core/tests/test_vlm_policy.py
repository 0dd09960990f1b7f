"""TorchPolicy on a tiny Qwen2-VL / Qwen2.5-VL: images from the prompt to the gradient."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from yatt.core import (
    VISION_INPUTS_KEY,
    PolicyLoss,
    TorchPolicy,
    VisionInputError,
    VisionInputs,
    compute_token_logprobs,
    encode_vision_prompt,
    image_patches_of,
    load_image_processor,
    rollout_batch,
    rollout_samples,
)

NUM_GPUS = 0

WORKERS = Path(__file__).with_name("_vlm_workers.py")
_spec = importlib.util.spec_from_file_location("_vlm_workers", WORKERS)
workers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workers)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(request, tmp_path_factory) -> str:
    from yatt.testing import make_tiny_vlm

    path = tmp_path_factory.mktemp(request.param)
    make_tiny_vlm(path, arch=request.param)
    return str(path)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory) -> str:
    from yatt.testing import make_tiny_vlm

    path = tmp_path_factory.mktemp("qwen2_vl_only")
    make_tiny_vlm(path, arch="qwen2_vl")
    return str(path)


def _policy(model_dir, **overrides):
    config = workers.policy_config(model_dir, "none", overrides.pop("max_tokens", 10_000))
    from dataclasses import replace

    return TorchPolicy(replace(config, **overrides))


def test_logprobs_match_the_family_forward_sample_by_sample(vlm_dir):
    """Padded micro-batches of image and text samples give what the HF model's own forward
    (its processor outputs, mrope from its state) gives for each sample alone."""
    from transformers import AutoModelForImageTextToText

    batch = workers.make_global_batch(vlm_dir)
    policy = _policy(vlm_dir, max_tokens=150)
    logprobs = policy.logprobs(batch)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    image_token_id = model.config.image_token_id
    for i, length in enumerate(batch.lengths.tolist()):
        ids = batch["input_ids"][i : i + 1, :length]
        vision = batch[VISION_INPUTS_KEY][i]
        inputs = {"input_ids": ids, "mm_token_type_ids": (ids == image_token_id).int()}
        if vision is not None:
            inputs.update(pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw)
        with torch.no_grad():
            logits = model(**inputs).logits
        expected = compute_token_logprobs(logits, ids, temperature=1.0)[0]
        torch.testing.assert_close(logprobs[i, :length], expected, atol=2e-5, rtol=0)


def test_step_does_not_depend_on_micro_batching(qwen2_vl_dir):
    """Images split over several micro-batches (some without any) or in one: the same step."""
    results = []
    for max_tokens in (10_000, 120):
        policy = _policy(qwen2_vl_dir, max_tokens=max_tokens, should_train_vision=True)
        results.append(workers.run_step(policy, workers.make_global_batch(qwen2_vl_dir)))
    one, many = results
    assert many["metrics"]["num_micro_batches"] > 2 > one["metrics"]["num_micro_batches"]
    assert many["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-5)
    assert many["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(many["weights"][name], tensor, atol=1e-5, rtol=0)


def test_vision_tower_is_frozen_unless_asked(qwen2_vl_dir):
    initial = dict(_policy(qwen2_vl_dir).named_weights())
    for should_train_vision in (False, True):
        policy = _policy(qwen2_vl_dir, should_train_vision=should_train_vision)
        trained = {id(p) for group in policy.optimizer.param_groups for p in group["params"]}
        visual = dict(policy.module.model.visual.named_parameters())
        assert all((id(p) in trained) == should_train_vision for p in visual.values())
        out = workers.run_step(policy, workers.make_global_batch(qwen2_vl_dir))
        moved = {n for n, t in out["weights"].items() if not torch.equal(t, initial[n])}
        moved_visual = {n for n in moved if ".visual." in f".{n}"}
        assert bool(moved_visual) == should_train_vision
        assert any("language_model" in n for n in moved)


def test_text_only_batch_on_a_vision_language_policy(qwen2_vl_dir):
    """No images anywhere (no VISION_INPUTS_KEY field at all): the language model's logprobs,
    and a trainable tower is left as it was (its gradient is zero, not missing)."""
    from transformers import AutoModelForImageTextToText

    batch = workers.make_global_batch(qwen2_vl_dir, images_per_prompt=(0, 0, 0))
    assert VISION_INPUTS_KEY not in batch
    policy = _policy(qwen2_vl_dir, should_train_vision=True)
    visual_before = {
        n: p.detach().clone() for n, p in policy.module.model.visual.named_parameters()
    }
    logprobs = policy.logprobs(batch)
    model = AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = compute_token_logprobs(logits, batch["input_ids"], temperature=1.0)
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(logprobs[mask], expected[mask], atol=2e-5, rtol=0)
    batch.tokens["old_logprobs"] = logprobs
    metrics = policy.train_step(batch, PolicyLoss())
    assert metrics["is_skipped"] == 0.0 and metrics["grad_norm"] > 0
    for name, param in policy.module.model.visual.named_parameters():
        assert torch.equal(param.detach(), visual_before[name]), name


def test_costs_count_the_vision_tower(qwen2_vl_dir):
    policy = _policy(qwen2_vl_dir)
    batch = workers.make_global_batch(qwen2_vl_dir)
    lengths = batch.lengths.tolist()
    patches = image_patches_of(batch)
    text = policy.estimate_costs(lengths)
    both = policy.estimate_costs(lengths, image_patches=patches)
    for t, b, p in zip(text, both, patches, strict=True):
        assert (b > t) == bool(p) and b >= t
    # More patches in one image cost more than the same patches in two (attention is per image).
    one, two = policy.estimate_costs([10, 10], image_patches=[[32], [16, 16]])
    assert one > two
    with pytest.raises(ValueError, match="image_patches has 1 entries for 2 lengths"):
        policy.estimate_costs([10, 10], image_patches=[[4]])


def test_images_count_toward_micro_batch_memory(qwen2_vl_dir):
    batch = workers.make_global_batch(qwen2_vl_dir)
    policy = _policy(qwen2_vl_dir, max_tokens=150)
    lengths = batch.lengths.tolist()
    patches = [sum(p) for p in image_patches_of(batch)]
    for index in policy.plan_micro_batches(batch):
        size = len(index) * max(lengths[i] for i in index) + sum(patches[i] for i in index)
        assert size <= 150 or len(index) == 1


# -- bad input ---------------------------------------------------------------------------------


def _image(rows=16, cols=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (rows, cols, 3), dtype=np.uint8)


def test_encode_vision_prompt_expands_placeholders_and_refuses_mismatches(qwen2_vl_dir):
    image_processor = load_image_processor(qwen2_vl_dir)
    image_id = 263
    ids, vision = encode_vision_prompt(
        [7, image_id, 8, image_id, 9],
        [_image(), _image(8, 24)],
        image_processor=image_processor,
        image_token_id=image_id,
    )
    assert vision.image_grid_thw.tolist() == [[1, 4, 4], [1, 2, 6]]
    assert ids == [7] + [image_id] * 4 + [8] + [image_id] * 3 + [9]
    # A processor's already expanded prompt is kept as it is.
    again, _ = encode_vision_prompt(
        ids, [_image(), _image(8, 24)], image_processor=image_processor, image_token_id=image_id
    )
    assert again == ids
    with pytest.raises(VisionInputError, match=r"1 image placeholder.*but 2 image") as err:
        encode_vision_prompt(
            [7, image_id, 8],
            [_image(), _image()],
            image_processor=image_processor,
            image_token_id=image_id,
        )
    assert err.value.cause == "image_count"
    with pytest.raises(VisionInputError, match="max_image_tokens=2") as err:
        encode_vision_prompt(
            [7, image_id],
            [_image()],
            image_processor=image_processor,
            image_token_id=image_id,
            max_image_tokens=2,
        )
    assert err.value.cause == "too_large"


def _one_image_sample(model_dir, *, num_images=1, num_placeholders=1):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    image_processor = load_image_processor(model_dir)
    vision = VisionInputs(
        *image_processor(images=[_image()] * num_images, return_tensors="pt").values()
    )
    prompt = [7] + [image_id] * 4 * num_placeholders + [8]
    completion = workers._Completion(prompt, [9, 10])
    samples = rollout_samples([completion], [1.0], [0], vision_inputs=[vision])
    batch = rollout_batch(samples)
    batch.samples["advantages"] = torch.ones(1)
    return batch


def test_more_images_than_image_tokens_is_a_clear_error(qwen2_vl_dir):
    policy = _policy(qwen2_vl_dir)
    batch = _one_image_sample(qwen2_vl_dir, num_images=2, num_placeholders=1)
    with pytest.raises(ValueError, match=r"sample 0 .*4 image tokens for 2 image"):
        policy.logprobs(batch)
    batch.tokens["old_logprobs"] = torch.zeros_like(batch["rollout_logprobs"])
    with pytest.raises(ValueError, match=r"sample 0 .*4 image tokens for 2 image"):
        policy.train_step(batch, PolicyLoss())


def test_images_for_a_text_only_model_are_a_clear_error(qwen2_vl_dir, tiny_model_dir):
    batch = _one_image_sample(qwen2_vl_dir)
    policy = _policy(tiny_model_dir)
    with pytest.raises(ValueError, match=r"sample 0 carries images .* text-only model"):
        policy.logprobs(batch)


def test_rollout_samples_check_their_vision_inputs():
    completion = workers._Completion([1, 2], [3])
    with pytest.raises(ValueError, match="vision_inputs has 2 entries for 1 completions"):
        rollout_samples([completion], [0.0], [0], vision_inputs=[None, None])
    with pytest.raises(ValueError, match=r"vision_inputs\[0\] is a dict"):
        rollout_samples([completion], [0.0], [0], vision_inputs=[{"pixel_values": 1}])


# -- two gloo ranks ----------------------------------------------------------------------------

RUNS = [("ddp", True), ("fsdp2", False), ("fsdp2", True)]


@pytest.mark.slow
def test_data_parallel_vlm_steps_equal_single_process_step(qwen2_vl_dir, tmp_path):
    """DDP and FSDP2 (tower frozen and trained) on two gloo ranks, after a rebalance that moves
    image samples: loss, grad norm, logprobs and updated weights equal one process's step."""
    from yatt.testing import run_ranks

    args = [
        sys.executable,
        str(WORKERS),
        str(tmp_path),
        json.dumps({"model_dir": qwen2_vl_dir, "runs": RUNS}),
    ]
    run_ranks(args, 2, env={"CUDA_VISIBLE_DEVICES": ""}, timeout_s=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[1]["own_ids"] == workers.SHARDS[2][1]
    references = {}
    for parallel, should_train_vision in RUNS:
        if should_train_vision not in references:
            policy = _policy(qwen2_vl_dir, should_train_vision=should_train_vision)
            references[should_train_vision] = workers.run_step(
                policy, workers.make_global_batch(qwen2_vl_dir)
            )
        ref = references[should_train_vision]
        held = []
        for out in (r[parallel, should_train_vision] for r in ranks):
            metrics = out["metrics"]
            assert metrics["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-5, abs=1e-6)
            assert metrics["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-4)
            assert metrics["num_loss_tokens"] == ref["metrics"]["num_loss_tokens"]
            width = out["old_logprobs"].shape[1]
            torch.testing.assert_close(
                out["old_logprobs"],
                ref["old_logprobs"][out["sample_ids"], :width],
                atol=2e-5,
                rtol=0,
            )
            for name, tensor in ref["weights"].items():
                torch.testing.assert_close(out["weights"][name], tensor, atol=1e-4, rtol=0)
            held += out["sample_ids"]
        assert sorted(held) == list(range(12))
        runs = [r[parallel, should_train_vision] for r in ranks]
        assert all(out["metrics"]["num_micro_batches"] > 1 for out in runs)
        assert sum(out["num_text_only_micro_batches"] for out in runs) > 0
        run = (parallel, should_train_vision)
        for name, tensor in ranks[0][run]["weights"].items():
            assert torch.equal(tensor, ranks[1][run]["weights"][name]), (run, name)


def test_export_reloads_as_the_vision_language_model(qwen2_vl_dir, tmp_path):
    """export_hf writes the image-text-to-text class (vision tower included), and a policy
    built on the export computes the trained policy's logprobs on image prompts."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from yatt.core import export_hf

    policy = _policy(qwen2_vl_dir, should_train_vision=True)
    workers.run_step(policy, workers.make_global_batch(qwen2_vl_dir))
    weights = dict(policy.named_weights())
    out = export_hf(policy, tmp_path / "hf")
    reloaded = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    got = dict(reloaded.named_parameters())
    assert got.keys() == weights.keys() and any(".visual." in f".{n}" for n in got)
    for name, tensor in got.items():
        assert torch.equal(tensor, weights[name]), name
    assert AutoImageProcessor.from_pretrained(out) is not None  # the processor travels too
    batch = workers.make_global_batch(qwen2_vl_dir)
    assert torch.equal(_policy(str(out)).logprobs(batch), policy.logprobs(batch))


def test_the_policy_says_which_tokens_end_a_response(qwen2_vl_dir, tiny_model_dir):
    """A vision-language policy: its vision tokens (Qwen2-VL's <|vision_start|>, <|vision_end|>,
    <|image_pad|>, <|video_pad|>) never belong in a response; a text policy names none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen2_vl_dir)
    from yatt.testing import VISION_TOKENS

    expected = {tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    assert set(_policy(qwen2_vl_dir).stop_token_ids) == expected
    assert _policy(tiny_model_dir).stop_token_ids == ()
