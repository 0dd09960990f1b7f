"""The save pipeline after `Checkpointer.save` validated its input: staging to CPU memory, then
write, agree, commit and prune (run in a background thread for async saves).

    stage_to_cpu          training thread, the only part an async save blocks on
    write_and_commit      background thread (or inline when synchronous)
      rank 0: fresh step-N.tmp/                     all ranks agree (gloo, private group)
      all: dcp.save (fsync per file) + rank-r.json,
           sha256 of the files this rank wrote      all ranks agree the files are complete
                                                    (and hand their checksums to rank 0)
      rank 0: yatt_meta.json, rename, `latest`      all ranks agree the commit happened
      rank 0: retention (failures only warn: the new checkpoint is already committed)
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from yatt.ckpt._group import RankGroup
from yatt.ckpt._layout import (
    TMP_SUFFIX,
    commit,
    delete_checkpoint,
    hash_files_of_rank,
    list_committed_steps,
    rank_filename,
    read_info,
    select_deletions,
    step_dirname,
    write_meta,
    write_rank_record_durable,
)
from yatt.ckpt._space import probable_storage_cause
from yatt.ckpt._staging import HostStager

logger = logging.getLogger("yatt.ckpt")


def create_stager(*, share_memory: bool = False) -> HostStager:
    # Buffers are reused by the next save, which is safe because a save only starts after the
    # previous one finished writing. Pinned buffers make device-to-host copies run at full speed;
    # shared ones let a writer process read them without a copy.
    return HostStager(pin_memory=torch.cuda.is_available(), share_memory=share_memory)


def stage_to_cpu(stager: HostStager, live: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of `live`; device-to-host copies end with a device sync here, because the
    caller may modify its tensors as soon as save() returns."""
    with _one_intra_op_thread():
        return stager.stage(live)


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Run host copies on one intra-op thread. Staging is many tensor-sized memcpys; with an
    OpenMP team each copy ends in a barrier that waits for the slowest thread, and on a busy host
    (other ranks, data workers) that made 1 GB of copies 7x slower than one thread (~8 GB/s)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def write_and_commit(
    root: Path,
    step: int,
    state_dict: dict[str, Any],
    record: dict[str, Any],
    group: RankGroup,
    *,
    keep_last: int,
    keep_every: int | None,
) -> None:
    """Write `state_dict` and this rank's `record` as `step`, commit atomically, prune."""
    tmp = root / (step_dirname(step) + TMP_SUFFIX)
    error = None
    if group.rank == 0:
        error = describe_failure(lambda: _fresh_folder(tmp))
    group.agree(error, on_io=True)

    checksums: dict[str, str] = {}

    def write_files() -> None:
        dcp.save(
            state_dict,
            storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
            process_group=group.io,
            no_dist=not group.is_distributed,
        )
        write_rank_record_durable(tmp / rank_filename(group.rank), record)
        # Here, in the writing thread or process: hashing does not block training, and each
        # rank reads back only its own files, still in its page cache.
        checksums.update(hash_files_of_rank(tmp, group.rank))

    failure = describe_failure(write_files, path=tmp)
    all_checksums = group.agree_and_gather(failure, checksums, on_io=True)
    error = None
    if group.rank == 0:

        def commit_step() -> None:
            merged = {name: digest for ranks in all_checksums for name, digest in ranks.items()}
            write_meta(tmp, step=step, world_size=group.world_size, checksums=merged)
            commit(root, tmp, step)

        error = describe_failure(commit_step)
        if error is None:
            retention_error = describe_failure(
                lambda: apply_retention(root, keep_last=keep_last, keep_every=keep_every)
            )
            if retention_error is not None:
                warnings.warn(
                    f"pruning old checkpoints under {str(root)!r} failed: {retention_error}",
                    stacklevel=2,
                )
    group.agree(error, on_io=True)
    logger.info("committed checkpoint %s", root / step_dirname(step))


def apply_retention(root: Path, *, keep_last: int, keep_every: int | None) -> None:
    all_steps = list_committed_steps(root)
    sound = [s for s in all_steps if describe_failure(lambda s=s: read_info(root, s)) is None]
    for step in select_deletions(sound, all_steps, keep_last=keep_last, keep_every=keep_every):
        delete_checkpoint(root, step)


def _fresh_folder(path: Path) -> None:
    if path.exists():  # an earlier failed save of the same step in this run
        shutil.rmtree(path)
    path.mkdir(parents=True)


def describe_failure(fn: Callable[[], object], *, path: Path | None = None) -> str | None:
    """Run `fn`; its error as one line, or None. Collective code must not raise on one rank only.
    A full disk or a file-size limit is named first: DCP wraps the OSError in an exception
    whose text names no cause. torch.save's zip writer reports a short write with no errno at
    all ("unexpected pos ..."): then `path`'s disk, nearly full, is named as the probable cause."""
    try:
        fn()
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        cause = _storage_cause(e)
        if cause is None and path is not None:
            cause = probable_storage_cause(path)
        text = f"{type(e).__name__}: {e}"
        return text if cause is None else f"{cause}; {text}"
    return None


# errno -> what a user does about it (a save that cannot be written, whatever the tensors)
_STORAGE_ERRORS = {
    errno.ENOSPC: "no space left on the device (ENOSPC): free space under the checkpoint root "
    "or lower ckpt.keep_last",
    errno.EFBIG: "a file grew over the file-size limit (EFBIG; see `ulimit -f` and the "
    "filesystem's largest file): raise the limit or save to another filesystem",
    errno.EDQUOT: "the disk quota is exceeded (EDQUOT): free space or raise the quota",
}


def _storage_cause(error: BaseException) -> str | None:
    """The named storage cause (ENOSPC, EFBIG, EDQUOT) anywhere in `error`'s chain, or None."""
    seen: set[int] = set()
    pending: list[object] = [error]
    while pending:
        e = pending.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            if isinstance(e, tuple):  # DCP's failures: (exception, its stack summary)
                pending.extend(e)
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRORS:
            return _STORAGE_ERRORS[e.errno]
        pending.extend([e.__cause__, e.__context__])
        failures = getattr(e, "failures", None)  # CheckpointException: rank -> failure
        if isinstance(failures, dict):
            pending.extend(failures.values())
    return None
