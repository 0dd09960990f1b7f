"""The optional members of a role (see `_roles`' docstring), as typed protocols a plan checks
with isinstance instead of probing attribute names with getattr. A role has `sleep()` and
`wake_up(tags)` (`Role`); each protocol here is one thing more a plan can do with it. The two
that report needs (ReportsMemoryNeed, ReportsHostNeed) live in `_needs`, beside what they return.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class MemoryTagged(Protocol):
    """A role whose `wake_up(tags)` wakes parts of its memory by tag ("weights", "kv_cache"),
    so a plan wakes all weights before any KV cache."""

    memory_tags: Sequence[str]


@runtime_checkable
class InMemoryRegions(Protocol):
    """A role whose memory lives in named process-wide regions (two roles must not share one)."""

    memory_regions: Sequence[str]


@runtime_checkable
class MeasuresResidentBytes(Protocol):
    """A role that counts the bytes it holds on its device now."""

    def resident_bytes(self) -> int: ...


@runtime_checkable
class ResizableMemory(Protocol):
    """A role that takes a share of device memory (partial colocation moves it every step)."""

    def set_memory_fraction(self, fraction: float) -> None: ...


@runtime_checkable
class ResizesWhileAwake(Protocol):
    """A ResizableMemory role that says whether it applies a new share by itself while awake
    (at its next call), so offload="auto" need not put it to sleep to apply it."""

    resizes_while_awake: bool
