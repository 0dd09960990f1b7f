"""The two mechanisms behind memory regions: torch_memory_saver on CUDA, bookkeeping on CPU.

A backend does the work for one tag at a time; the registry in `_regions.py` owns the rules
(known tags, pause state, CPU backup chosen once per tag) so both backends obey the same ones.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Literal, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from yatt.placement._capture_guard import may_sync

logger = logging.getLogger(__name__)

HookMode = Literal["torch", "preload"]


class RegionBackend(Protocol):
    """What the registry needs from a backend; tags reach it already validated."""

    name: str

    def region(self, tag: str, enable_cpu_backup: bool) -> AbstractContextManager[None]: ...

    def allocated_bytes(self, tag: str) -> int: ...

    def pause(self, tag: str, enable_cpu_backup: bool) -> None: ...

    def resume(self, tag: str, enable_cpu_backup: bool) -> None: ...


class TorchMemorySaverBackend:
    """CUDA: torch_memory_saver unmaps the physical pages and keeps the virtual addresses.

    Bytes per tag are what the caching allocator reserved while the tag's region was open (the
    tag's pool only grows inside its regions). That is what a pause releases, give or take the
    allocation granularity; it over-counts if `torch.cuda.empty_cache()` later trims the pool.

    retain_cpu_backup: see `configure_regions`; None leaves torch_memory_saver's own setting
    (its TMS_RETAIN_CPU_BACKUP environment variable) when that variable is set, else turns it on.
    """

    name = "cuda"

    def __init__(self, hook_mode: HookMode, retain_cpu_backup: bool | None = None) -> None:
        try:
            from torch_memory_saver import torch_memory_saver
        except ImportError as exc:
            raise ImportError(
                "yatt.placement needs torch_memory_saver for memory regions on CUDA; install it "
                "with `pip install 'yatt-placement[cuda]'`, or call "
                "configure_regions(backend='cpu') to use bookkeeping only (frees no GPU memory)"
            ) from exc
        impl = getattr(torch_memory_saver, "_impl", None)
        if impl is None:
            torch_memory_saver.hook_mode = hook_mode
        elif getattr(impl, "_hook_mode", hook_mode) != hook_mode:
            # Another library (an in-process SGLang, say) initialised the process-wide singleton
            # first; its mode cannot change any more, so say which one is in force.
            logger.warning(
                "torch_memory_saver is already initialised with hook_mode=%r; "
                "yatt.placement asked for %r and uses the existing one",
                impl._hook_mode,
                hook_mode,
            )
        _set_retain_cpu_backup(torch_memory_saver, retain_cpu_backup)
        self._saver = torch_memory_saver
        self._bytes: dict[str, int] = {}
        atexit.unregister(_let_pools_free_at_exit)  # once per process, however many backends
        atexit.register(_let_pools_free_at_exit, torch_memory_saver)

    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool) -> Iterator[None]:
        device = torch.cuda.current_device()
        reserved_before = torch.cuda.memory_reserved(device)
        try:
            with self._saver.region(tag=tag, enable_cpu_backup=enable_cpu_backup):
                yield
        finally:
            grown = torch.cuda.memory_reserved(device) - reserved_before
            self._bytes[tag] = self._bytes.get(tag, 0) + max(0, grown)

    def allocated_bytes(self, tag: str) -> int:
        return self._bytes.get(tag, 0)

    def pause(self, tag: str, enable_cpu_backup: bool) -> None:
        # Kernels queued on this memory must finish before its pages are unmapped; unmapping
        # and mapping pages synchronise the device too (see _capture_guard).
        with may_sync():
            torch.cuda.synchronize()
            self._saver.pause(tag)

    def resume(self, tag: str, enable_cpu_backup: bool) -> None:
        with may_sync():
            self._saver.resume(tag)


def _set_retain_cpu_backup(saver, retain: bool | None) -> None:
    """Keep each backed-up allocation's pinned host shadow from one pause to the next.

    Without it torch_memory_saver cudaFreeHost's the shadow at every resume and cudaMallocHost's
    a new one at every pause: about a second per RL step for a few 0.5B models. A retained
    shadow is refilled from the device at each pause (so weights updated in between are saved),
    and costs host RAM equal to the backed-up bytes while awake too. The setting is
    process-wide, and torch_memory_saver supports it on CUDA only (ROCm keeps its shadows anyway).
    """
    if retain is None:
        if os.environ.get("TMS_RETAIN_CPU_BACKUP") is not None:
            return  # the user chose through torch_memory_saver's own variable
        retain = True
    if torch.version.cuda is None or torch.version.hip is not None:
        logger.info(
            "retain_cpu_backup=%s ignored: torch_memory_saver supports it on CUDA only", retain
        )
        return
    if not hasattr(type(saver), "retain_cpu_backup"):
        logger.warning(
            "this torch_memory_saver has no retain_cpu_backup (0.0.10 added it): every pause "
            "allocates a new pinned host shadow; upgrade with `pip install -U torch-memory-saver`"
        )
        return
    # The setter initialises the singleton, so hook_mode must be set before this.
    saver.retain_cpu_backup = retain


def _let_pools_free_at_exit(saver) -> None:
    """Let torch_memory_saver's pools hand their cached blocks back while Python shuts down.

    In hook_mode="torch" each tag has a torch MemPool whose blocks are freed by
    torch_memory_saver, which calls exit(1) when a free arrives outside a region. The pools are
    destroyed at interpreter shutdown, after this atexit hook; a tag whose tensors were deleted
    still caches their blocks then, and their free would turn a clean exit into status 1.
    Marking this (the main) thread as inside a region makes those frees ordinary ones.
    """
    impl = getattr(saver, "_impl", None)
    if impl is None or getattr(impl, "_hook_mode", None) != "torch":
        return
    try:
        impl._binary_wrapper.cdll.tms_set_interesting_region(True)
    except AttributeError:  # a torch_memory_saver without this entry point: nothing to do
        logger.debug("torch_memory_saver has no tms_set_interesting_region", exc_info=True)


class _ClaimNewStorages(TorchDispatchMode):
    """Hands every storage that an op creates (not a view, not an in-place result) to `claim`."""

    def __init__(self, claim) -> None:
        super().__init__()
        self._claim = claim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A return with alias info is a view of, or the same memory as, an input.
        if any(ret.alias_info is not None for ret in func._schema.returns):
            return out
        for leaf in torch.utils._pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
                self._claim(leaf.untyped_storage())
        return out


class CpuBookkeepingBackend:
    """CPU (or tests): the same API and rules, with nothing released.

    Storages created inside a region are tracked by a dispatch mode, so bytes per tag are exact.
    A pause fills the tag's storages with 0xFF bytes (NaN for floats) and a resume restores them
    only when the tag has CPU backup: code that reads a paused tensor, or relies on a region
    without backup keeping its contents, fails on CPU as it would on a GPU.
    """

    name = "cpu"

    def __init__(self) -> None:
        self._storages: dict[str, dict[int, weakref.ref]] = {}
        self._claimed: set[int] = set()
        self._backups: dict[str, list[tuple[weakref.ref, torch.UntypedStorage]]] = {}
        self._local = threading.local()

    def _active_tags(self) -> list[str]:
        if not hasattr(self._local, "tags"):
            self._local.tags = []
        return self._local.tags

    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool) -> Iterator[None]:
        self._storages.setdefault(tag, {})
        active = self._active_tags()
        active.append(tag)
        try:
            with _ClaimNewStorages(self._claim):
                yield
        finally:
            active.pop()

    def _claim(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        # Nested regions each see the op; the innermost tag owns the storage.
        if key in self._claimed or storage.nbytes() == 0:
            return
        tag = self._active_tags()[-1]
        self._claimed.add(key)
        owned = self._storages[tag]

        def forget(_ref: weakref.ref, key: int = key) -> None:
            self._claimed.discard(key)
            owned.pop(key, None)

        owned[key] = weakref.ref(storage, forget)

    def _live(self, tag: str) -> list[torch.UntypedStorage]:
        storages = (ref() for ref in list(self._storages.get(tag, {}).values()))
        return [s for s in storages if s is not None]

    def allocated_bytes(self, tag: str) -> int:
        return sum(s.nbytes() for s in self._live(tag))

    def pause(self, tag: str, enable_cpu_backup: bool) -> None:
        backups = []
        for storage in self._live(tag):
            if enable_cpu_backup:
                backup = torch.UntypedStorage(storage.nbytes(), device="cpu")
                backup.copy_(storage)
                backups.append((weakref.ref(storage), backup))
            storage.fill_(0xFF)
        self._backups[tag] = backups

    def resume(self, tag: str, enable_cpu_backup: bool) -> None:
        for ref, backup in self._backups.pop(tag, []):
            storage = ref()
            if storage is not None:
                storage.copy_(backup)
