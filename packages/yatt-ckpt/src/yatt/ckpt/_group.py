"""The ranks that save together, and the few collectives the checkpointer needs.

Two private gloo groups: `io` is used only by the thread that writes a checkpoint (DCP's plan
exchange, commit agreement), `ctl` only by the training thread (schedule agreement). Collectives
on one group from two threads could interleave differently on different ranks and deadlock;
separate groups make the background write independent of whatever the trainer runs.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from yatt.ckpt._layout import CheckpointError

T = TypeVar("T")


class RankGroup:
    """All ranks of the default process group, or just this process when none is initialized."""

    def __init__(self) -> None:
        self.is_distributed = dist.is_available() and dist.is_initialized()
        self.io: dist.ProcessGroup | None = None
        self.ctl: dist.ProcessGroup | None = None
        if self.is_distributed:
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            # A CPU backend for both, whatever the default backend is: checkpoint staging holds
            # CPU tensors and the agreements are tiny host values.
            self.io = dist.new_group(backend="gloo")
            self.ctl = dist.new_group(backend="gloo")
        else:
            self.rank = 0
            self.world_size = 1

    def gather_errors(self, local_error: str | None, *, on_io: bool) -> list[str]:
        """Every rank's error message ("rank r: ..."); also a barrier over the ranks."""
        if not self.is_distributed:
            return [] if local_error is None else [local_error]
        errors: list[str | None] = [None] * self.world_size
        dist.all_gather_object(errors, local_error, group=self.io if on_io else self.ctl)
        return [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]

    def agree_and_gather(self, local_error: str | None, payload: T, *, on_io: bool) -> list[T]:
        """`agree`, and every rank's `payload` (picklable), in rank order, in one collective."""
        if not self.is_distributed:
            if local_error is not None:
                raise CheckpointError(local_error)
            return [payload]
        gathered: list[tuple[str | None, T] | None] = [None] * self.world_size
        dist.all_gather_object(
            gathered, (local_error, payload), group=self.io if on_io else self.ctl
        )
        reported = [f"rank {r}: {item[0]}" for r, item in enumerate(gathered) if item[0]]
        if reported:
            raise CheckpointError("; ".join(reported))
        return [item[1] for item in gathered]

    def agree(self, local_error: str | None, *, on_io: bool) -> None:
        """Raise CheckpointError on every rank if any rank reports an error (a barrier otherwise)."""
        reported = self.gather_errors(local_error, on_io=on_io)
        if reported:
            raise CheckpointError("; ".join(reported))

    def union(self, keys: set[str]) -> set[str]:
        """The union of every rank's `keys` (on the training thread's group)."""
        if not self.is_distributed:
            return set(keys)
        gathered: list[set[str] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, set(keys), group=self.ctl)
        return set().union(*gathered)

    def any_rank(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of `flags` over ranks (on the training thread's group)."""
        return [bool(v) for v in self.max_over_ranks([int(f) for f in flags])]

    def max_over_ranks(self, values: list[int]) -> list[int]:
        """Element-wise max of `values` over ranks (on the training thread's group)."""
        if not self.is_distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctl)
        return [int(v) for v in t.tolist()]

    def close(self) -> None:
        # After the caller destroyed the default group, its subgroups are already gone.
        if dist.is_available() and dist.is_initialized():
            for group in (self.io, self.ctl):
                if group is not None:
                    dist.destroy_process_group(group)
        self.io = self.ctl = None
