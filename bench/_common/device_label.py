"""The label a benchmark's result files carry for this machine's accelerator."""

from __future__ import annotations


def device_name() -> str:
    """ "nvidia_h200"-style label of this machine's accelerator, or "cpu"."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    for key in ("h200", "h100", "a100"):
        if key in name:
            return f"nvidia_{key}"
    return "cuda"
