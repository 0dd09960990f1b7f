"""The vision tower's share of a sample's compute, from the tower's shape.

    shape = vision_flops_shape(config.vision_config, is_gated_mlp=...)   once, at build
    costs = estimate_vision_costs(image_patches, shape)                   per sample

A sample's image tokens are already in its length, so the language model's cost counts them;
what the length misses is the vision tower, which runs over every patch (merge_size**2
patches per image token) with attention within each image. Each image is costed as one
sequence of its patches through yatt.balance.flops_cost with the tower's shape (no LM head).
flops_cost's attention term is causal; the tower attends both ways, about twice that term,
which only matters for images of thousands of patches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from yatt.core.cost._cost_model import estimate_flops_costs, flops_shape


def vision_flops_shape(vision_config: Any, *, is_gated_mlp: bool) -> dict[str, Any] | None:
    """`flops_shape` of a Qwen2-VL-family vision tower (None without a width and a depth).

    Qwen2-VL names its width embed_dim (its hidden_size is the LM's, the merger's output) and
    its MLP width mlp_ratio x embed_dim; Qwen2.5-VL names them hidden_size and intermediate_size.
    """
    width = getattr(vision_config, "embed_dim", None) or getattr(vision_config, "hidden_size", None)
    ffn = getattr(vision_config, "intermediate_size", None)
    ratio = getattr(vision_config, "mlp_ratio", None)
    if ffn is None and isinstance(width, int) and isinstance(ratio, int | float):
        ffn = int(width * ratio)
    return flops_shape(
        hidden_size=width,
        num_layers=getattr(vision_config, "depth", None),
        ffn_hidden_size=ffn,
        num_heads=getattr(vision_config, "num_heads", None),
        is_gated_mlp=is_gated_mlp,
    )


def estimate_vision_costs(
    image_patches: Sequence[Sequence[int]], shape: dict[str, Any] | None
) -> list[float]:
    """Per sample, the tower's forward FLOPs over its images (`image_patches[i]`: the patch
    count of each image of sample i; empty for a text-only sample)."""
    flat = [n for patches in image_patches for n in patches]
    per_image = iter(estimate_flops_costs(flat, shape) if flat else [])
    return [float(sum(next(per_image) for _ in patches)) for patches in image_patches]
