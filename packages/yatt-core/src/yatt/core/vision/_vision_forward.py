"""The forward of a vision-language policy (Qwen2-VL family) over one micro-batch.

    vision = VisionLanguage.of(model)                 None for a text-only model
    pixels, grid = vision.concat(mb[VISION_INPUTS_KEY])    the micro-batch's images, sample order
    with vision.forward_with_images(model, pixels, grid, input_ids, attention_mask):
        out = wrapper(input_ids=..., attention_mask=...)   through DDP / FSDP2 as today

While the context is open, the model's forward (an instance attribute, like _head_logprobs'
head swap, so DDP's and FSDP2's hooks around it stay as they are) does what the family's
forward does, with two differences:
  - positions: mrope position ids from the family's own `get_rope_index` on the right-padded
    batch, computed on every call (HF keeps a `rope_deltas` state between calls; not here);
  - a micro-batch without images runs the vision tower on one dummy image and adds its output
    times 0: every rank then runs the tower in every micro-batch (FSDP2 all-gathers its
    blocks in their forward, so a rank that skipped it would leave the others waiting), and a
    trainable tower gets a (zero) gradient everywhere, as DDP's reducer expects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from yatt.core.vision._vision_inputs import VisionInputs
from yatt.core.vision._vision_model import (
    VISION_LANGUAGE_MODEL_TYPES,
    VisionModel,
    is_vision_language_config,
)

__all__ = ["VisionLanguage", "is_vision_language_config"]


@dataclass(kw_only=True, frozen=True)
class VisionLanguage:
    """What the policy needs to know of a Qwen2-VL-family model's vision side."""

    image_token_id: int
    merge_size: int  # spatial merge: merge_size**2 patches make one image token
    patch_dim: int  # D of pixel_values: channels x temporal patch x patch x patch
    stop_token_ids: tuple[int, ...] = ()  # vision special tokens: a response ends before one

    @classmethod
    def of(cls, model: torch.nn.Module) -> VisionLanguage | None:
        """The model's vision side, or None for a text-only model. ValueError for a
        multimodal family this module does not implement."""
        vision = VisionModel.of(model.config)
        if not vision.has_vision_tower:
            return None
        if not vision.is_family_implemented:
            raise ValueError(
                f"model_type={vision.model_type!r} has a vision tower, but TorchPolicy "
                f"implements images for {sorted(VISION_LANGUAGE_MODEL_TYPES)} only; train it "
                "text-only from its language model, or add the family to yatt.core.vision"
            )
        assert vision.merge_size is not None and vision.patch_dim is not None
        return cls(
            image_token_id=vision.image_token_id,
            merge_size=vision.merge_size,
            patch_dim=vision.patch_dim,
            stop_token_ids=vision.stop_token_ids,
        )

    # -- inputs ---------------------------------------------------------------------------------

    def check_sample(self, input_ids: torch.Tensor, vision: VisionInputs | None) -> str | None:
        """Why one sample's tokens and images do not fit together, or None when they do."""
        num_tokens = _count_image_tokens(input_ids, self.image_token_id)
        if vision is None:
            if num_tokens:
                return f"{num_tokens} image tokens but no images (vision_inputs is None)"
            return None
        if not isinstance(vision, VisionInputs):
            return f"vision_inputs is a {type(vision).__name__}, not a yatt.core.VisionInputs"
        pixels, grid = vision
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
            return f"image_grid_thw has shape {tuple(grid.shape)}; need [num_images >= 1, 3]"
        if pixels.dim() != 2 or pixels.shape[1] != self.patch_dim:
            return (
                f"pixel_values has shape {tuple(pixels.shape)}; need [patches, {self.patch_dim}] "
                "(encode the images with this model's image processor)"
            )
        num_patches = int(grid.prod(-1).sum())
        if pixels.shape[0] != num_patches:
            return f"pixel_values has {pixels.shape[0]} patches; image_grid_thw says {num_patches}"
        wanted = num_patches // self.merge_size**2
        if num_tokens != wanted:
            return (
                f"{num_tokens} image tokens for {grid.shape[0]} image(s) that take {wanted}; expand "
                "the prompt's image placeholders for these images (yatt.core.encode_vision_prompt)"
            )
        return None

    def concat(
        self, samples: Sequence[VisionInputs | None]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The micro-batch's pixel_values and image_grid_thw, images in sample order (None, None
        when no sample has images)."""
        present = [v for v in samples if v is not None]
        if not present:
            return None, None
        pixels = torch.cat([v.pixel_values for v in present])
        grid = torch.cat([v.image_grid_thw for v in present])
        return pixels, grid

    # -- forward --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def forward_with_images(
        self,
        model: torch.nn.Module,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
    ) -> Iterator[None]:
        """While open, `model(input_ids=..., attention_mask=...)` sees these images (see the
        module docstring); the call's input_ids are right-padded [B, T]."""
        family_forward = type(model).forward

        def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any):
            position_ids = self.position_ids(model, input_ids, attention_mask, image_grid_thw)
            if pixel_values is not None:
                return family_forward(
                    model,
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    pixel_values=pixel_values,
                    image_grid_thw=image_grid_thw,
                    **kwargs,
                )
            embeds = model.get_input_embeddings()(input_ids)
            embeds = embeds + 0.0 * self._dummy_image_sum(model, embeds)
            return family_forward(
                model,
                inputs_embeds=embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **kwargs,
            )

        model.forward = forward  # an instance attribute: hooks and parameter names unchanged
        try:
            yield
        finally:
            del model.forward

    def position_ids(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_grid_thw: torch.Tensor | None,
    ) -> torch.Tensor:
        """[3, B, T] mrope positions (time, height, width) of a right-padded batch."""
        if image_grid_thw is None:
            # Text only: the three components are the token's index, as the family does.
            positions_BT = torch.arange(input_ids.shape[1], device=input_ids.device)
            return positions_BT.expand(3, *input_ids.shape)
        token_types = (input_ids == self.image_token_id).to(torch.int32)
        # A host sync per sample (the family walks each sample's token groups in Python).
        positions, _ = model.model.get_rope_index(
            input_ids,
            mm_token_type_ids=token_types,
            image_grid_thw=image_grid_thw.to(input_ids.device),
            attention_mask=attention_mask,
        )
        return positions

    def _dummy_image_sum(self, model: torch.nn.Module, like: torch.Tensor) -> torch.Tensor:
        """The vision tower's output summed, for one image of merge_size x merge_size patches."""
        side = self.merge_size
        pixels = torch.zeros(side * side, self.patch_dim, device=like.device, dtype=torch.float32)
        grid = torch.tensor([[1, side, side]], device=like.device)
        features = model.model.get_image_features(pixels, grid, return_dict=True).pooler_output
        return sum(f.sum() for f in features).to(like.dtype)


def _count_image_tokens(input_ids: torch.Tensor, image_token_id: int) -> int:
    return int((input_ids == image_token_id).sum())
