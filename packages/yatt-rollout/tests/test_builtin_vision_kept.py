"""The built-in engine continues a kept conversation whose new tokens hold an image (a tool's
picture) on a tiny Qwen2-VL / Qwen2.5-VL: the continuation prefills the image's features with
mrope positions that follow the kept part, so each turn samples what the model's own forward
over the whole conversation (every image, the family's get_rope_index) gives, and what a fresh
prefill of it samples."""

NUM_GPUS = 0

import numpy as np
import pytest
import torch

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

MAX_NEW_TOKENS = 5


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(request, tmp_path_factory):
    from yatt.testing import make_tiny_vlm

    path = tmp_path_factory.mktemp(request.param)
    make_tiny_vlm(path, arch=request.param)
    return path


def _image(rows, cols, seed):
    return np.random.default_rng(seed).integers(0, 256, (rows, cols, 3), dtype=np.uint8)


class Conversation:
    """A conversation's ids and images, grown turn by turn as the multi-turn driver grows it:
    the response, then an observation (text, or an image between text) with its image's
    placeholder expanded."""

    def __init__(self, model_dir, first_image):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.image_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.ids, self.images = [], []
        content = [{"type": "text", "text": "what now?"}]
        if first_image is not None:
            content.insert(0, {"type": "image"})
        self._add(
            [{"role": "user", "content": content}],
            [] if first_image is None else [first_image],
            add_generation_prompt=True,
        )

    def _add(self, messages, images, *, add_generation_prompt):
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        counts = iter(self.tokens(images))
        for token in ids:
            self.ids += [token] * (next(counts) if token == self.image_id else 1)
        self.images += images

    def tokens(self, images):
        if not images:
            return []
        grid = self.processor(images=images, return_tensors="pt")["image_grid_thw"]
        return (grid.prod(-1) // 4).tolist()

    def respond(self, response_ids, observation_image=None):
        """The response, then a tool turn (with the image when given) and the next header."""
        self.ids += response_ids
        content = [{"type": "text", "text": "result:"}]
        images = []
        if observation_image is not None:
            content += [{"type": "image"}, {"type": "text", "text": " ok"}]
            images = [observation_image]
        text = self.tokenizer.apply_chat_template(
            [{"role": "tool", "content": content}], add_generation_prompt=True, tokenize=False
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        counts = iter(self.tokens(images))
        for token in [*self.tokenizer("\n", add_special_tokens=False)["input_ids"], *ids]:
            self.ids += [token] * (next(counts) if token == self.image_id else 1)
        self.images += images

    def request(self, session_id):
        return Request(
            prompt_ids=list(self.ids), images=list(self.images) or None, session_id=session_id
        )


def _engine(model_dir, device="cpu"):
    engine = BuiltinEngine(
        model_dir,
        config=EngineConfig(device=device, dtype="float32", max_seq_len=256, max_batch_size=4),
    )
    counts = {"continued": 0, "full": 0}
    runner = engine._runner
    prefill, prefill_continuations = runner.prefill, runner.prefill_continuations

    def counting_prefill(items, slots, flags):
        counts["full"] += len(items)
        return prefill(items, slots, flags)

    def counting_continuations(items, slots, starts, flags):
        counts["continued"] += len(items)
        return prefill_continuations(items, slots, starts, flags)

    runner.prefill, runner.prefill_continuations = counting_prefill, counting_continuations
    return engine, counts


def _reference(model_dir, ids, images):
    """Greedy tokens and logprobs from the HF model's full forward over the conversation."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    image_id = model.config.image_token_id
    vision = None
    if images:
        vision = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")
    ids = torch.tensor([ids])
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


# Per conversation: its first prompt's image (or none), then each observation's image (None:
# a text observation). 16 x 24 pictures are 4 x 6 patches (6 tokens over 3 mrope columns), so
# every image moves the text positions that follow it off the cache positions.
SCRIPTS = {
    "text-prompt": (None, [_image(16, 24, 1), None]),
    "image-prompt": (_image(24, 16, 2), [None, _image(16, 24, 3), _image(32, 16, 4)]),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_kept_turn_with_a_tool_image_samples_the_models_forward(vlm_dir, script):
    first_image, observations = SCRIPTS[script]
    sampling = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    kept, counts = _engine(vlm_dir)
    fresh, _ = _engine(vlm_dir)
    conversation = Conversation(vlm_dir, first_image)
    for turn in range(len(observations) + 1):
        (completion,) = kept.generate([conversation.request("s")], sampling)
        (again,) = fresh.generate([conversation.request(None)], sampling)
        tokens, logprobs = _reference(vlm_dir, conversation.ids, conversation.images)
        assert completion.response_ids == tokens == again.response_ids, turn
        np.testing.assert_allclose(completion.logprobs, logprobs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(again.logprobs, logprobs, atol=1e-5, rtol=0)
        if turn < len(observations):
            conversation.respond(completion.response_ids, observations[turn])
    # Every turn after the first continued the kept KV, images and all.
    assert counts == {"full": 1, "continued": len(observations)}
    assert kept.num_kept_sessions == 1
    kept.close()
    fresh.close()


def test_a_kept_turn_whose_images_differ_is_prefilled_whole(vlm_dir):
    """The kept KV holds its images' features: a next turn with the same ids but another
    first image (a reused session id) is prefilled whole, never continued."""
    sampling = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    engine, counts = _engine(vlm_dir)
    conversation = Conversation(vlm_dir, _image(16, 16, 5))
    (completion,) = engine.generate([conversation.request("s")], sampling)
    conversation.respond(completion.response_ids, _image(16, 16, 6))
    conversation.images[0] = _image(16, 16, 7)  # same size and tokens, other pixels
    (completion,) = engine.generate([conversation.request("s")], sampling)
    tokens, logprobs = _reference(vlm_dir, conversation.ids, conversation.images)
    assert completion.response_ids == tokens
    np.testing.assert_allclose(completion.logprobs, logprobs, atol=1e-5, rtol=0)
    assert counts == {"full": 2, "continued": 0}
    engine.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled prefill, graphs)")
def test_a_kept_vision_conversation_on_cuda_samples_what_a_fresh_prefill_samples(vlm_dir):
    """On CUDA the text continuation of a vision session is the compiled one, its positions
    shifted by the slot's rope_delta, and decode runs in CUDA graphs: each turn of the kept
    conversation samples what a fresh prefill of the whole conversation samples (float32, so
    the two paths agree to float32 rounding: greedy ids equal, logprobs within 1e-3)."""
    first_image, observations = SCRIPTS["image-prompt"]
    sampling = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    kept, counts = _engine(vlm_dir, device="cuda")
    fresh, _ = _engine(vlm_dir, device="cuda")
    conversation = Conversation(vlm_dir, first_image)
    for turn in range(len(observations) + 1):
        (completion,) = kept.generate([conversation.request("s")], sampling)
        (again,) = fresh.generate([conversation.request(None)], sampling)
        assert completion.response_ids == again.response_ids, turn
        np.testing.assert_allclose(completion.logprobs, again.logprobs, atol=1e-3, rtol=0)
        if turn < len(observations):
            conversation.respond(completion.response_ids, observations[turn])
    assert counts == {"full": 1, "continued": len(observations)}
    kept.close()
    fresh.close()
