"""A recording placement role, for tests of plans (yours or ours) without a model or a GPU."""

from __future__ import annotations

from collections.abc import Sequence


class RecordingRole:
    """Fixed bytes per memory tag; every sleep and wake goes into a shared `log` list.

    Entries: `(name, "sleep")` and `(name, "wake", tags)`. `fractions` lists the memory
    fractions the plan set, and `kv_fraction` the one in force when the KV cache last woke.
    """

    def __init__(self, name: str, log: list, sizes: dict[str, int]) -> None:
        self.name, self.log, self.sizes = name, log, sizes
        self.memory_tags: tuple[str, ...] = tuple(sizes)
        self.awake = set(self.memory_tags)
        self.fractions: list[float] = []
        self.kv_fraction: float | None = None

    @property
    def fraction(self) -> float | None:
        """The memory fraction set last (None: never set)."""
        return self.fractions[-1] if self.fractions else None

    def sleep(self) -> None:
        self.log.append((self.name, "sleep"))
        self.awake.clear()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        tags = tuple(self.memory_tags if tags is None else tags)
        self.log.append((self.name, "wake", tags))
        self.awake |= set(tags)
        if "kv_cache" in tags:
            self.kv_fraction = self.fraction

    def resident_bytes(self) -> int:
        return sum(self.sizes[tag] for tag in self.awake)

    def set_memory_fraction(self, fraction: float) -> None:
        self.fractions.append(fraction)
