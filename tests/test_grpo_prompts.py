"""The trainer's prompts (yatt.core.PromptEncoder, tested in yatt-core's test_prompts.py) reach
the rollout engine with their images processed once: the built-in engine samples from the
pixels that come with the request (Prompt.request())."""

NUM_GPUS = 0

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import grpo_prompts

from yatt import core, rollout
from yatt.testing import CountingImageProcessor, CountingTokenizer

MAX_SEQ_LEN, MAX_NEW_TOKENS = 256, 4


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    from yatt.testing import make_tiny_vlm

    path = tmp_path_factory.mktemp("qwen2_vl")
    make_tiny_vlm(path, arch="qwen2_vl")
    return path


def _encoder(model_dir: Path, *, image_key: str = "") -> grpo_prompts.PromptEncoder:
    from transformers import AutoTokenizer

    cfg = SimpleNamespace(
        data=SimpleNamespace(
            prompt_key="prompt", image_key=image_key, max_images=4, apply_chat_template=True
        ),
        rollout=SimpleNamespace(
            max_prompt_tokens=MAX_SEQ_LEN - MAX_NEW_TOKENS  # RolloutConfig's rule
        ),
        policy=SimpleNamespace(model_dir=str(model_dir)),
    )
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(model_dir))
    return grpo_prompts.PromptEncoder(cfg, tokenizer)


def _loader(path: Path, encoder, num_rows: int, **images) -> core.ShardedLoader:
    return core.ShardedLoader(
        str(path),
        batch_size=num_rows,
        rank=0,
        world_size=1,
        prompt_key="prompt",
        seed=0,
        prompt_encoder=encoder,
        **images,
    )


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _image_rows(tmp_path: Path, images_per_row) -> list[dict]:
    import numpy as np
    from PIL import Image

    rows = []
    for i, num_images in enumerate(images_per_row):
        names = []
        for k in range(num_images):
            name = f"img{i}_{k}.png"
            pixels = np.random.default_rng(10 * i + k).integers(0, 256, (16, 16 + 8 * k, 3))
            Image.fromarray(pixels.astype(np.uint8)).save(tmp_path / name)
            names.append(name)
        rows.append({"prompt": f"how many dots? {i}", "image": names[0] if k == 0 else names})
    return rows


def test_an_image_row_is_tokenized_once_and_its_images_processed_once(tmp_path, vlm_dir):
    """One image per row: the loader's count (with one image placeholder) is the encoder's
    ids, and the images go through the image processor once, in the encoder: the built-in
    engine samples from the pixels that come with the request."""
    encoder = _encoder(vlm_dir, image_key="image")
    spy = CountingImageProcessor(encoder.image_processor)
    encoder.image_processor = spy
    rows = _image_rows(tmp_path, images_per_row=(1, 1, 1))
    loader = _loader(_write_rows(tmp_path / "rows.jsonl", rows), encoder, 3, image_key="image")
    prompts = encoder.encode(loader.next_batch())
    assert len(prompts) == 3
    assert sum(encoder.tokenizer.texts.values()) == 3  # one call per prompt
    assert spy.num_images == 3  # each image once, in the encoder
    engine = rollout.BuiltinEngine(
        vlm_dir,
        config=rollout.EngineConfig(device="cpu", dtype="float32", max_seq_len=MAX_SEQ_LEN),
        image_processor=spy,
    )
    sampling = rollout.SamplingParams(n=2, max_new_tokens=MAX_NEW_TOKENS, seed=1)
    taken = engine.generate([p.request() for p in prompts], sampling)
    assert spy.num_images == 3  # the engine took the encoder's pixels (it used to redo them)
    # The same samples as the engine's own pass over the raw images.
    raw = [rollout.Request(prompt_ids=p.ids, images=p.images) for p in prompts]
    assert [c.response_ids for c in engine.generate(raw, sampling)] == [
        c.response_ids for c in taken
    ]
    assert spy.num_images == 6
    engine.close()
