"""A judge that sees the sample's image: JudgeTemplate(image_key=...) over a tiny Qwen2-VL on the
built-in engine (the verdict equals the HF model's greedy forward on the same image, and
changes with the image), text-only judging by default, and clear errors for a judge that
cannot see images or a sample that has none."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from yatt.genrm import GenRM, JudgeTemplate, Sample, verification_template
from yatt.genrm.testing import FakeJudgeEngine
from yatt.rollout import BuiltinEngine, EngineConfig, SamplingParams
from yatt.testing import CountingImageProcessor

NUM_GPUS = 0
MAX_NEW_TOKENS = 6
Image = pytest.importorskip("PIL.Image")

TEMPLATE = JudgeTemplate(
    user="Question: {prompt}\nResponse: {response}\nIs it right?",
    system="Grade the answer by the picture.",
    image_key="image",
)
SAMPLING = SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
# A random tiny judge never stops: each generation ends at max_new_tokens ("length"), so its
# verdict is an error (a cut judge output is never read) and its text is what is compared.
UNFINISHED = "error"


@dataclass
class AnyText:
    """A parser for a random tiny judge: every non-empty verdict parses (reward 1); the texts
    are recorded so a test can read what the judge wrote."""

    texts: list[str] = field(default_factory=list)

    def parse(self, text: str) -> float | None:
        self.texts.append(text)
        return 1.0 if text else None


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from yatt.testing import make_tiny_vlm

    path = tmp_path_factory.mktemp("qwen2_vl_judge")
    make_tiny_vlm(path)
    return path


@pytest.fixture(scope="module")
def engine(vlm_dir):
    config = EngineConfig(device="cpu", dtype="float32", max_seq_len=256, max_batch_size=4)
    engine = BuiltinEngine(vlm_dir, config=config)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def image_processor(vlm_dir):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(vlm_dir)


def _image(seed: int, size=(16, 24)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _sample(image, *, response="4", sample_id=None) -> Sample:
    metadata = {} if image is None else {"image": image}
    kwargs = {} if sample_id is None else {"id": sample_id}
    return Sample(prompt="How many dots?", response=response, metadata=metadata, **kwargs)


def _reference_verdict(vlm_dir, image_processor, images) -> str:
    """The HF model's greedy text for the judge chat with `images`, built independently: the
    processor's way (each <|image_pad|> repeated in the text), full forward every step."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    text_part = "Question: How many dots?\nResponse: 4\nIs it right?"
    messages = [
        {"role": "system", "content": "Grade the answer by the picture."},
        {
            "role": "user",
            "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text_part}],
        },
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    vision = image_processor(images=images, return_tensors="pt")
    for n in (vision["image_grid_thw"].prod(-1) // 4).tolist():
        text = text.replace("<|image_pad|>", "<|placeholder|>" * n, 1)
    text = text.replace("<|placeholder|>", "<|image_pad|>")
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    image_id = model.config.image_token_id
    tokens = []
    for _ in range(MAX_NEW_TOKENS):
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                mm_token_type_ids=(ids == image_id).int(),
                pixel_values=vision["pixel_values"],
                image_grid_thw=vision["image_grid_thw"],
            ).logits[0, -1]
        tokens.append(int(logits.argmax()))
        ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_the_judge_sees_the_image_and_its_verdict_is_the_models(
    vlm_dir, engine, image_processor
) -> None:
    parser = AnyText()
    genrm = GenRM(
        engine,
        template=TEMPLATE,
        parser=parser,
        sampling=SAMPLING,
        image_processor=image_processor,
    )
    black, white = Image.new("RGB", (16, 16), "black"), Image.new("RGB", (16, 16), "white")
    images = [black, white, [_image(3), _image(4, size=(24, 16))]]
    samples = [_sample(image) for image in images]
    verdicts = genrm.score(samples)
    assert [v.status for v in verdicts] == [UNFINISHED] * 3
    assert all(v.votes[0].finish_reason == "length" for v in verdicts)
    for image, verdict in zip(images, verdicts, strict=True):
        listed = image if isinstance(image, list) else [image]
        assert verdict.text == _reference_verdict(vlm_dir, image_processor, listed)
    # The verdict depends on the image: the same text with a black or a white image is judged
    # otherwise (this random judge tells these two apart; images of noise it mostly does not).
    assert verdicts[0].text != verdicts[1].text
    # The judge's prompt tokens count the image tokens (what fills its KV cache).
    one_image, two_images = verdicts[0].num_judge_prompt_tokens, verdicts[2].num_judge_prompt_tokens
    # 16x16: 4x4 patches, 4 tokens; 16x24 and 24x16: 6 tokens each; each image in
    # <|vision_start|> ... <|vision_end|>: (6 + 2) * 2 - (4 + 2) more.
    assert two_images - one_image == 10


def test_streaming_verdicts_see_the_images_too(engine, image_processor) -> None:
    genrm = GenRM(
        engine,
        template=TEMPLATE,
        parser=AnyText(),
        sampling=SAMPLING,
        image_processor=image_processor,
    )
    samples = [_sample(_image(seed)) for seed in (1, 2)]
    blocking = genrm.score(samples)
    streamed = asyncio.run(genrm.ascore(samples))
    assert [v.text for v in streamed] == [v.text for v in blocking]


def test_a_sample_without_its_image_is_an_error_verdict_with_the_cause(
    engine, image_processor
) -> None:
    genrm = GenRM(
        engine,
        template=TEMPLATE,
        parser=AnyText(),
        sampling=SAMPLING,
        image_processor=image_processor,
    )
    samples = [
        _sample(_image(1)),
        _sample(None, sample_id="no-image"),
        _sample("not an image", sample_id="bad-image"),
        _sample([], sample_id="empty-list"),
    ]
    verdicts = genrm.score(samples)
    assert [v.status for v in verdicts] == [UNFINISHED, "error", "error", "error"]
    assert "did not finish" in verdicts[0].error
    assert "sample 'no-image' has no image in metadata['image']" in verdicts[1].error
    assert verdicts[2].error.startswith("images: the judge's image processor refused an image")
    assert "has no image" in verdicts[3].error
    assert [v.reward for v in verdicts[1:]] == [0.0] * 3  # default_reward; the run goes on


def test_text_only_judging_is_the_default_even_for_rows_with_images() -> None:
    engine = FakeJudgeEngine(judge=lambda prompt, k: "Yes")
    seen = []
    generate = engine.generate

    def recording_generate(requests, sampling):
        seen.extend(requests)
        return generate(requests, sampling)

    engine.generate = recording_generate
    genrm = GenRM(engine, template=verification_template(with_reference=False), parser=AnyText())
    (verdict,) = genrm.score([_sample(_image(1))])
    assert verdict.status == "ok"
    assert seen[0].images is None


@dataclass
class _SeeingFake(FakeJudgeEngine):
    accepts_images: bool = True


def test_a_judge_that_cannot_see_images_fails_at_construction(image_processor) -> None:
    from yatt.testing import make_tokenizer

    with pytest.raises(ValueError, match=r"accepts_images is False.*drop image_key"):
        GenRM(FakeJudgeEngine(), template=TEMPLATE, parser=AnyText())
    with pytest.raises(ValueError, match="no chat template"):
        GenRM(_SeeingFake(), template=TEMPLATE, parser=AnyText())  # ByteTokenizer
    seeing = _SeeingFake(tokenizer=make_tokenizer())
    with pytest.raises(ValueError, match=r"image_processor=AutoImageProcessor"):
        GenRM(seeing, template=TEMPLATE, parser=AnyText())
    with pytest.raises(ValueError, match="image_token_id="):
        GenRM(seeing, template=TEMPLATE, parser=AnyText(), image_processor=image_processor)
    with pytest.raises(ValueError, match="for a template that shows images"):
        GenRM(
            FakeJudgeEngine(),
            template=verification_template(),
            parser=AnyText(),
            image_processor=image_processor,
        )


def test_a_text_only_built_in_judge_refuses_an_image_template(tmp_path) -> None:
    from yatt.testing import make_tiny_causal_lm

    make_tiny_causal_lm(tmp_path / "lm")  # with its tokenizer
    engine = BuiltinEngine(tmp_path / "lm", config=EngineConfig(device="cpu", max_seq_len=64))
    try:
        assert not engine.accepts_images
        with pytest.raises(ValueError, match=r"image_key='image' shows the judge images"):
            GenRM(engine, template=TEMPLATE, parser=AnyText())
    finally:
        engine.close()


def test_the_judges_images_go_through_its_image_processor_once(vlm_dir, image_processor) -> None:
    """ImagePrompts.encode sizes the placeholders and hands the engine the processed images
    (Request.image_inputs): one processor pass per image in all, the verdict the same as the
    engine's own pass over the raw images."""
    from transformers import AutoTokenizer

    from yatt.genrm._images import ImagePrompts
    from yatt.rollout import Request

    spy = CountingImageProcessor(image_processor)
    config = EngineConfig(device="cpu", dtype="float32", max_seq_len=256, max_batch_size=4)
    judge_engine = BuiltinEngine(vlm_dir, config=config, image_processor=spy)
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    images = [_image(5), _image(6, size=(24, 16))]
    content = [{"type": "image"}] * 2 + [{"type": "text", "text": "How many dots?"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expanded, inputs = ImagePrompts(spy, image_id).encode(ids, images)
    assert spy.num_images == len(images)
    taken = judge_engine.generate(
        [Request(prompt_ids=expanded, images=images, image_inputs=inputs)], SAMPLING
    )
    assert spy.num_images == len(images)  # the engine took the judge's pass
    raw = judge_engine.generate([Request(prompt_ids=expanded, images=images)], SAMPLING)
    assert spy.num_images == 2 * len(images)  # the same engine processes raw images itself
    assert taken[0].response_ids == raw[0].response_ids
    # expand (the ids alone) is encode's ids.
    assert ImagePrompts(image_processor, image_id).expand(ids, images) == expanded
    judge_engine.close()


def test_genrm_processes_each_judged_image_once(vlm_dir, image_processor) -> None:
    """Through GenRM on the built-in engine: the judge's prompt is sized and its pixels made in
    one processor pass per image, which the engine takes (Request.image_inputs) instead of
    processing the raw images again: 1 + 2 images, 3 passes (6 with a second pass)."""
    spy = CountingImageProcessor(image_processor)
    config = EngineConfig(device="cpu", dtype="float32", max_seq_len=256, max_batch_size=4)
    judge_engine = BuiltinEngine(vlm_dir, config=config, image_processor=spy)
    try:
        genrm = GenRM(judge_engine, template=TEMPLATE, parser=AnyText(), sampling=SAMPLING)
        samples = [_sample(_image(7)), _sample([_image(8), _image(9, size=(24, 16))])]
        verdicts = genrm.score(samples)
        assert [v.status for v in verdicts] == [UNFINISHED, UNFINISHED]
        assert spy.num_images == 3
    finally:
        judge_engine.close()
