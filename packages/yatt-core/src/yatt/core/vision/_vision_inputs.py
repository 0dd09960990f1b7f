"""A sample's images as a vision-language model takes them, and how a prompt gets them.

    image_processor = load_image_processor(model_dir)           once, on every rank
    prompt_ids, vision = encode_vision_prompt(ids, images,      per prompt, on the rank that
        image_processor=..., image_token_id=...)                loaded its row
    Request(prompt_ids=prompt_ids, images=images)               the engine sees the raw images
    rollout_samples(..., vision_inputs=[vision per completion]) the trainer keeps the tensors

Layout of one sample's `VisionInputs` (the Qwen2-VL family's processor outputs):
    pixel_values    [P, D] float   every patch of the sample's images, image after image
                                   (D = channels x temporal patch x patch x patch)
    image_grid_thw  [I, 3] int64   (t, h, w) patches of each of its I images; P = sum(t*h*w)
In the prompt, image i is a run of t*h*w / merge_size**2 image tokens (2x2 patches merge into
one token), the runs in image order. A sample without images has no VisionInputs (None).

The tensors stay with the sample: in a Batch they are per-sample metadata (meta[VISION_INPUTS_KEY]),
which Batch.rebalance moves with the sample (raw tensor bytes: a NamedTuple is not pickled) and
which never leaves the CPU until its micro-batch runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

VISION_INPUTS_KEY = "vision_inputs"  # the Batch meta field (and sample key) holding them


class VisionInputs(NamedTuple):
    """One sample's images as the model takes them; see the module docstring for the layout."""

    pixel_values: torch.Tensor  # [P, D] float, all patches of the sample's images in order
    image_grid_thw: torch.Tensor  # [I, 3] int64, (t, h, w) patches per image

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def patches_per_image(self) -> list[int]:
        return self.image_grid_thw.prod(-1).tolist()

    def tokens_per_image(self, merge_size: int) -> list[int]:
        """Image tokens each image takes in the prompt (merge_size**2 patches per token)."""
        return [n // merge_size**2 for n in self.patches_per_image()]


class VisionInputError(ValueError):
    """A prompt and its images do not fit together; `cause` is a short key for skip counts."""

    def __init__(self, message: str, *, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def load_image_processor(model_dir: str | Path) -> Any:
    """The image processor saved beside a vision-language model (preprocessor_config.json)."""
    from transformers import AutoImageProcessor

    path = Path(model_dir)
    if not (path / "preprocessor_config.json").is_file():
        raise ValueError(
            f"{str(model_dir)!r} has no preprocessor_config.json; save the model's image "
            "processor there (image_processor.save_pretrained(model_dir))"
        )
    return AutoImageProcessor.from_pretrained(path)


def encode_images(image_processor: Any, images: Sequence[Any]) -> VisionInputs:
    """VisionInputs of `images` (PIL images, HWC uint8 arrays or CHW tensors), one sample's."""
    if not images:
        raise VisionInputError("encode_images needs at least one image", cause="no_image")
    try:
        out = image_processor(images=list(images), return_tensors="pt")
    except (ValueError, TypeError, OSError) as err:
        raise VisionInputError(
            f"the image processor refused an image: {err}", cause="bad_image"
        ) from err
    return VisionInputs(
        pixel_values=out["pixel_values"].contiguous(),
        image_grid_thw=out["image_grid_thw"].to(torch.int64).contiguous(),
    )


def image_token_runs(prompt_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive image tokens in `prompt_ids`."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(prompt_ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def expand_image_tokens(
    prompt_ids: Sequence[int],
    vision: VisionInputs,
    *,
    image_token_id: int,
    merge_size: int,
) -> list[int]:
    """`prompt_ids` with each image's placeholder run as long as the image's token count.

    A placeholder is one image token per image (what a chat template writes) or a run already
    of the right length (a processor's output); either way the result is what the model takes.
    Raises VisionInputError when the prompt's placeholders and the images disagree in number.
    """
    runs = image_token_runs(prompt_ids, image_token_id)
    wanted = vision.tokens_per_image(merge_size)
    if len(runs) != len(wanted):
        raise VisionInputError(
            f"the prompt has {len(runs)} image placeholder(s) but {len(wanted)} image(s) came "
            "with it; put one image placeholder in the prompt per image (the chat template's "
            "image part) or drop the extra images",
            cause="image_count",
        )
    out: list[int] = []
    position = 0
    for (start, length), num_tokens in zip(runs, wanted, strict=True):
        if length not in (1, num_tokens):
            raise VisionInputError(
                f"an image placeholder run of {length} tokens where the image takes "
                f"{num_tokens}; give one placeholder token per image",
                cause="image_count",
            )
        out.extend(prompt_ids[position:start])
        out.extend([image_token_id] * num_tokens)
        position = start + length
    out.extend(prompt_ids[position:])
    return out


def encode_vision_prompt(
    prompt_ids: Sequence[int],
    images: Sequence[Any],
    *,
    image_processor: Any,
    image_token_id: int,
    max_image_tokens: int | None = None,
) -> tuple[list[int], VisionInputs]:
    """(prompt ids with expanded image placeholders, the images' VisionInputs) of one prompt.

    max_image_tokens: refuse a prompt whose images take more tokens than this (an oversized
    image). Raises VisionInputError (its `cause` names the problem) for input to skip.
    """
    vision = encode_images(image_processor, images)
    merge_size = int(getattr(image_processor, "merge_size", 2))
    num_tokens = sum(vision.tokens_per_image(merge_size))
    if max_image_tokens is not None and num_tokens > max_image_tokens:
        raise VisionInputError(
            f"the images take {num_tokens} tokens, over max_image_tokens={max_image_tokens}; "
            "lower the image processor's max_pixels or raise the limit",
            cause="too_large",
        )
    ids = expand_image_tokens(
        prompt_ids, vision, image_token_id=image_token_id, merge_size=merge_size
    )
    return ids, vision
