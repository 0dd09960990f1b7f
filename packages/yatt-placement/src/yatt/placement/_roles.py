"""Roles: the things a placement plan puts to sleep and wakes up.

A role is any object with `sleep()` and `wake_up(tags=None)`. Optional members let a plan
do more with it:

- `memory_tags`: the tags `wake_up` understands, e.g. ("weights", "kv_cache"). A plan wakes
  its roles in stages (all weights, then all KV caches) so the peak never holds a KV cache
  next to weights still arriving. A role without it is woken with one `wake_up()`.
- `resident_bytes()`: bytes it holds on its device now; the plan's metrics use it when no
  device-wide reading exists (CPU).
- `set_memory_fraction(fraction)`: the share of device memory the role may use, which partial
  colocation moves every step. The role applies it when it next sizes its KV cache.
  `resizes_while_awake = True` says it does so by itself while awake (at its next call), so
  offload="auto" need not put it to sleep to apply a new share.

- `memory_regions`: the process-wide region tags its memory lives in. Regions are paused by
  name, so two roles sharing one would sleep each other: a plan refuses that at construction.

Each optional member is a protocol in `_capabilities` (MemoryTagged, MeasuresResidentBytes,
ResizableMemory, ResizesWhileAwake, InMemoryRegions, ReportsMemoryNeed, ReportsHostNeed) that a
plan checks with isinstance. The rollout and GenRM engines implement these themselves; `TrainerRole` and `RegionRole` adapt
a trainer and region-allocated memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from yatt.placement._needs import HostNeed, MemoryNeed
from yatt.placement._offload import (
    host_bytes_of,
    is_offloaded,
    offload_all,
    offloaded_bytes,
    onload,
    pinned_host_bytes,
    tensor_bytes,
)
from yatt.placement._offload_dtensor import local_tensor, moves_by_to
from yatt.placement._regions import backup_bytes, pause, resident_bytes, resume

# Optimizer state per trainable parameter byte, for the classes whose state is known before
# their first step creates it (Adam and AdamW: two moments of the parameter's dtype).
_STATE_PER_PARAM_BYTE = {torch.optim.Adam: 2, torch.optim.AdamW: 2}


@runtime_checkable
class Role(Protocol):
    """What a plan requires of a role."""

    def sleep(self) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...


def _check_tags(owner: str, tags: Sequence[str] | None, known: Sequence[str]) -> tuple[str, ...]:
    if tags is None:
        return tuple(known)
    if isinstance(tags, str):
        raise ValueError(f"{owner}.wake_up(tags={tags!r}) takes a sequence; pass ({tags!r},)")
    unknown = [tag for tag in tags if tag not in known]
    if unknown:
        raise ValueError(f"{owner}.wake_up(tags={tags!r}): {unknown} not in memory_tags={known}")
    return tuple(tags)


class TrainerRole:
    """A model and its optimizer as a role: sleep offloads them to host, wake_up onloads.

    memory_tags: "weights" (parameters, gradients, buffers) and "optimizer" (optimizer state), so
    a weight-sync phase can wake the weights without the optimizer state.
    """

    memory_tags: tuple[str, ...] = ("weights", "optimizer")

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        activation_bytes: int | Callable[[], int] | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        """activation_bytes: the train phase's activation peak (bytes, or a function giving
        them); given, the role reports `memory_need()`. settings: part -> the setting that
        shrinks it ("activations", "weights", ...), for a plan's errors."""
        self.model = model
        self.optimizer = optimizer
        self.activation_bytes = activation_bytes
        self.settings = dict(settings or {})
        # Read now, while the model is onloaded (an offloaded CUDA tensor is a placeholder).
        params = list(model.parameters())
        self._weight_bytes = sum(_local_bytes(t) for t in [*params, *model.buffers()])
        self._trainable_bytes = sum(_local_bytes(p) for p in params if p.requires_grad)
        # What its offload will hold on the host (gradients, absent when asleep, left out).
        self._weight_host_bytes = (
            self._weight_bytes
            if moves_by_to(model)
            else pinned_host_bytes([_local_bytes(t) for t in [*params, *model.buffers()]])
        )

    def _parts(self, tags: Sequence[str]) -> list[torch.nn.Module | torch.optim.Optimizer]:
        parts: list[torch.nn.Module | torch.optim.Optimizer] = []
        if "weights" in tags:
            parts.append(self.model)
        if "optimizer" in tags and self.optimizer is not None:
            parts.append(self.optimizer)
        return parts

    def sleep(self) -> None:
        # One empty_cache after the last part instead of one per part.
        offload_all([part for part in self._parts(self.memory_tags) if not is_offloaded(part)])

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        for part in self._parts(_check_tags("TrainerRole", tags, self.memory_tags)):
            if is_offloaded(part):
                onload(part)

    def resident_bytes(self) -> int:
        parts = self._parts(self.memory_tags)
        return sum(tensor_bytes(part) for part in parts if not is_offloaded(part))

    def optimizer_state_bytes(self) -> int:
        """The optimizer's state, wherever it is; before its first step (no state yet), what
        Adam or AdamW will make (two moments per trainable parameter), 0 for other classes."""
        if self.optimizer is None:
            return 0
        # An optimizer put to sleep before its first step is offloaded with nothing in it: its
        # state is still to come, not 0 (issue 27: a 7B trainer's 57 GiB of AdamW state went
        # uncounted, so "auto" kept the judge awake and the first optimizer step ran out).
        made = offloaded_bytes(self.optimizer) if is_offloaded(self.optimizer) else 0
        made = made or tensor_bytes(self.optimizer)
        if made:
            return made
        per_byte = next(
            (n for cls, n in _STATE_PER_PARAM_BYTE.items() if type(self.optimizer) is cls), 0
        )
        return per_byte * self._trainable_bytes

    def host_need(self) -> HostNeed:
        """Host memory while asleep: the weights' and the optimizer state's offloaded copies as
        offload packs them (`host_bytes_of`); before the first step, the state Adam or AdamW
        will make (two moments and a float32 step count per trainable parameter, packed
        alike)."""
        optimizer = 0
        if self.optimizer is not None:
            optimizer = host_bytes_of(self.optimizer)
            if not optimizer and not tensor_bytes(self.optimizer):
                per_byte = _STATE_PER_PARAM_BYTE.get(type(self.optimizer), 0)
                sizes = [
                    _local_bytes(p)
                    for group in self.optimizer.param_groups
                    for p in group["params"]
                    if p.requires_grad
                ]
                steps = [4] * len(sizes) if per_byte else []
                optimizer = (
                    per_byte * sum(sizes) + sum(steps)
                    if moves_by_to(self.optimizer)
                    else pinned_host_bytes(sizes * per_byte + steps)
                )
        return HostNeed(
            parts={"weights": self._weight_host_bytes, "optimizer": optimizer},
            settings=self.settings,
        )

    def memory_need(self) -> MemoryNeed | None:
        """Weights and optimizer state resident; at the train step's peak, the gradients and the
        larger of the activations and the optimizer step's temporaries (a multi-tensor AdamW
        step makes about one parameter-sized copy). None without `activation_bytes`."""
        if self.activation_bytes is None:
            return None
        activations = (
            self.activation_bytes() if callable(self.activation_bytes) else self.activation_bytes
        )
        peak = {}
        if self.optimizer is not None:
            peak["gradients"] = self._trainable_bytes
            step_bytes = self._trainable_bytes
            peak |= (
                {"activations": int(activations)}
                if activations >= step_bytes
                else {"optimizer step": step_bytes}
            )
        else:  # a frozen reference: forward only
            peak["activations"] = int(activations)
        return MemoryNeed(
            resident={"weights": self._weight_bytes, "optimizer": self.optimizer_state_bytes()},
            peak=peak,
            settings=self.settings,
        )


def _local_bytes(tensor: torch.Tensor) -> int:
    """A tensor's bytes on this rank (an FSDP2 DTensor's local shard)."""
    return local_tensor(tensor).nbytes


class RegionRole:
    """Memory allocated in regions as a role: sleep pauses the tags, wake_up resumes them.

    tags maps a role's memory tag to its region tags, e.g.
    {"weights": ("judge/weights",), "kv_cache": ("judge/kv_cache",)}; the keys, in order,
    are its memory_tags. A role for a built-in engine, or for a test.
    """

    def __init__(self, tags: Mapping[str, Sequence[str]]) -> None:
        if not tags:
            raise ValueError("RegionRole(tags={}) needs at least one memory tag")
        for name, regions in tags.items():
            if isinstance(regions, str) or not regions:
                raise ValueError(
                    f"RegionRole(tags[{name!r}]={regions!r}) must be a non-empty sequence of "
                    f"region tags, e.g. ({name!r},)"
                )
        self._regions = {name: tuple(regions) for name, regions in tags.items()}
        self.memory_tags: tuple[str, ...] = tuple(self._regions)
        self.memory_regions: tuple[str, ...] = tuple(
            region for regions in self._regions.values() for region in regions
        )
        self._asleep: set[str] = set()

    def sleep(self) -> None:
        # KV cache first, weights last: the reverse of waking.
        for name in reversed(self.memory_tags):
            if name not in self._asleep:
                pause(*self._regions[name])
                self._asleep.add(name)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        for name in _check_tags("RegionRole", tags, self.memory_tags):
            if name in self._asleep:
                resume(*self._regions[name])
                self._asleep.discard(name)

    def resident_bytes(self) -> int:
        return sum(resident_bytes(tag) for regions in self._regions.values() for tag in regions)

    def host_need(self) -> HostNeed:
        """Host memory while asleep: the tags with CPU backup (per memory tag)."""
        return HostNeed(
            parts={
                name: sum(backup_bytes(tag) for tag in regions)
                for name, regions in self._regions.items()
            }
        )
