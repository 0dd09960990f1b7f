"""Images shown to a judge: a sample's images -> a local VLM's prompt, or OpenAI image parts.

    Sample.metadata[template.image_key]    one image or a list (PIL images, as the loader gives)
    local judge (GenRM):   chat template writes one placeholder token per image
                           -> ImagePrompts.encode: the images through the judge's image
                              processor once; each placeholder becomes the image's tokens
                           -> Request(prompt_ids=expanded, images=images, image_inputs=processed)
    OpenAIJudge:           {"type": "image"} parts -> {"type": "image_url", "image_url":
                           {"url": "data:image/png;base64,..."}} in the user message

A Qwen2-VL-family engine takes each image as a run of image tokens as long as its merged patch
count (the processor's image_grid_thw t*h*w / merge_size**2), as the model's processor writes
the prompt. The judge's engine does not expand placeholders itself (yatt's built-in engine
checks the runs), so the judge counts them with the same image processor the engine uses, and
hands the engine what it processed (Request.image_inputs) so the engine does not process again.
The judge is its own model with its own processor: the policy's processed pixels are not its.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

# The image processor's tokens-per-image merge, when it does not say (Qwen2-VL's is 2).
_DEFAULT_MERGE_SIZE = 2
# Leading bytes of the image files a data URL carries as they are (no re-encoding).
_MAGIC_MIME = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


class ImageInputs(NamedTuple):
    """A prompt's images as the judge model takes them (Request.image_inputs)."""

    pixel_values: torch.Tensor  # [P, D] every patch of the prompt's images, image after image
    image_grid_thw: torch.Tensor  # [I, 3] int64 (t, h, w) patches per image


def images_of(value: Any) -> list[Any]:
    """A sample's image field as a list of images (one image, or a list of them)."""
    return list(value) if isinstance(value, list | tuple) else [value]


class ImagePrompts:
    """Expands a judge prompt's image placeholders (one image token per image, as a chat
    template writes them) into the runs of image tokens a Qwen2-VL-family engine takes."""

    def __init__(self, image_processor: Any, image_token_id: int) -> None:
        if not callable(image_processor):
            raise ValueError(
                f"image_processor={image_processor!r} is not callable; pass the judge model's "
                "image processor (AutoImageProcessor.from_pretrained(judge_model_dir))"
            )
        if isinstance(image_token_id, bool) or not isinstance(image_token_id, int):
            raise ValueError(f"image_token_id={image_token_id!r}: must be an int token id")
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge_size = int(getattr(image_processor, "merge_size", _DEFAULT_MERGE_SIZE))

    def process(self, images: Sequence[Any]) -> ImageInputs:
        """The images through the judge's image processor; ValueError for one it refuses."""
        try:
            out = self.image_processor(images=list(images), return_tensors="pt")
        except Exception as err:
            raise ValueError(
                f"the judge's image processor refused an image ({type(err).__name__}: {err})"
            ) from None
        return ImageInputs(out["pixel_values"], out["image_grid_thw"].to(torch.int64))

    def tokens_per_image(self, images: Sequence[Any]) -> list[int]:
        """Image tokens each image takes; ValueError for an image the processor refuses."""
        return self._tokens_per_image(self.process(images))

    def _tokens_per_image(self, inputs: ImageInputs) -> list[int]:
        return [int(n) // self.merge_size**2 for n in inputs.image_grid_thw.prod(-1)]

    def encode(
        self, prompt_ids: Sequence[int], images: Sequence[Any]
    ) -> tuple[list[int], ImageInputs]:
        """(`prompt_ids` with one run of image tokens per image, in order; the images as the
        judge model takes them, for Request.image_inputs). ValueError when the prompt's
        placeholders and the images differ in number."""
        token = self.image_token_id
        positions = [i for i, t in enumerate(prompt_ids) if t == token]
        if len(positions) != len(images):
            raise ValueError(
                f"the judge prompt has {len(positions)} image placeholder token(s) (id {token}) "
                f"for {len(images)} image(s); the judge tokenizer's chat template must write one "
                "image placeholder per {'type': 'image'} part"
            )
        inputs = self.process(images)
        out: list[int] = []
        previous = 0
        for position, num_tokens in zip(positions, self._tokens_per_image(inputs), strict=True):
            out.extend(prompt_ids[previous:position])
            out.extend([token] * num_tokens)
            previous = position + 1
        out.extend(prompt_ids[previous:])
        return out, inputs

    def expand(self, prompt_ids: Sequence[int], images: Sequence[Any]) -> list[int]:
        """`prompt_ids` with one run of image tokens per image (encode's ids)."""
        return self.encode(prompt_ids, images)[0]


def image_data_url(image: Any) -> str:
    """An image as a URL an OpenAI-compatible server takes: an http(s) or data: URL as it is;
    a file path, bytes or {"bytes", "path"} dict as a data URL of the file's own bytes; a PIL
    image, an HWC uint8 array or a CHW tensor as a PNG data URL. ValueError otherwise."""
    if isinstance(image, Mapping):
        # A `datasets` Image feature read without decoding.
        image = image.get("bytes") if image.get("bytes") is not None else image.get("path")
    if isinstance(image, str) and image.startswith(("http://", "https://", "data:")):
        return image
    if isinstance(image, str | Path):
        try:
            image = Path(image).expanduser().read_bytes()
        except OSError as err:
            raise ValueError(
                f"image file {str(image)!r} cannot be read ({type(err).__name__})"
            ) from None
    if isinstance(image, bytes | bytearray | memoryview):
        data = bytes(image)
        mime = next((m for magic, m in _MAGIC_MIME if data.startswith(magic)), None)
        if mime is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            mime = "image/webp"
        if mime is None:
            raise ValueError(
                f"{len(data)} bytes that are not a PNG, JPEG, GIF or WebP file; give the image "
                "as a PIL image or a file in one of these formats"
            )
        return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
    return f"data:image/png;base64,{base64.b64encode(_png_bytes(image)).decode('ascii')}"


def _png_bytes(image: Any) -> bytes:
    if image is None:
        raise ValueError("no image (None)")
    try:
        from PIL import Image
    except ImportError:
        raise ValueError(
            f"a {type(image).__name__} image needs Pillow to be sent as PNG: pip install pillow"
        ) from None
    if not isinstance(image, Image.Image):
        array = image.numpy() if hasattr(image, "numpy") else image
        shape = getattr(array, "shape", None)
        if shape is None:
            raise ValueError(
                f"a {type(image).__name__} is not an image: give a PIL image, a path, bytes, "
                "an HWC uint8 array or a CHW tensor"
            )
        if hasattr(image, "numpy") and len(shape) == 3 and shape[0] in (1, 3, 4):
            array = array.transpose(1, 2, 0)  # a CHW tensor, as image processors take them
        try:
            image = Image.fromarray(array.squeeze(-1) if array.shape[-1] == 1 else array)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"an array of shape {tuple(shape)} and dtype {array.dtype} is not an image "
                f"({err}); give HWC uint8"
            ) from None
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
