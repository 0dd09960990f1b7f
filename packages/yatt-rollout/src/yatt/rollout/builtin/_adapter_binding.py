"""A LoRA adapter bound to a beside-mode engine: each step's sync is a few multi-tensor copies.

    binding = engine.bind_adapter(policy.named_adapter_weights(live=True))  # loads it, once
    ...train step (the optimizer updates the adapter's parameters in place)...
    binding.refresh()                                                       # the sync

A colocated trainer's adapter lives in the engine's process, on its device. update_weights
walks the adapter tensor by tensor (names, bucketing, per-module checks: ~100 us of host work
for each of a 7B's ~600 tensors, 60 ms, against 25 ms for a full sync's single device copy);
a binding does that walk once and keeps, per target module, the engine's buffers (A, sB) and
the trainer's parameters (A, B) with its scaling. refresh() is then

    A_k, sB_k <- A_k', B_k'      one _foreach_copy_ over every module (cast to the served dtype)
    sB_k      *= scaling_k       one _foreach_mul_, in place

exactly what update_weights computes for an adapter already loaded at that rank (scaling_k * B_k'
in float32, rounded once) when every scaling is a power of two (PEFT's alpha / rank usually is)
and the buffers are bfloat16 or float32: such a product only shifts exponents, so casting first
rounds alike (float16's subnormals, below 6e-5, would not). Otherwise scaling * B goes through
float32 buffers made at the first refresh. No temporaries: their allocation (one per module) was
most of a refresh's time, 1.15 of 1.8 ms of host time for a 7B adapter, where the same copies
cast then scaled in place took 0.27 ms (bench/results/refresh_nvidia_h200.md).

The parameters are held as objects (not views): a trainer that offloads and re-onloads them
(new storage) is read where they are now; refresh() re-checks their shapes and devices only
when an address changed. An update_weights call after the binding, a rank re-made or the
weights lost in a sleep make refresh() raise: bind again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class BoundCopies:
    """The copies of one refresh: destinations (engine buffers, views of the first `rank`
    rows / columns when the buffers are larger) and sources (the trainer's tensors)."""

    A_dst: list[torch.Tensor] = field(default_factory=list)
    A_src: list[torch.Tensor] = field(default_factory=list)
    sB_dst: list[torch.Tensor] = field(default_factory=list)
    B_src: list[torch.Tensor] = field(default_factory=list)
    scalings: list[float] = field(default_factory=list)
    saved_dst: list[torch.Tensor] = field(default_factory=list)
    saved_src: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # per source, in source order (errors)
    # Whether sB can be scaled in place (decided at the first copy), else float32 scaling * B
    _in_place: bool | None = field(default=None, repr=False)
    _scaled_B: list[torch.Tensor] | None = field(default=None, repr=False)

    @property
    def sources(self) -> list[torch.Tensor]:
        return [*self.A_src, *self.B_src, *self.saved_src]

    @property
    def destinations(self) -> list[torch.Tensor]:
        return [*self.A_dst, *self.sB_dst, *self.saved_dst]

    def check(self) -> None:
        """ValueError when a source no longer fits its buffer (shape) or is on another device
        (an offload placeholder, a parameter moved away)."""
        for name, src, dst in zip(self.names, self.sources, self.destinations, strict=True):
            if tuple(src.shape) != tuple(dst.shape) or src.device != dst.device:
                raise ValueError(
                    f"AdapterBinding.refresh: {name!r} is now {tuple(src.shape)} on "
                    f"{src.device}; the engine's buffer is {tuple(dst.shape)} on {dst.device} "
                    "(an offloaded parameter: onload it first; a new adapter rank: bind again)"
                )

    @torch.no_grad()
    def copy(self) -> None:
        if self._in_place is None:
            self._in_place = can_scale_in_place(self.scalings, self.sB_dst)
        if self._in_place:
            torch._foreach_copy_([*self.A_dst, *self.sB_dst], [*self.A_src, *self.B_src])
            torch._foreach_mul_(self.sB_dst, self.scalings)
        else:  # scaling * B in float32, rounded once by the copy (update_weights too)
            torch._foreach_copy_(self.A_dst, self.A_src)
            if self._scaled_B is None:
                self._scaled_B = [torch.empty_like(b, dtype=torch.float32) for b in self.sB_dst]
            torch._foreach_copy_(self._scaled_B, self.B_src)
            torch._foreach_mul_(self._scaled_B, self.scalings)
            torch._foreach_copy_(self.sB_dst, self._scaled_B)
        if self.saved_dst:
            torch._foreach_copy_(self.saved_dst, self.saved_src)


def can_scale_in_place(scalings: list[float], buffers: list[torch.Tensor]) -> bool:
    """Whether B cast into `buffers` then multiplied there by its scaling gives exactly
    scaling * B in float32 rounded once: every scaling a power of two (an exponent shift,
    nothing rounded) and buffers of float32's exponent range (bfloat16, float32; float16's
    subnormals, below 6e-5, would be rounded coarser by the cast)."""
    return all(map(_is_power_of_two, scalings)) and all(
        b.dtype in (torch.bfloat16, torch.float32) for b in buffers
    )


def _is_power_of_two(x: float) -> bool:
    """x = 2^k (k of either sign): multiplying by it shifts exponents and rounds nothing."""
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


class AdapterBinding:
    """A LoRA adapter bound to a BuiltinEngine (lora_mode="beside"): refresh() copies the bound
    tensors' current values into the engine's buffers. Made by BuiltinEngine.bind_adapter."""

    def __init__(self, engine, copies: BoundCopies, version: int) -> None:
        self._engine = engine
        self._copies = copies
        self._version = version  # the engine's weights version it was bound at
        self._sources = copies.sources  # built once: refresh reads their addresses each step
        self._addresses = [t.data_ptr() for t in self._sources]
        self.num_tensors = len(copies.names)

    @property
    def version(self) -> int:
        return self._version

    def refresh(self) -> None:
        """The sync: the bound parameters' values into the engine (under its lock; the device
        synchronised after, as update_weights does). ValueError when the binding is stale."""
        self._engine._refresh_binding(self)

    def _copy(self) -> None:
        addresses = [t.data_ptr() for t in self._sources]
        if addresses != self._addresses:  # moved (offloaded and back): fit where they are now
            self._copies.check()
            self._addresses = addresses
        self._copies.copy()
