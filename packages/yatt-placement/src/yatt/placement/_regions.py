"""Memory regions: allocations made under a tag can later be paused (memory released) and resumed.

    with region("rollout/weights", enable_cpu_backup=True):
        weights = torch.empty(n, device="cuda")      # belongs to the tag
    pause("rollout/weights")                         # physical memory released, address kept
    resume("rollout/weights")                        # memory back, contents restored from CPU

On CUDA the work is done by torch_memory_saver (hook_mode="torch" by default: no LD_PRELOAD);
elsewhere a bookkeeping backend applies the same rules and frees nothing. The process has one
registry, as torch_memory_saver itself is one per process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from yatt.placement._backends import (
    CpuBookkeepingBackend,
    HookMode,
    RegionBackend,
    TorchMemorySaverBackend,
)

BackendName = Literal["auto", "cuda", "cpu"]


@dataclass(kw_only=True)
class _TagState:
    enable_cpu_backup: bool
    is_paused: bool = False
    is_released: bool = False  # its owner is gone: the next region() may resume it
    num_open_regions: int = 0


class _Registry:
    """Tags, their pause state and the rules; the backend does the memory work."""

    def __init__(self, backend: RegionBackend | None = None) -> None:
        self._backend = backend
        self._settings: tuple[str, str, bool | None] = ("auto", "torch", None)
        self._tags: dict[str, _TagState] = {}

    def configure(
        self, backend: BackendName, hook_mode: HookMode, retain_cpu_backup: bool | None = None
    ) -> None:
        if backend not in ("auto", "cuda", "cpu"):
            raise ValueError(f"backend={backend!r} is not known; use 'auto', 'cuda' or 'cpu'")
        if hook_mode not in ("torch", "preload"):
            raise ValueError(f"hook_mode={hook_mode!r} is not known; use 'torch' or 'preload'")
        if retain_cpu_backup is not None and not isinstance(retain_cpu_backup, bool):
            raise ValueError(
                f"retain_cpu_backup={retain_cpu_backup!r} must be True, False or None (default)"
            )
        settings = (backend, hook_mode, retain_cpu_backup)
        if self._backend is not None and settings != self._settings:
            raise RuntimeError(
                f"memory regions already use backend {self._backend.name!r} with settings "
                f"{self._settings}; call configure_regions() before the first region()"
            )
        self._settings = settings

    def backend(self) -> RegionBackend:
        if self._backend is None:
            name, hook_mode, retain_cpu_backup = self._settings
            if name == "auto":
                name = "cuda" if torch.cuda.is_available() else "cpu"
            if name == "cuda":
                self._backend = TorchMemorySaverBackend(hook_mode, retain_cpu_backup)
            else:
                self._backend = CpuBookkeepingBackend()
        return self._backend

    def _state(self, tag: str) -> _TagState:
        if tag not in self._tags:
            raise ValueError(
                f"tag={tag!r} has no region; known tags are {sorted(self._tags)}; "
                f"allocate under `with region({tag!r}):` first"
            )
        return self._tags[tag]

    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool) -> Iterator[None]:
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag={tag!r} must be a non-empty string, e.g. 'rollout/kv_cache'")
        state = self._tags.get(tag)
        if state is None:
            state = self._tags[tag] = _TagState(enable_cpu_backup=enable_cpu_backup)
        elif state.enable_cpu_backup != enable_cpu_backup:
            raise ValueError(
                f"region(tag={tag!r}) was first opened with enable_cpu_backup="
                f"{state.enable_cpu_backup}, now {enable_cpu_backup}; CPU backup is chosen once "
                "per tag: pass the same value or use another tag"
            )
        if state.is_paused and state.is_released:
            # A new owner: give the tag its memory back before anything is allocated in it (on
            # CUDA the tag's pool may hand the new tensors blocks it cached while paused).
            self.backend().resume(tag, state.enable_cpu_backup)
            state.is_paused = False
        if state.is_paused:
            # torch_memory_saver aborts the process when it resumes a tag holding an allocation
            # that was never paused, so allocating into a paused tag must stop here.
            raise RuntimeError(
                f"region(tag={tag!r}) opened while the tag is paused; resume it first (or "
                "release() it if its owner is gone)"
            )
        state.is_released = False
        state.num_open_regions += 1
        try:
            with self.backend().region(tag, enable_cpu_backup):
                yield
        finally:
            state.num_open_regions -= 1

    def pause(self, tags: tuple[str, ...]) -> None:
        states = self._checked(tags, "pause")
        for tag, state in zip(tags, states, strict=True):
            if state.is_paused:
                raise RuntimeError(f"pause({tag!r}): the tag is already paused")
            if state.num_open_regions:
                raise RuntimeError(f"pause({tag!r}) inside its own open region; leave it first")
        for tag, state in zip(tags, states, strict=True):
            self.backend().pause(tag, state.enable_cpu_backup)
            state.is_paused = True

    def resume(self, tags: tuple[str, ...]) -> None:
        states = self._checked(tags, "resume")
        for tag, state in zip(tags, states, strict=True):
            if not state.is_paused:
                raise RuntimeError(f"resume({tag!r}): the tag is not paused")
        for tag, state in zip(tags, states, strict=True):
            self.backend().resume(tag, state.enable_cpu_backup)
            state.is_paused = False

    def release(self, tags: tuple[str, ...]) -> None:
        states = self._checked(tags, "release")
        for tag, state in zip(tags, states, strict=True):
            if state.num_open_regions:
                raise RuntimeError(f"release({tag!r}) inside its own open region; leave it first")
        for state in states:
            state.is_released = True

    def _checked(self, tags: tuple[str, ...], verb: str) -> list[_TagState]:
        if not tags:
            raise ValueError(f"{verb}() needs at least one tag; pass e.g. {verb}(*region_tags())")
        if len(set(tags)) != len(tags):
            raise ValueError(f"{verb}{tags}: a tag is repeated; pass each tag once")
        return [self._state(tag) for tag in tags]

    def is_paused(self, tag: str) -> bool:
        return self._state(tag).is_paused

    def resident_bytes(self, tag: str) -> int:
        state = self._state(tag)
        return 0 if state.is_paused else self.backend().allocated_bytes(tag)

    def backup_bytes(self, tag: str) -> int:
        state = self._state(tag)
        return self.backend().allocated_bytes(tag) if state.enable_cpu_backup else 0

    def tags(self) -> tuple[str, ...]:
        return tuple(self._tags)


_REGISTRY = _Registry()


def configure_regions(
    *,
    backend: BackendName = "auto",
    hook_mode: HookMode = "torch",
    retain_cpu_backup: bool | None = None,
) -> None:
    """Choose how regions work, before the first `region()` of the process.

    backend: "auto" takes "cuda" when CUDA is available, else "cpu". "cuda" uses
        torch_memory_saver (install `yatt-placement[cuda]`); "cpu" keeps the books only.
    hook_mode: torch_memory_saver's hook. "torch" routes region allocations through a torch
        pluggable allocator and needs nothing at launch; "preload" intercepts cudaMalloc and
        needs the process started with torch_memory_saver's library in LD_PRELOAD (see
        `torch_memory_saver.configure_subprocess()`); pick it when pauseable CUDA graphs are needed.
    retain_cpu_backup: keep the pinned host copy of each region with CPU backup allocated from
        one pause to the next instead of freeing it at resume and allocating it again at the
        next pause (cudaFreeHost/cudaMallocHost cost about as much as the copy). Each pause still
        copies the device contents into it. Cost: host RAM equal to the backed-up bytes stays
        pinned while the tags are awake too. None (default) turns it on unless the environment
        sets torch_memory_saver's TMS_RETAIN_CPU_BACKUP, which then decides; True or False
        overrides that. Process-wide (torch_memory_saver is one per process); CUDA only.
    """
    _REGISTRY.configure(backend, hook_mode, retain_cpu_backup)


def region(tag: str, *, enable_cpu_backup: bool = False):
    """Context manager: tensors allocated inside belong to `tag` and follow its pause/resume.

    enable_cpu_backup: keep the contents across a pause (weights). Without it the contents are
    undefined after resume (KV caches). Chosen at the tag's first region; later regions of the
    same tag must pass the same value. Allocations are per thread, as torch's memory pools are.
    """
    return _REGISTRY.region(tag, enable_cpu_backup)


def pause(*tags: str) -> None:
    """Release the memory of each tag, in the order given; tensors keep their addresses.

    Raises ValueError for an unknown tag, RuntimeError for a tag already paused; in either case
    nothing is paused.
    """
    _REGISTRY.pause(tags)


def resume(*tags: str) -> None:
    """Re-create the memory of each paused tag, in the order given (weights before KV cache)."""
    _REGISTRY.resume(tags)


def release(*tags: str) -> None:
    """Say that the owner of `tags` is gone (an engine closed): it holds no tensor in them.

    A paused tag stays paused, its memory still given back, until the tag's next `region()`,
    which resumes it first; without this, a new owner of a tag left paused (an engine closed
    while asleep, then built again with the same region prefix) is refused.
    """
    _REGISTRY.release(tags)


def is_paused(tag: str) -> bool:
    """Whether `tag` is paused now."""
    return _REGISTRY.is_paused(tag)


def resident_bytes(tag: str) -> int:
    """Bytes the tag holds on its device now: 0 while paused."""
    return _REGISTRY.resident_bytes(tag)


def backup_bytes(tag: str) -> int:
    """Host bytes `tag` needs while paused: its bytes if it has CPU backup, else 0. On CUDA the
    backup is torch_memory_saver's pinned shadow, kept from one pause to the next by default
    (`configure_regions(retain_cpu_backup=...)`)."""
    return _REGISTRY.backup_bytes(tag)


def region_tags() -> tuple[str, ...]:
    """Every tag that has had a region, in first-use order."""
    return _REGISTRY.tags()
