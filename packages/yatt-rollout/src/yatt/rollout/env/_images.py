"""Images in multi-turn trajectories: a tool (or reset's first message) that shows the model a
picture, for a vision-language policy (the Qwen2-VL family).

What a tool returns to show an image (one documented shape, the chat templates' own):

    PIL.Image.Image                                    the image alone
    {"type": "image", "image": PIL.Image.Image}        one image content part
    [{"type": "image", "image": img}, {"type": "text", "text": "..."}, ...]
                                                       content parts, in order (at least one image)

Anything else is text, as before (str as is, else JSON). The tool message then carries the
parts as its content ([{"type": "image", "image": img}, {"type": "text", "text": ...}]), which
the chat template renders as one image placeholder per image (Qwen2-VL's
<|vision_start|><|image_pad|><|vision_end|>); the token layer expands each placeholder to the
image's token count (ChatTokens), as a single-turn prompt is expanded.

Each image goes through the image processor once, when its tool answers: its ImageInputs (the
pixels and grid a Qwen2-VL-family model takes) join the trajectory's, and every later turn's
Request carries them all (Request.image_inputs, processed; Request.images, the raw ones for
engines that run their own processor).

The observation's token cap (EnvConfig.max_tool_output_tokens) counts the images' tokens
first: images whose tokens alone exceed it are refused (an error observation, cause
"image_too_large"), else the text parts share what is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch


class ImageInputs(NamedTuple):
    """A trajectory's images as a Qwen2-VL-family model takes them (the layout of
    yatt.core.VisionInputs: `core.VisionInputs(*inputs)` converts)."""

    pixel_values: torch.Tensor  # [P, D] float: every patch of the images, image after image
    image_grid_thw: torch.Tensor  # [I, 3] int64: (t, h, w) patches per image

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def tokens_per_image(self, merge_size: int) -> list[int]:
        return [int(n) // merge_size**2 for n in self.image_grid_thw.prod(-1).tolist()]


def concat_image_inputs(
    first: ImageInputs | None, second: ImageInputs | None
) -> ImageInputs | None:
    """`first`'s images, then `second`'s (either may be None)."""
    if first is None or second is None:
        return first if second is None else second
    return ImageInputs(
        pixel_values=torch.cat([first.pixel_values, second.pixel_values]),
        image_grid_thw=torch.cat([first.image_grid_thw, second.image_grid_thw]),
    )


class ImageResultError(ValueError):
    """A tool's image result that cannot be shown; `cause` is the tool-error metric key."""

    def __init__(self, message: str, *, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def is_image(value: Any) -> bool:
    """A PIL image (without importing PIL when no caller has)."""
    import sys

    pil = sys.modules.get("PIL.Image")
    return pil is not None and isinstance(value, pil.Image)


def image_parts(result: Any) -> list[dict[str, Any]] | None:
    """A tool result as content parts when it shows an image (see the module docstring), else
    None (a text result). ImageResultError for a list of parts that mixes in something else."""
    if is_image(result):
        return [{"type": "image", "image": result}]
    if isinstance(result, dict) and result.get("type") == "image" and is_image(result.get("image")):
        return [{"type": "image", "image": result["image"]}]
    if not isinstance(result, list) or not any(_is_image_part(p) for p in result):
        return None
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(result):
        if _is_image_part(part):
            parts.append({"type": "image", "image": part["image"]})
        elif (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ImageResultError(
                f"part {i} of the tool's content parts is {_describe(part)}; give "
                '{"type": "image", "image": <PIL image>} or {"type": "text", "text": <str>} parts',
                cause="bad_image",
            )
    return parts


def message_images(messages: Sequence[dict[str, Any]]) -> list[Any]:
    """The images in `messages`' content parts, in order (what the template renders)."""
    images = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            images += [p["image"] for p in content if _is_image_part(p)]
    return images


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image" and is_image(part.get("image"))


def _describe(part: Any) -> str:
    if isinstance(part, dict):
        return f"a dict with type={part.get('type')!r}"
    return f"a {type(part).__name__}"


class ToolImages:
    """A vision-language policy's image processor as the multi-turn driver uses it.

    image_processor: the policy's (a Qwen2-VL-family image processor: pixel_values and
    image_grid_thw, merge_size); image_token_id: the token a placeholder run repeats.
    """

    def __init__(self, image_processor: Any, image_token_id: int) -> None:
        if image_processor is None:
            raise ValueError("ToolImages needs the policy's image processor")
        self.image_processor = image_processor
        self.image_token_id = int(image_token_id)
        self.merge_size = int(getattr(image_processor, "merge_size", 2))

    def encode(self, images: Sequence[Any]) -> ImageInputs:
        """`images` through the image processor (ImageResultError "bad_image" when it refuses)."""
        try:
            out = self.image_processor(images=list(images), return_tensors="pt")
        except (ValueError, TypeError, OSError) as err:
            raise ImageResultError(
                f"the image processor refused the image: {err}", cause="bad_image"
            ) from err
        return ImageInputs(
            pixel_values=out["pixel_values"].contiguous(),
            image_grid_thw=out["image_grid_thw"].to(torch.int64).contiguous(),
        )

    def tokens_per_image(self, inputs: ImageInputs) -> list[int]:
        return inputs.tokens_per_image(self.merge_size)
