"""yatt.core.VisionModel: what a model folder's own config says about images, before weights load."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from yatt.core import VisionModel

NUM_GPUS = 0


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(request, tmp_path_factory) -> Path:
    from yatt.testing import make_tiny_vlm

    path = tmp_path_factory.mktemp(request.param)
    make_tiny_vlm(path, arch=request.param, patch_size=4)
    return path


def test_a_vision_language_folder_takes_images_and_stops_at_its_vision_tokens(vlm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    vision = VisionModel.from_pretrained(vlm_dir)
    assert vision.takes_images and vision.why_no_images() is None
    # The tokenizer's own ids of the family's four vision special tokens, in any order.
    names = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    assert sorted(vision.stop_token_ids) == sorted(tokenizer.convert_tokens_to_ids(names))
    assert vision.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # RGB x 2 frames x 4 x 4 pixels per patch; 2 x 2 patches merge into one image token.
    assert (vision.patch_dim, vision.merge_size) == (3 * 2 * 4 * 4, 2)


def test_a_text_model_takes_no_images_and_has_no_stop_tokens(tiny_model_dir, tmp_path):
    vision = VisionModel.from_pretrained(tiny_model_dir)
    assert not vision.takes_images and vision.stop_token_ids == ()
    assert "is a text model" in vision.why_no_images()
    # A folder with a tokenizer only states no vision tower either.
    assert VisionModel.from_pretrained(tmp_path).stop_token_ids == ()


def test_a_folder_without_its_image_processor_takes_no_images(vlm_dir, tmp_path):
    import shutil

    shutil.copytree(vlm_dir, tmp_path / "m")
    (tmp_path / "m" / "preprocessor_config.json").unlink()
    vision = VisionModel.from_pretrained(tmp_path / "m")
    assert not vision.takes_images and "preprocessor_config.json" in vision.why_no_images()
    assert len(vision.stop_token_ids) == 4  # it may still sample its vision tokens


def test_a_vision_tower_of_an_unknown_family_takes_no_images_but_keeps_its_stop_tokens():
    config = SimpleNamespace(
        model_type="llava", vision_config=SimpleNamespace(), image_token_id=7, video_token_id=True
    )
    vision = VisionModel.of(config)
    assert not vision.takes_images and "'llava'" in vision.why_no_images()
    assert vision.stop_token_ids == (7,)  # a bool is no token id


def test_the_policy_side_reads_the_same_from_a_loaded_model(vlm_dir):
    from transformers import AutoModelForImageTextToText

    from yatt.core.vision._vision_forward import VisionLanguage

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    vision = VisionLanguage.of(model)
    folder = VisionModel.from_pretrained(vlm_dir)
    assert vision.stop_token_ids == folder.stop_token_ids and len(vision.stop_token_ids) == 4
    assert (vision.image_token_id, vision.merge_size, vision.patch_dim) == (
        folder.image_token_id,
        folder.merge_size,
        folder.patch_dim,
    )
