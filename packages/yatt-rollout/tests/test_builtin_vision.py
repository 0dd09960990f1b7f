"""The built-in engine on a tiny Qwen2-VL / Qwen2.5-VL: images in the prefill, text decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams
from yatt.testing import CountingImageProcessor

NUM_GPUS = 0
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(request, tmp_path_factory):
    from yatt.testing import make_tiny_vlm

    path = tmp_path_factory.mktemp(request.param)
    make_tiny_vlm(path, arch=request.param)
    return path


def _image(rows, cols, seed):
    return np.random.default_rng(seed).integers(0, 256, (rows, cols, 3), dtype=np.uint8)


def _requests(model_dir, images_per_prompt=(1, 0, 2)):
    """Requests with expanded image placeholders (as a processor writes them), and each one's
    (pixel_values, image_grid_thw) for the reference forward."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    requests, processed = [], []
    for i, num_images in enumerate(images_per_prompt):
        # 16x16 images: 4 image tokens over 2 mrope steps, so decoding needs the offset.
        images = [_image(16, 16 + 8 * k, seed=10 * i + k) for k in range(num_images)]
        content = [{"type": "image"}] * num_images + [{"type": "text", "text": f"q{i} " * (i + 1)}]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        vision = None
        if images:
            vision = image_processor(images=images, return_tensors="pt")
            expanded = []
            counts = iter((vision["image_grid_thw"].prod(-1) // 4).tolist())
            for token in ids:
                expanded += [token] * (next(counts) if token == image_id else 1)
            ids = expanded
        requests.append(Request(prompt_ids=ids, images=images or None))
        processed.append(vision)
    return requests, processed, image_id


def _greedy_reference(model_dir, request, vision, image_id):
    """Greedy tokens and logprobs from the HF model's full forward, recomputed every step."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([request.prompt_ids])
    tokens, logprobs = [], []
    for _ in range(MAX_NEW_TOKENS):
        inputs = {"input_ids": ids, "mm_token_type_ids": (ids == image_id).int()}
        if vision is not None:
            inputs.update(
                pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"]
            )
        with torch.no_grad():
            logits = model(**inputs).logits[0, -1]
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


def _engine(model_dir, **overrides):
    settings = {"device": "cpu", "dtype": "float32", "max_seq_len": 128, "max_batch_size": 4}
    return BuiltinEngine(model_dir, config=EngineConfig(**{**settings, **overrides}))


# "layers": the language model's decoder layers compiled once for every layer (image prompts
# prefill through them too, with their features and mrope positions).
COMPILED_LAYERS = {"compile_decode": True, "compile_prefill": True, "compile_scope": "layers"}


@pytest.mark.parametrize("overrides", [{}, COMPILED_LAYERS], ids=["eager", "compiled-layers"])
def test_greedy_generation_with_images_equals_the_model_forward(vlm_dir, overrides):
    requests, processed, image_id = _requests(vlm_dir)
    engine = _engine(vlm_dir, **overrides)
    assert engine.accepts_images
    sampling = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    completions = engine.generate(requests, sampling)
    for request, vision, completion in zip(requests, processed, completions, strict=True):
        tokens, logprobs = _greedy_reference(vlm_dir, request, vision, image_id)
        assert completion.prompt_ids == request.prompt_ids
        assert completion.response_ids == tokens
        np.testing.assert_allclose(completion.logprobs, logprobs, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_generation_with_images_on_cuda_graphs_equals_the_model_forward(vlm_dir):
    """The captured decode step (CUDA graphs) reads each slot's rope delta: the same tokens
    as the CPU reference forward, logprobs within float32 kernel differences."""
    requests, processed, image_id = _requests(vlm_dir)
    engine = _engine(vlm_dir, device="cuda", use_cuda_graph=True)
    sampling = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second call replays the graphs captured by the first
        completions = engine.generate(requests, sampling)
        for request, vision, completion in zip(requests, processed, completions, strict=True):
            tokens, logprobs = _greedy_reference(vlm_dir, request, vision, image_id)
            assert completion.response_ids == tokens
            np.testing.assert_allclose(completion.logprobs, logprobs, atol=1e-3, rtol=0)
    engine.close()


def test_samples_are_seeded_per_request_and_sample(vlm_dir):
    """Same seed, same samples: each draws from its (seed, request, sample) key, whether its
    prompt was prefilled with every other (image and text rows in one prefill) or alone in a
    slot (one slot: a prefill per sample, decoding one at a time); a new seed, new samples."""
    requests, _, _ = _requests(vlm_dir)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=7)
    together = _engine(vlm_dir).generate(requests, sampling)
    one_slot = _engine(vlm_dir, max_batch_size=1).generate(requests, sampling)
    assert [c.response_ids for c in together] == [c.response_ids for c in one_slot]
    for a, b in zip(together, one_slot, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    reseeded = _engine(vlm_dir).generate(requests, SamplingParams(n=2, seed=8, max_new_tokens=8))
    assert [c.response_ids for c in together] != [c.response_ids for c in reseeded]


def test_weight_sync_covers_the_vision_tower(vlm_dir):
    from transformers import AutoModelForImageTextToText

    requests, _, _ = _requests(vlm_dir, images_per_prompt=(2,))
    engine = _engine(vlm_dir)
    sampling = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    before = engine.generate(requests, sampling)[0]
    trained = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if ".visual." in f".{name}":
                param.mul_(3.0)
    visual = [(n, p.detach()) for n, p in trained.named_parameters() if ".visual." in f".{n}"]
    engine.update_weights(visual)
    served = dict(engine.model.named_parameters())
    for name, tensor in visual:
        assert torch.equal(served[name], tensor), name
    after = engine.generate(requests, sampling)[0]
    # Only the image features changed, and they changed what the model says.
    assert after.logprobs != before.logprobs


def test_mismatched_images_are_clear_errors_before_any_work(vlm_dir, tiny_model_dir):
    requests, _, image_id = _requests(vlm_dir, images_per_prompt=(1,))
    engine = _engine(vlm_dir)
    sampling = SamplingParams(max_new_tokens=2)
    extra = Request(
        prompt_ids=requests[0].prompt_ids, images=[*requests[0].images, _image(16, 16, 0)]
    )
    with pytest.raises(ValueError, match=r"requests\[0\]: the prompt's image token runs are \[4\]"):
        engine.generate([extra], sampling)
    missing = Request(prompt_ids=requests[0].prompt_ids)
    with pytest.raises(ValueError, match=r"requests\[0\]\.prompt_ids has image token runs"):
        engine.generate([missing], sampling)
    bad = Request(prompt_ids=[5, image_id, 6], images=["not an image"])
    with pytest.raises(ValueError, match=r"requests\[0\]"):
        engine.generate([bad], sampling)
    text_engine = BuiltinEngine(
        tiny_model_dir, config=EngineConfig(device="cpu", dtype="float32", max_seq_len=64)
    )
    assert not text_engine.accepts_images
    with pytest.raises(ValueError, match="text-only"):
        text_engine.generate([Request(prompt_ids=[5, 6], images=[_image(16, 16, 0)])], sampling)


def test_processed_images_that_come_with_a_request_are_not_processed_again(vlm_dir):
    """Request.image_inputs (the caller ran the processor once) are what the prefill takes:
    the engine's processor sees no image, and the samples are those of raw images."""
    from transformers import AutoImageProcessor

    requests, processed, _ = _requests(vlm_dir)
    spy = CountingImageProcessor(AutoImageProcessor.from_pretrained(vlm_dir))
    engine = BuiltinEngine(
        vlm_dir,
        config=EngineConfig(device="cpu", dtype="float32", max_seq_len=128, max_batch_size=4),
        image_processor=spy,
    )
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=5)
    raw = engine.generate(requests, sampling)
    num_images = sum(len(r.images or ()) for r in requests)
    assert spy.num_images == num_images  # without image_inputs: each image once, n samples
    spy.num_images = 0
    with_inputs = [
        Request(prompt_ids=r.prompt_ids, images=r.images, image_inputs=_inputs(p))
        for r, p in zip(requests, processed, strict=True)
    ]
    taken = engine.generate(with_inputs, sampling)
    assert spy.num_images == 0
    assert [c.response_ids for c in taken] == [c.response_ids for c in raw]
    for a, b in zip(taken, raw, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
    # Without the raw images too (the engine needs only the processed ones).
    bare = [Request(prompt_ids=r.prompt_ids, image_inputs=r.image_inputs) for r in with_inputs]
    assert [c.response_ids for c in engine.generate(bare, sampling)] == [
        c.response_ids for c in raw
    ]
    assert spy.num_images == 0


def _inputs(processed):
    from types import SimpleNamespace

    if processed is None:
        return None
    return SimpleNamespace(
        pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"]
    )


def test_processed_images_that_do_not_fit_are_clear_errors(vlm_dir, tiny_model_dir):
    from types import SimpleNamespace

    requests, processed, _ = _requests(vlm_dir, images_per_prompt=(1,))
    engine = _engine(vlm_dir)
    sampling = SamplingParams(max_new_tokens=2)
    pixels, grid = processed[0]["pixel_values"], processed[0]["image_grid_thw"]
    ids = requests[0].prompt_ids
    cases = {
        r"image_inputs=tuple: give an object with pixel_values": (pixels, grid),
        r"image_inputs\.pixel_values has shape \(\d+, 7\)": SimpleNamespace(
            pixel_values=pixels[:, :7], image_grid_thw=grid
        ),
        r"image_inputs\.image_grid_thw has shape \(0, 3\)": SimpleNamespace(
            pixel_values=pixels, image_grid_thw=grid[:0]
        ),
        # Two images' worth of grid for the prompt's one placeholder run.
        r"the prompt's image token runs are \[4\]": SimpleNamespace(
            pixel_values=torch.cat([pixels, pixels]), image_grid_thw=torch.cat([grid, grid])
        ),
    }
    for message, inputs in cases.items():
        with pytest.raises(ValueError, match=r"requests\[0\]" + r".*" + message):
            engine.generate([Request(prompt_ids=ids, image_inputs=inputs)], sampling)
    text_engine = BuiltinEngine(
        tiny_model_dir, config=EngineConfig(device="cpu", dtype="float32", max_seq_len=64)
    )
    inputs = _inputs(processed[0])
    with pytest.raises(ValueError, match=r"requests\[0\]\.image_inputs is set .* text-only"):
        text_engine.generate([Request(prompt_ids=[5, 6], image_inputs=inputs)], sampling)
