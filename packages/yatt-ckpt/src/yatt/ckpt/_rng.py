"""Capture and restore the process's random number generators as JSON-able data.

Each rank saves its own generators (python `random`, numpy's global generator when numpy is
installed, torch CPU, and every CUDA device when CUDA is initialized), so a resumed run draws the
same dropout masks and data order as an uninterrupted one. JSON instead of pickle keeps the
checkpoint readable without executing code.
"""

from __future__ import annotations

import base64
import random
import warnings
from typing import Any

import torch

try:  # numpy is optional: torch does not require it.
    import numpy as np
except ImportError:  # pragma: no cover - depends on the environment
    np = None


def _bytes_tensor_to_str(state: torch.Tensor) -> str:
    return base64.b64encode(bytes(state.cpu().tolist())).decode()


def _str_to_bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states, as plain JSON-able values."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss]}
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    state["torch"] = _bytes_tensor_to_str(torch.get_rng_state())
    # Only when CUDA is already in use: asking an idle process for CUDA state would create a
    # CUDA context on every device just to save generators nobody has drawn from.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes_tensor_to_str(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any], *, source: str) -> None:
    """Set this process's generators from `capture_rng_state()` output; `source` names it in warnings."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        if np is None:
            warnings.warn(
                f"{source}: numpy RNG state saved but numpy is not installed; skipped", stacklevel=2
            )
        else:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_str_to_bytes_tensor(state["torch"]))
    saved_cuda = state.get("cuda")
    if saved_cuda is None:
        return
    if not torch.cuda.is_available():
        warnings.warn(
            f"{source}: CUDA RNG state saved but CUDA is unavailable; skipped", stacklevel=2
        )
        return
    num_devices = torch.cuda.device_count()
    if num_devices != len(saved_cuda):
        warnings.warn(
            f"{source}: CUDA RNG saved for {len(saved_cuda)} devices, this process sees "
            f"{num_devices}; restoring the first {min(num_devices, len(saved_cuda))}",
            stacklevel=2,
        )
    for device, text in enumerate(saved_cuda[:num_devices]):
        torch.cuda.set_rng_state(_str_to_bytes_tensor(text), device)
