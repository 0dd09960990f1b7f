"""An advisory lock on a run folder, so two jobs never write one `out_dir` at once.

    acquire_run_lock(out_dir, purpose="train")
      open out_dir/.yatt-run.lock, flock(LOCK_EX | LOCK_NB)
        taken:  read who holds it (pid, host, purpose, start time) -> RunLockedError
        free:   write our own holder record into the file, keep the descriptor open
      release() / process exit (even kill -9): the kernel drops the flock

flock, not a pid file: a lock of a crashed process is released by the kernel, so there is no
stale lock to guess about. The lock file itself stays in the folder (unlinking a lock file that
another process may have just opened would let two processes hold "the" lock on two inodes).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

logger = logging.getLogger("yatt.ckpt")

RUN_LOCK_FILE = ".yatt-run.lock"
# A holder writes its record right after it takes the lock; a contender that finds the lock taken
# but the record empty waits this long for it before reporting the holder as unknown.
_RECORD_WAIT_SECONDS = 0.5


@dataclass(kw_only=True, frozen=True)
class RunLockHolder:
    """Who holds a run lock, as the holder wrote it into the lock file."""

    pid: int
    host: str
    purpose: str  # e.g. "train" or "export"
    started_unix: float  # wall-clock time the lock was taken

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(self.started_unix))
        return f"pid {self.pid} on host {self.host!r} ({self.purpose}, since {started})"


class RunLockedError(RuntimeError):
    """Another process holds the run lock of this folder; `holder` says who (None if unknown)."""

    def __init__(self, message: str, *, path: Path, holder: RunLockHolder | None) -> None:
        super().__init__(message)
        self.path = path
        self.holder = holder


class RunLock:
    """A held run lock; `release()` it, or use it as a context manager. Build it with
    `acquire_run_lock`. A lock never released is held until the process exits (dropping the
    object does not release it: a lock must not end by accident)."""

    def __init__(self, path: Path, fd: int | None, holder: RunLockHolder) -> None:
        self.path = path
        self.holder = holder
        self._fd = fd

    @property
    def is_held(self) -> bool:
        """True until release(); False from the start when the filesystem has no flock."""
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays; its record is cleared first."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # the record is only read while the lock is taken, so a stale one is harmless
        finally:
            os.close(fd)  # closing the last descriptor of the open file drops the flock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def acquire_run_lock(directory: str | os.PathLike[str], *, purpose: str = "train") -> RunLock:
    """Take the run lock of `directory` (created if missing) for `purpose`, without waiting.

    Raises `RunLockedError` naming the holder's pid, host, purpose and start time when another
    process (or another `RunLock` of this process) holds it. The kernel releases the lock when
    the holder exits, however it exits. In a multi-rank job only rank 0 takes it. On a
    filesystem without flock (some Lustre mounts) this warns and returns an unheld lock.
    """
    if not isinstance(purpose, str) or not purpose.strip():
        raise ValueError(f"purpose={purpose!r} must be a non-empty str, e.g. 'train' or 'export'")
    folder = Path(directory).expanduser().absolute()
    folder.mkdir(parents=True, exist_ok=True)
    return lock_file(
        folder / RUN_LOCK_FILE,
        purpose=purpose,
        hint=f"wait for it to finish or stop it, or point this {purpose} at another folder",
    )


def lock_file(path: Path, *, purpose: str, hint: str) -> RunLock:
    """Take an exclusive flock on `path` (created if missing) without waiting; `hint` ends the
    RunLockedError's message (what the caller can do instead)."""
    holder = RunLockHolder(
        pid=os.getpid(), host=socket.gethostname(), purpose=purpose, started_unix=time.time()
    )
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            other = _read_holder(path)
            who = "an unknown process" if other is None else other.describe()
            raise RunLockedError(
                f"{str(path.parent)!r} is in use by {who} (lock file {path.name}); {hint}",
                path=path,
                holder=other,
            ) from None
        if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            logger.warning(
                "the filesystem of %s does not support flock (%s); running without the lock: "
                "make sure no other job writes this folder",
                path.parent,
                e.strerror or e,
            )
            return RunLock(path, None, holder)
        raise
    record = json.dumps(
        {
            "pid": holder.pid,
            "host": holder.host,
            "purpose": holder.purpose,
            "started_unix": holder.started_unix,
        }
    ).encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
    except OSError as e:
        # The lock is held all the same (a full disk must not stop a run that frees space by
        # cleaning up); a contender then names the holder "an unknown process".
        logger.warning("could not write the holder record into %s: %s", path, e)
    return RunLock(path, fd, holder)


def _read_holder(path: Path) -> RunLockHolder | None:
    deadline = time.monotonic() + _RECORD_WAIT_SECONDS
    while True:
        try:
            raw = json.loads(path.read_bytes())
            return RunLockHolder(
                pid=int(raw["pid"]),
                host=str(raw["host"]),
                purpose=str(raw["purpose"]),
                started_unix=float(raw["started_unix"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
