"""Will a checkpoint fit on its disk? Checked before a save stages or writes anything.

A save that runs out of space fails half-written, after the staging copy and most of the write,
and DCP's file writer (torch.save's zip writer) can report it as "unexpected pos ..." with no
errno (an H200 machine's 64 GiB disk filled that way in a trainer run at 3991ef1). The bytes a
save writes are known beforehand: its tensors, this rank's shards, times the ranks that write to
the same disk. Retention runs after a commit, so the kept checkpoints stay while the new one is
written: it needs its own size free.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from yatt.ckpt._layout import CheckpointError
from yatt.ckpt._state import flatten_tensors

# DCP's metadata, the rank records and the pickled non-tensor state: small next to the tensors,
# but a save of a tiny state must not pass with 0 bytes free.
SPACE_MARGIN_BYTES = 64 * 2**20


class CheckpointSpaceError(CheckpointError):
    """A save that would not fit on its disk; nothing was written. `Checkpointer.maybe_save`
    skips a scheduled save on it (counted in num_skipped_saves); save() raises it."""


def state_nbytes(live: dict[str, Any]) -> int:
    """Bytes of the tensors this rank writes (a DTensor's local shard)."""
    total = 0
    for tensor in flatten_tensors(live).values():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def ranks_sharing_disk() -> int:
    """The ranks on this host (torchrun's LOCAL_WORLD_SIZE, 1 without it): they write their
    shards to the same disk unless the root is a network filesystem, where space is rarely
    the limit."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def free_bytes(path: Path) -> int | None:
    """Free bytes on `path`'s filesystem (its nearest existing ancestor's); None if unknown."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def shortfall(root: Path, step: int, need: int, *, keep_last: int) -> str | None:
    """A one-line reason the save of `step` (`need` bytes on this disk) does not fit, or None."""
    free = free_bytes(root)
    if free is None or free >= need + SPACE_MARGIN_BYTES:
        return None
    return (
        f"the checkpoint of step {step} needs ~{need / 2**30:.2f} GiB under {str(root)!r} and "
        f"{free / 2**30:.2f} GiB are free (the {keep_last} newest kept stay until it commits, "
        "ckpt.keep_last): free space, lower ckpt.keep_last or save to a larger disk"
    )


def probable_storage_cause(path: Path) -> str | None:
    """After a failed write with no errno: name a full disk when `path`'s is (nearly) full."""
    free = free_bytes(path)
    if free is None or free >= SPACE_MARGIN_BYTES:
        return None
    return (
        f"probably no space left on the device ({free / 2**20:.0f} MiB free under "
        f"{str(path)!r}): free space under the checkpoint root or lower ckpt.keep_last"
    )
