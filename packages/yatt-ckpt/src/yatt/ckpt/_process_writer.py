"""The opt-in writer process (`Checkpointer(writer="process")`): one per rank, writing staged
state dicts from shared memory, so the write does not compete for the trainer's GIL.

    trainer process                                writer process (spawn, one per rank)
      stage into shared-memory buffers (_staging)
      pack: tensors -> (storage key, view)    --->   unpack: views of the mapped storages
            storages the child lacks are sent        write_and_commit (its own gloo group)
            once, as shm handles              <---   "done" + error text
      wait(): the reply, or the child's exit code

A thread writer spends most of its time in torch.save's per-chunk Python callbacks; beside a
Python-heavy training loop it waits for the GIL, which made a 6 GB write take longer than a step.
The staging buffers are reused between saves, so after the first save a request carries only
keys and views, no handles and no copies. The child exits when its parent dies (it polls
getppid), so a killed trainer leaves no writer behind; an unfinished write leaves only a .tmp
folder, which start-up removes.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing  # registers its shared-memory tensor pickling with multiprocessing
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from yatt.ckpt._group import RankGroup
from yatt.ckpt._layout import CheckpointError

_PARENT_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class _TensorRef:
    """A CPU tensor as a view of a storage the child already holds."""

    key: int
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _ShardRef:
    """This rank's shard of a DTensor: its data and where it lies in the global tensor."""

    local: _TensorRef
    global_size: tuple[int, ...]
    # The chunk's extent in the global tensor, as DCP computes it for the DTensor.
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]


class ProcessWriter:
    """Parent side: starts the writer process at the first submit, sends it saves, collects
    their results. Call submit/wait/close from the training thread, on every rank in order."""

    def __init__(self, root: Path, *, keep_last: int, keep_every: int | None, group: RankGroup):
        self._root = root
        self._keep_last = keep_last
        self._keep_every = keep_every
        self._group = group
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Any = None
        self._sender: threading.Thread | None = None
        self._send_error: BaseException | None = None
        # Storages the child holds, by key; kept alive here so a key is never reused.
        self._sent: dict[int, torch.UntypedStorage] = {}
        self._pending_step: int | None = None
        self._store: dist.TCPStore | None = None  # rank 0 only: the writers' rendezvous

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def submit(self, step: int, staged: dict[str, Any], record: dict[str, Any]) -> None:
        """Hand `staged` (tensors in shared memory) to the writer; returns without waiting."""
        assert self._pending_step is None, "wait() for the previous save first"
        if self._process is None:
            self._start()
        storages: dict[int, torch.UntypedStorage] = {}
        packed = _pack(staged, storages)
        new = {key: s for key, s in storages.items() if key not in self._sent}
        self._sent = storages
        message = ("save", step, packed, new, sorted(storages), record)
        self._pending_step = step
        # Sent from a thread: the first message carries many handles and the child may still be
        # importing torch; the pipe would block the training thread until it reads.
        self._sender = threading.Thread(target=self._send, args=(message,), daemon=True)
        self._sender.start()

    def is_busy(self) -> bool:
        """True while the submitted save is not finished (without waiting or taking its result)."""
        if self._pending_step is None:
            return False
        assert self._sender is not None
        if self._sender.is_alive():
            return True
        try:
            return not self._conn.poll(0) and self._process.is_alive()
        except (EOFError, OSError):  # the child died: wait() reports it
            return False

    def wait(self) -> str | None:
        """Block until the submitted save is committed; its error as text, or None."""
        if self._pending_step is None:
            return None
        self._pending_step = None
        assert self._sender is not None
        self._sender.join()
        if self._send_error is not None:
            error, self._send_error = self._send_error, None
            return f"sending to the writer process failed: {error!r}"
        try:
            while not self._conn.poll(_PARENT_POLL_SECONDS):
                if not self._process.is_alive():
                    break
            kind, _, error = self._conn.recv()
        except (EOFError, OSError):  # the child died (its end of the pipe closed or reset)
            self._process.join(5)
            return f"the writer process exited with code {self._process.exitcode}"
        assert kind == "done", kind
        return error

    def close(self) -> None:
        """Stop the writer process (after the pending save: call wait() first)."""
        if self._process is None:
            return
        try:
            if self._process.is_alive():
                self._conn.send(("stop",))
        except (OSError, ValueError):
            pass  # the child is gone already
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._process = None
        self._sent = {}
        self._store = None

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except BaseException as e:  # reported by wait()
            self._send_error = e

    def _start(self) -> None:
        rendezvous = None
        if self._group.is_distributed:
            # The writers need their own process group: the trainer's cannot be shared across
            # processes. Rank 0's trainer hosts its store (it outlives every writer).
            address = [None]
            if self._group.rank == 0:
                self._store = dist.TCPStore(
                    "0.0.0.0", 0, is_master=True, wait_for_workers=False, use_libuv=True
                )
                host = os.environ.get("MASTER_ADDR") or socket.gethostname()
                address = [(host, self._store.port)]
            dist.broadcast_object_list(address, src=0, group=self._group.ctl)
            host, port = address[0]
            rendezvous = (host, port, self._group.rank, self._group.world_size)
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe(duplex=True)
        self._process = context.Process(
            target=_run_writer,
            args=(
                child_conn,
                os.getpid(),
                str(self._root),
                self._keep_last,
                self._keep_every,
                rendezvous,
            ),
            name=f"yatt-ckpt-writer-{self._group.rank}",
            daemon=True,
        )
        self._process.start()
        child_conn.close()


def _pack(value: Any, storages: dict[int, torch.UntypedStorage]) -> Any:
    if isinstance(value, DTensor):
        sizes, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        local = _pack(value._local_tensor, storages)
        assert isinstance(local, _TensorRef), "the stager puts DTensor shards in shared buffers"
        return _ShardRef(
            local=local,
            global_size=tuple(value.shape),
            sizes=tuple(sizes),
            offsets=tuple(offsets),
        )
    if type(value) in (torch.Tensor, torch.nn.Parameter) and value.device.type == "cpu":
        storage = value.untyped_storage()
        if not storage.is_shared():
            return value  # not a staging buffer: pickling moves it to shared memory (a copy)
        key = storage.data_ptr()
        storages[key] = storage
        return _TensorRef(
            key, value.dtype, value.storage_offset(), tuple(value.shape), tuple(value.stride())
        )
    if isinstance(value, Mapping):
        return {key: _pack(item, storages) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_pack(item, storages) for item in value)
    return value


def _unpack(value: Any, storages: dict[int, torch.UntypedStorage]) -> Any:
    if isinstance(value, _TensorRef):
        tensor = torch.empty(0, dtype=value.dtype)
        return tensor.set_(storages[value.key], value.offset, value.size, value.stride)
    if isinstance(value, _ShardRef):
        shard = _Shard._make_subclass(_Shard, _unpack(value.local, storages))
        shard.global_size = torch.Size(value.global_size)
        shard.sizes = torch.Size(value.sizes)
        shard.offsets = torch.Size(value.offsets)
        return shard
    if isinstance(value, Mapping):
        return {key: _unpack(item, storages) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_unpack(item, storages) for item in value)
    return value


class _Shard(torch.Tensor):
    """A DTensor's local shard without its device mesh (which lives in the trainer). DCP writes
    it through the checkpointable hooks DTensor uses, so the files are the same as the thread
    writer's."""

    global_size: torch.Size
    sizes: torch.Size
    offsets: torch.Size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, self.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self.__create_chunk_list__()[0],
                    properties=TensorProperties.create_from_tensor(self.as_subclass(torch.Tensor)),
                    size=self.global_size,
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.sizes)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset == self.offsets, (index, self.offsets)
        return self.as_subclass(torch.Tensor)


def _run_writer(
    conn: Any,
    parent_pid: int,
    root: str,
    keep_last: int,
    keep_every: int | None,
    rendezvous: tuple[str, int, int, int] | None,
) -> None:
    """The writer process: write each save it receives until "stop", EOF or its parent dies."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    from yatt.ckpt._writer import write_and_commit  # after the watchdog: imports take seconds

    # The write is I/O and memcpy; intra-op threads would only compete with the trainer.
    torch.set_num_threads(1)
    if rendezvous is not None:
        host, port, rank, world_size = rendezvous
        store = dist.TCPStore(host, port, is_master=False, use_libuv=True)
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("yatt-ckpt", store), rank=rank, world_size=world_size
        )
    group = RankGroup()
    storages: dict[int, torch.UntypedStorage] = {}
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            if message[0] == "stop":
                return
            _, step, packed, new, live_keys, record = message
            storages.update(new)
            storages = {key: storages[key] for key in live_keys}
            error = None
            try:
                write_and_commit(
                    Path(root),
                    step,
                    _unpack(packed, storages),
                    record,
                    group,
                    keep_last=keep_last,
                    keep_every=keep_every,
                )
            except BaseException as e:  # reported to the parent, raised by its wait()
                error = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
            conn.send(("done", step, error))
    finally:
        group.close()
        if rendezvous is not None:
            dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    # Orphaned children are re-parented (to init or a subreaper), so getppid changes.
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_SECONDS)
    os._exit(1)
