"""On-disk layout of a checkpoint root and the file operations that keep it crash-safe.

    root/
      latest                  text "step-00000123": the newest committed step, replaced atomically
      step-00000120/          a committed checkpoint (only ever created by a rename)
        .metadata             DCP's index of every tensor: key -> global shape, dtype, file offsets
        __0_0.distcp ...      DCP's tensor data, one file per rank (per writer thread)
        rank-00000.json       per-rank record: RNG states and the caller's `extra`
        yatt_meta.json        written last: step, time, world size, versions, size and checksum
                              of every file (each rank hashes the files it wrote)
      step-00000123.tmp/      a save in progress (or killed): ignored by readers, removed when
                              the next writer opens the root
      .yatt-ckpt-writer.lock  flock of the one writing Checkpointer (its rank 0), see _runlock.py

A folder without `.tmp` exists only after every file in it was fsynced, so a reader that lists
committed folders never sees a partial checkpoint. Deleting also goes through a `.tmp` rename,
so a crash mid-delete leaves garbage that the next writer removes, never a half-deleted "committed" one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from yatt.ckpt._version import __version__

FORMAT_VERSION = 1
META_FILE = "yatt_meta.json"
LATEST_FILE = "latest"
TMP_SUFFIX = ".tmp"
# A file's checksum: sha256 over the concatenated sha256 digests of its 16 MiB blocks. sha256
# of one stream runs at ~1.3 GB/s on one core of an H200 host (SHA extensions), which would make
# a 6 GB shard's hash outlast its write; blocks hash on a few threads at once (hashlib releases
# the GIL). It detects damage (a bad sector, a copy gone wrong), not tampering.
CHECKSUM_ALGORITHM = "sha256-of-16MiB-block-sha256s"
_HASH_BLOCK_BYTES = 16 << 20
_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
_STEP_RE = re.compile(r"^step-(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged; the message names it and what is wrong."""


@dataclass(kw_only=True, frozen=True)
class CheckpointInfo:
    """What `Checkpointer.verify` checked about one committed checkpoint."""

    step: int
    path: Path
    time_unix: float  # wall-clock time the save was committed
    world_size: int  # number of ranks that wrote it
    versions: dict[str, str]  # yatt-ckpt, torch and python versions of the writer
    file_sizes: dict[str, int]  # every file's size in bytes, checked against the disk
    # Every file's sha256 (hex), checked by load() and verify(); empty for checkpoints written
    # before yatt-ckpt recorded them.
    checksums: dict[str, str]


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def rank_filename(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def list_committed_steps(root: Path) -> list[int]:
    """Steps of the committed folders under `root`, ascending (content not checked)."""
    if not root.is_dir():
        return []
    steps = []
    for entry in os.scandir(root):
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir():
            steps.append(int(match.group(1)))
    return sorted(steps)


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entries to disk (a folder fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: Path, obj: Any) -> None:
    _write_text_durable(path, json.dumps(obj, indent=1, sort_keys=True))


def _write_text_durable(path: Path, text: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_rank_record_durable(path: Path, record: dict[str, Any]) -> None:
    """Write a rank record whose `extra_json` holds the caller's extra already as JSON text
    (Checkpointer.save encodes it once): the file reads back as {"extra": ..., "rank": ...,
    "rng": ...}, with the text spliced in, not encoded twice."""
    rest = json.dumps({key: value for key, value in record.items() if key != "extra_json"})
    rest = rest[1:-1]  # the other members, without their braces
    _write_text_durable(
        path, '{"extra": ' + record["extra_json"] + (", " + rest if rest else "") + "}\n"
    )


def check_root_writable(root: Path) -> str | None:
    """Create `root` if needed and prove it is writable; returns an error message or None."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{os.getpid()}{TMP_SUFFIX}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        return (
            f"checkpoint root {str(root)!r} is not a writable folder ({e.strerror or e}); "
            "pass a folder this process can create files in"
        )
    return None


def remove_leftovers(root: Path) -> list[str]:
    """Delete the `.tmp` entries a killed save or delete left behind; returns their names."""
    removed = []
    for entry in os.scandir(root):
        if entry.name.endswith(TMP_SUFFIX):
            _remove(Path(entry.path))
            removed.append(entry.name)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def hash_file(path: Path) -> str:
    """The file's checksum (see CHECKSUM_ALGORITHM), its blocks hashed on a few threads."""
    fd = os.open(path, os.O_RDONLY)
    try:
        num_blocks = -(-os.fstat(fd).st_size // _HASH_BLOCK_BYTES)

        def hash_block(index: int) -> bytes:
            data = os.pread(fd, _HASH_BLOCK_BYTES, index * _HASH_BLOCK_BYTES)
            return hashlib.sha256(data).digest()

        if num_blocks <= 1:
            digests = [hash_block(i) for i in range(num_blocks)]
        else:
            with ThreadPoolExecutor(min(_HASH_THREADS, num_blocks)) as pool:
                digests = list(pool.map(hash_block, range(num_blocks)))
    finally:
        os.close(fd)
    return hashlib.sha256(b"".join(digests)).hexdigest()


def hash_files_of_rank(folder: Path, rank: int) -> dict[str, str]:
    """Checksums of the files `rank` wrote into `folder` (its DCP data files, named
    `__<rank>_<n>.distcp` by DCP's FileSystemWriter, and its rank record), read back from the
    page cache right after the write. Files DCP names otherwise are hashed by rank 0 in
    write_meta, so a naming change costs time, never a missing checksum."""
    prefix = f"__{rank}_"
    names = [
        e.name
        for e in os.scandir(folder)
        if e.is_file() and (e.name.startswith(prefix) or e.name == rank_filename(rank))
    ]
    return {name: hash_file(folder / name) for name in names}


def write_meta(
    folder: Path, *, step: int, world_size: int, checksums: dict[str, str] | None = None
) -> None:
    """Record every file's size and checksum (`checksums` holds those the ranks computed; the
    rest are computed here), then fsync: the last write before the commit rename."""
    sizes = {e.name: e.stat().st_size for e in os.scandir(folder) if e.is_file()}
    sizes.pop(META_FILE, None)
    known = checksums or {}
    digests = {name: known.get(name) or hash_file(folder / name) for name in sizes}
    meta = {
        "format": FORMAT_VERSION,
        "step": step,
        "time_unix": time.time(),
        "world_size": world_size,
        "versions": {
            "yatt_ckpt": __version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "file_sizes": sizes,
        "checksums": {"algorithm": CHECKSUM_ALGORITHM, "files": digests},
    }
    write_json_durable(folder / META_FILE, meta)
    fsync_path(folder)


def commit(root: Path, tmp_folder: Path, step: int) -> None:
    """Rename the finished `.tmp` folder into place and point `latest` at it."""
    final = root / step_dirname(step)
    if final.exists():
        # Re-saving a step (e.g. a final save at an already saved step): move the old one aside
        # first; a crash here leaves the older steps and garbage, never a partial step folder.
        old = root / f"{step_dirname(step)}.old{TMP_SUFFIX}"
        _remove(old)
        final.rename(old)
        tmp_folder.rename(final)
        _remove(old)
    else:
        tmp_folder.rename(final)
    fsync_path(root)
    pointer_tmp = root / f"{LATEST_FILE}{TMP_SUFFIX}"
    with open(pointer_tmp, "w", encoding="ascii") as f:
        f.write(step_dirname(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, root / LATEST_FILE)
    fsync_path(root)


def delete_checkpoint(root: Path, step: int) -> None:
    doomed = root / f"{step_dirname(step)}.del{TMP_SUFFIX}"
    (root / step_dirname(step)).rename(doomed)
    fsync_path(root)
    _remove(doomed)


def read_info(root: Path, step: int) -> CheckpointInfo:
    """Check a committed checkpoint's metadata against the disk; raise `CheckpointError` if not sound."""
    folder = root / step_dirname(step)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {str(folder)!r} does not exist")
    try:
        with open(folder / META_FILE, encoding="ascii") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {META_FILE} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {META_FILE} is unreadable: {e}") from e
    try:
        info = CheckpointInfo(
            step=int(meta["step"]),
            path=folder,
            time_unix=float(meta["time_unix"]),
            world_size=int(meta["world_size"]),
            versions={str(k): str(v) for k, v in meta["versions"].items()},
            file_sizes={str(k): int(v) for k, v in meta["file_sizes"].items()},
            checksums=_read_checksums(meta),
        )
        fmt = meta["format"]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {META_FILE} is malformed: {e!r}") from e
    if fmt != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(folder)!r}: format {fmt!r}, this yatt-ckpt reads {FORMAT_VERSION}"
        )
    if info.step != step:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {META_FILE} says step {info.step}")
    if info.checksums and info.checksums.keys() != info.file_sizes.keys():
        raise CheckpointError(
            f"checkpoint {str(folder)!r}: {META_FILE} lists checksums of other files than sizes"
        )
    required = [".metadata"] + [rank_filename(r) for r in range(info.world_size)]
    for name in required:
        if name not in info.file_sizes:
            raise CheckpointError(
                f"checkpoint {str(folder)!r}: {name} is not listed in {META_FILE}"
            )
    for name, size in info.file_sizes.items():
        try:
            actual = (folder / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {str(folder)!r}: file {name} is missing") from None
        if actual != size:
            raise CheckpointError(
                f"checkpoint {str(folder)!r}: file {name} has {actual} bytes, {META_FILE} "
                f"recorded {size}"
            )
    return info


def _read_checksums(meta: dict[str, Any]) -> dict[str, str]:
    recorded = meta.get("checksums")
    if recorded is None:  # written before checksums were recorded: sizes are all there is
        return {}
    if recorded["algorithm"] != CHECKSUM_ALGORITHM:
        raise ValueError(
            f"checksum algorithm {recorded['algorithm']!r} is not {CHECKSUM_ALGORITHM}"
        )
    return {str(k): str(v) for k, v in recorded["files"].items()}


def verify_checksums(info: CheckpointInfo, names: list[str]) -> None:
    """Hash the files `names` of a checkpoint; CheckpointError naming the first whose contents
    differ from the checksum recorded at save time."""
    for name in names:
        recorded = info.checksums[name]
        try:
            actual = hash_file(info.path / name)
        except OSError as e:
            raise CheckpointError(
                f"checkpoint {str(info.path)!r}: file {name} is unreadable: {e}"
            ) from e
        if actual != recorded:
            raise CheckpointError(
                f"checkpoint {str(info.path)!r}: file {name} is damaged: its checksum is "
                f"{actual[:16]}..., {META_FILE} recorded {recorded[:16]}..."
            )


def read_rank_record(info: CheckpointInfo, rank: int) -> dict[str, Any]:
    path = info.path / rank_filename(rank)
    try:
        with open(path, encoding="ascii") as f:
            record = json.load(f)
        missing = {"rng", "extra"} - set(record)
        if missing:
            raise KeyError(f"keys {sorted(missing)} missing")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {str(info.path)!r}: {path.name} is unreadable: {e!r}"
        ) from e
    return record


def select_deletions(
    sound_steps: list[int], all_steps: list[int], *, keep_last: int, keep_every: int | None
) -> list[int]:
    """Steps to delete: all but the last `keep_last` sound ones, multiples of `keep_every`, and
    the newest folder (sound or not: never delete the newest)."""
    keep = set(sorted(sound_steps)[-keep_last:])
    if keep_every is not None:
        keep.update(s for s in all_steps if s % keep_every == 0)
    if all_steps:
        keep.add(max(all_steps))
    return [s for s in all_steps if s not in keep]


def read_dcp_metadata(info: CheckpointInfo) -> Metadata:
    """The DCP index of a checkpoint; CheckpointError when it is unreadable."""
    try:
        return dcp.FileSystemReader(info.path).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {str(info.path)!r}: .metadata is unreadable: {e!r}"
        ) from e
