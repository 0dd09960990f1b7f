"""What a model says about images, read from its own Hugging Face config: the one place.

    model = VisionModel.of(config)                  a loaded model's config (the policy)
    model = VisionModel.from_pretrained(model_dir)  a model folder, before any weights load
    model.takes_images      a vision tower of a family yatt implements, and an image processor
    model.stop_token_ids    its vision special tokens: a response ends before one
    model.image_token_id, model.merge_size, model.patch_dim   how its images enter a prompt

A text model gives takes_images=False and no stop tokens. A model with a vision tower may sample
its vision special tokens (<|image_pad|>, <|vision_start|>, ...) in a response, but the policy
refuses an image token without its image: so the rollout stops at them and rollout_samples cuts
there, whether or not the data has images. The trainer asks this module instead of reading a
config's attribute names itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Families whose image layout, forward and rope index yatt implements (config.model_type).
VISION_LANGUAGE_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})
# A vision-language config's special tokens (the Qwen2-VL family's names; absent ones skipped).
VISION_SPECIAL_TOKEN_FIELDS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)
# The image processor transformers saves beside a vision-language model.
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def is_vision_language_config(config: Any) -> bool:
    """Whether a Hugging Face config describes a model with a vision tower."""
    return getattr(config, "vision_config", None) is not None


@dataclass(kw_only=True, frozen=True)
class VisionModel:
    """A model's vision side as its config states it; see the module docstring."""

    model_type: str
    has_vision_tower: bool
    stop_token_ids: tuple[int, ...]  # () for a text model
    has_image_processor: bool = True  # False: a folder without preprocessor_config.json
    image_token_id: int | None = None  # the rest: a family in VISION_LANGUAGE_MODEL_TYPES only
    merge_size: int | None = None  # spatial merge: merge_size**2 patches make one image token
    patch_dim: int | None = None  # D of pixel_values: channels x temporal patch x patch x patch

    @classmethod
    def of(cls, config: Any, *, has_image_processor: bool = True) -> VisionModel:
        """What `config` (a transformers PretrainedConfig) says about images."""
        model_type = str(getattr(config, "model_type", ""))
        if not is_vision_language_config(config):
            return cls(model_type=model_type, has_vision_tower=False, stop_token_ids=())
        stop_token_ids = tuple(
            int(value)
            for value in (getattr(config, name, None) for name in VISION_SPECIAL_TOKEN_FIELDS)
            if isinstance(value, int) and not isinstance(value, bool)
        )
        layout: dict[str, int] = {}
        if model_type in VISION_LANGUAGE_MODEL_TYPES:
            vision = config.vision_config
            patch = vision.patch_size
            layout = dict(
                image_token_id=int(config.image_token_id),
                merge_size=int(vision.spatial_merge_size),
                patch_dim=int(vision.in_channels * vision.temporal_patch_size * patch * patch),
            )
        return cls(
            model_type=model_type,
            has_vision_tower=True,
            stop_token_ids=stop_token_ids,
            has_image_processor=has_image_processor,
            **layout,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> VisionModel:
        """The same, from a model folder's config (AutoConfig: no weights load). A folder
        without a config.json (a tokenizer alone) states no vision tower: a text model."""
        from transformers import AutoConfig

        if Path(model_dir).is_dir() and not (Path(model_dir) / "config.json").is_file():
            return cls(model_type="", has_vision_tower=False, stop_token_ids=())
        config = AutoConfig.from_pretrained(model_dir)
        has_processor = (Path(model_dir) / IMAGE_PROCESSOR_FILE).is_file()
        return cls.of(config, has_image_processor=has_processor)

    @property
    def is_family_implemented(self) -> bool:
        return self.image_token_id is not None

    @property
    def takes_images(self) -> bool:
        """Whether prompts with images can be given to this model (see why_no_images)."""
        return self.why_no_images() is None

    def why_no_images(self) -> str | None:
        """Why this model takes no images (a sentence naming the fix), or None when it does."""
        if not self.has_vision_tower:
            return "is a text model (its config has no vision_config)"
        if not self.is_family_implemented:
            return (
                f"has a vision tower, but model_type={self.model_type!r} is not one whose images "
                f"yatt implements ({sorted(VISION_LANGUAGE_MODEL_TYPES)}); train it text-only"
            )
        if not self.has_image_processor:
            return (
                f"has no {IMAGE_PROCESSOR_FILE} (its image processor); save it beside the model "
                "(image_processor.save_pretrained(model_dir))"
            )
        return None
