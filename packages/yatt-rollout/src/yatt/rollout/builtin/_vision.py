"""Images in the built-in engine: a vision-language prefill, then text-only decoding.

    images --image processor--> pixel_values [P, D], image_grid_thw [I, 3]    per request, host
    prefill (eager): embeddings with the vision tower's features at the image tokens,
                     mrope positions from the family's get_rope_index -> [3, B, T],
                     rope_delta[b] = (largest position + 1) - prompt length
    decode (graphs): a token at cache position p takes text position p + rope_delta[slot]

Only the prefill sees images: after it, every new token is text, whose mrope position is the
same in all three components and runs on from the prompt's largest position. So the decode
step stays the captured text step, reading one more per-slot buffer (rope_delta_S). Qwen2-VL
and Qwen2.5-VL (config.model_type) are the families implemented.

A kept conversation (Request.session_id) continues with new tokens that may hold images (a
tool's picture): the continuation prefills them as a prompt of their own, eager, with the
features of the images whose runs lie in them, and shifts their mrope positions by the kept
part's next text position, start + rope_delta (get_rope_index numbers a sequence's groups on
from a running position, so a segment's positions are the whole sequence's shifted by that).
The slot's rope_delta grows by the segment's own. Positions then equal the family's
get_rope_index over the whole sequence, what the trainer's forward computes.

Request.images are raw images (PIL images, HWC uint8 arrays, CHW tensors: what the model's
image processor takes), as for the vLLM and SGLang adapters; the prompt holds each image's
placeholder run already expanded (one image token per merged patch group), as the model's
processor writes it. A request whose images already went through the processor (the trainer's
prompt encoder, a judge sizing its prompt) brings them as Request.image_inputs, and the engine
takes those instead of running the processor again. A mismatch is a ValueError naming the
request, before any device work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VISION_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})


@dataclass(kw_only=True, frozen=True)
class RequestImages:
    """One request's images as the model takes them."""

    pixel_values: torch.Tensor  # [P, D] float32: every patch of the request's images in order
    image_grid_thw: torch.Tensor  # [I, 3] int64: (t, h, w) patches per image


def is_vision_language_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


class VisionPrefill:
    """The vision side of a served Qwen2-VL-family model: encodes requests' images on the host
    and builds a prefill's embeddings and mrope positions."""

    def __init__(self, model: torch.nn.Module, image_processor: Any) -> None:
        config = model.config
        if config.model_type not in VISION_MODEL_TYPES:
            raise ValueError(
                f"model_type={config.model_type!r} has a vision tower, but the built-in engine "
                f"implements images for {sorted(VISION_MODEL_TYPES)} only; serve it with the "
                "vLLM or SGLang engine"
            )
        if image_processor is None:
            raise ValueError(
                "a vision-language model needs its image processor: pass image_processor=..., or "
                "a model directory holding preprocessor_config.json"
            )
        self.image_processor = image_processor
        self.image_token_id = int(config.image_token_id)
        vision = config.vision_config
        self.merge_size = int(vision.spatial_merge_size)
        # D of pixel_values: channels x temporal patch x patch x patch
        self.patch_dim = int(vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)

    @staticmethod
    def load_image_processor(path: Path) -> Any:
        """The image processor saved beside the model, or None without one."""
        if not (path / "preprocessor_config.json").is_file():
            return None
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(path)

    # -- host side, per request -----------------------------------------------------------------

    def process(self, images: Sequence[Any]) -> RequestImages:
        """One request's images through the image processor (ValueError for one it refuses)."""
        try:
            out = self.image_processor(images=list(images), return_tensors="pt")
        except (ValueError, TypeError, OSError) as err:
            raise ValueError(f"the image processor refused an image: {err}") from err
        return RequestImages(
            pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"].to(torch.int64)
        )

    def encode(
        self,
        index: int,
        prompt_ids: Sequence[int],
        images: Sequence[Any] | None,
        image_inputs: Any = None,
    ) -> RequestImages | None:
        """The request's images (None without any), checked against its prompt's image tokens
        (ValueError naming requests[index] on a mismatch or an image the processor refuses).
        `image_inputs` (Request.image_inputs) are taken as they are; else `images` are
        processed here."""
        if image_inputs is not None:
            processed = self._taken(index, image_inputs)
        elif images:
            try:
                processed = self.process(images)
            except ValueError as err:
                raise ValueError(f"requests[{index}].images: {err}") from err
        else:
            if runs := _runs(prompt_ids, self.image_token_id):
                raise ValueError(
                    f"requests[{index}].prompt_ids has image token runs {runs} but no images; "
                    "pass the images in Request.images"
                )
            return None
        grid = processed.image_grid_thw
        wanted = [int(n) // self.merge_size**2 for n in grid.prod(-1)]
        runs = _runs(prompt_ids, self.image_token_id)
        if runs != wanted:
            raise ValueError(
                f"requests[{index}]: the prompt's image token runs are {runs} long, but its "
                f"{len(wanted)} image(s) take {wanted} tokens; expand one placeholder per image "
                "with the model's processor (yatt.core.encode_vision_prompt)"
            )
        return processed

    def tail(
        self, images: RequestImages | None, prompt_ids: Sequence[int], start: int
    ) -> RequestImages | None:
        """The images whose token runs lie in prompt_ids[start:] (None: none do); the runs
        before `start` are whole (a kept part ends on a text token)."""
        if images is None:
            return None
        num_before = len(_runs(prompt_ids[:start], self.image_token_id))
        grid = images.image_grid_thw
        if num_before >= grid.shape[0]:
            return None
        first_patch = int(grid[:num_before].prod(-1).sum())
        return RequestImages(
            pixel_values=images.pixel_values[first_patch:], image_grid_thw=grid[num_before:]
        )

    def head_matches(
        self, kept: RequestImages | None, images: RequestImages | None, kept_ids: Sequence[int]
    ) -> bool:
        """Whether `images` (a new turn's) begin with `kept` (those of the KV kept for its
        session), as many as kept_ids has image runs: the kept KV holds those images' features,
        and image tokens alone do not say which image they were."""
        num_kept = len(_runs(kept_ids, self.image_token_id))
        if num_kept == 0:
            return True
        if kept is None or images is None or kept.image_grid_thw.shape[0] != num_kept:
            return False
        if images.image_grid_thw.shape[0] < num_kept:
            return False
        if not torch.equal(images.image_grid_thw[:num_kept], kept.image_grid_thw):
            return False
        num_patches = kept.pixel_values.shape[0]
        return images.pixel_values.shape[0] >= num_patches and torch.equal(
            images.pixel_values[:num_patches], kept.pixel_values
        )

    def _taken(self, index: int, image_inputs: Any) -> RequestImages:
        """Request.image_inputs as RequestImages, their shapes checked against the model."""
        pixels = getattr(image_inputs, "pixel_values", None)
        grid = getattr(image_inputs, "image_grid_thw", None)
        if not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor):
            raise ValueError(
                f"requests[{index}].image_inputs={type(image_inputs).__name__}: give an object "
                "with pixel_values and image_grid_thw tensors (a yatt.core.VisionInputs)"
            )
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
            raise ValueError(
                f"requests[{index}].image_inputs.image_grid_thw has shape {tuple(grid.shape)}; "
                "need [num_images >= 1, 3]"
            )
        num_patches = int(grid.prod(-1).sum())
        if tuple(pixels.shape) != (num_patches, self.patch_dim):
            raise ValueError(
                f"requests[{index}].image_inputs.pixel_values has shape {tuple(pixels.shape)}; "
                f"the grid says [{num_patches}, {self.patch_dim}] (process the images with this "
                "model's image processor)"
            )
        return RequestImages(pixel_values=pixels, image_grid_thw=grid.to(torch.int64))

    # -- device side, per prefill ---------------------------------------------------------------

    def embed(
        self,
        model: torch.nn.Module,
        ids_BT: torch.Tensor,
        pad_B: torch.Tensor,
        images: Sequence[RequestImages | None],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs_embeds [B, T, H], mrope position ids [3, B, T], rope_delta [B]) of a
        left-padded prefill whose row b holds `images[b]` (None: a text row)."""
        device = ids_BT.device
        embeds_BTH = model.get_input_embeddings()(ids_BT)
        present = [im for im in images if im is not None]
        if not present:
            positions = torch.arange(ids_BT.shape[1], device=device)[None, :] - pad_B[:, None]
            positions = positions.clamp(min=0)
            return embeds_BTH, positions.expand(3, -1, -1), torch.zeros_like(pad_B)
        pixels = torch.cat([im.pixel_values for im in present]).to(device)
        grid = torch.cat([im.image_grid_thw for im in present]).to(device)
        features = model.model.get_image_features(pixels, grid, return_dict=True).pooler_output
        features = torch.cat(list(features)).to(embeds_BTH.dtype)
        is_image_BT = ids_BT == self.image_token_id
        # Rows are in request order and a row's image tokens in image order: the features'
        # order. Padding holds token 0, never the image token.
        embeds_BTH = embeds_BTH.masked_scatter(is_image_BT[..., None], features)
        mask_BT = torch.arange(ids_BT.shape[1], device=device)[None, :] >= pad_B[:, None]
        positions, deltas = model.model.get_rope_index(
            ids_BT,
            mm_token_type_ids=is_image_BT.to(torch.int32),
            image_grid_thw=grid,
            attention_mask=mask_BT.long(),
        )
        return embeds_BTH, positions, deltas.reshape(-1).to(torch.long)


def _runs(ids: Sequence[int], token: int) -> list[int]:
    """Lengths of the runs of `token` in `ids`, in order."""
    runs: list[int] = []
    previous = None
    for t in ids:
        if t == token:
            if previous == token:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = t
    return runs
