"""The process runtime: rank, device, process group and the (dp, tp) device mesh.

    torchrun --nproc-per-node 4 train.py      # RANK/WORLD_SIZE/... in the environment
    python train.py                           # one process: a world of 1, same code path

    with init_runtime(tp_size=1, seed=0) as rt:
        ...  # rt.dp_rank, rt.dp_size, rt.device, rt.dp_group, rt.mesh
    # the process group is destroyed here, also when the body raised

A single process still gets a real (world size 1) process group, so every collective in the
library runs unchanged and tests cover the same code as multi-process runs.
"""

from __future__ import annotations

import gc
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from yatt.core.runtime._threads import size_torch_threads

logger = logging.getLogger("yatt.core")

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def set_seed(seed: int) -> None:
    """Seed Python, numpy and torch (all devices) with `seed`."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(kw_only=True, eq=False)
class Runtime:
    """Where this process sits: global rank, its data- and tensor-parallel coordinates, device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    mesh: DeviceMesh | None  # dims ("dp", "tp"); None after shutdown()
    seed: int
    _owns_group: bool = field(default=False, repr=False)
    _shutdown_hooks: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def _live_mesh(self) -> DeviceMesh:
        """The mesh; a clear error once shutdown() has released it."""
        if self.mesh is None:
            raise RuntimeError("this Runtime was shut down: its process groups are destroyed")
        return self.mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self._live_mesh["dp"]

    @property
    def dp_rank(self) -> int:
        return self._live_mesh.get_local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self._live_mesh.size(self._live_mesh.mesh_dim_names.index("dp"))

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self._live_mesh.get_group("dp")

    @property
    def tp_rank(self) -> int:
        return self._live_mesh.get_local_rank("tp")

    @property
    def tp_size(self) -> int:
        return self._live_mesh.size(self._live_mesh.mesh_dim_names.index("tp"))

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self._live_mesh.get_group("tp")

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    def on_shutdown(self, hook: Callable[[], None]) -> None:
        """Call `hook` at shutdown(), before the process groups go (the last added first): for
        state built on this runtime's groups, such as Megatron's model-parallel groups, which
        a later runtime in the same process must not find still set."""
        self._shutdown_hooks.append(hook)

    def shutdown(self) -> None:
        """Run the on_shutdown hooks; destroy the process groups this runtime created, and
        their threads (idempotent).

        destroy_process_group only unregisters the groups: the mesh's registry still holds
        them (and DTensor's caches hold the mesh), so gloo's worker threads would live until
        interpreter exit, where one that needs the GIL aborts a finished process with
        "terminate called without an active exception". Emptying the registry and collecting
        cyclic garbage (an FSDP2 module's hooks) stops them now, while the interpreter lives.
        """
        while self._shutdown_hooks:
            hook = self._shutdown_hooks.pop()
            try:
                hook()
            except Exception:  # a failed teardown must not keep the groups alive
                logger.exception("Runtime.shutdown: the hook %r failed", hook)
        if not self._owns_group:
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
        registry = getattr(self.mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
        self.mesh = None
        gc.collect()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            # Say which rank failed: with N ranks the first traceback is otherwise anonymous.
            logger.error(
                "rank %d/%d failed: %s: %s", self.rank, self.world_size, exc_type.__name__, exc
            )
        self.shutdown()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from err


def init_runtime(
    *,
    tp_size: int = 1,
    seed: int = 0,
    device: str | torch.device | None = None,
    backend: str | None = None,
    timeout_s: float = 1800.0,
) -> Runtime:
    """Join (or create) the process group from torchrun's environment and build the mesh.

    device: "cuda"/"cpu" or a full device; default CUDA (cuda:LOCAL_RANK) when available.
    backend: default "cpu:gloo,cuda:nccl" on CUDA (CPU tensors still work in collectives)
    and "gloo" on CPU. tp_size must divide the world size; dp = world / tp, with tp ranks
    adjacent (the tp dimension is the fast one, so it stays within a node).
    An already-initialised process group is reused and left alive at shutdown.
    Unless OMP_NUM_THREADS is set, torch's CPU threads are sized to this rank's share of the
    usable CPUs (affinity and cgroup quota over LOCAL_WORLD_SIZE; see _threads.py).
    """
    is_launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if is_launched:
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise ValueError(f"RANK is set but {missing} are not; launch with torchrun")
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    if not isinstance(tp_size, int) or tp_size < 1 or world_size % tp_size:
        raise ValueError(
            f"tp_size={tp_size!r} must be a positive divisor of the world size {world_size}"
        )

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device} requested but CUDA is not available; use device='cpu'"
            )
        if device.index is None:
            if local_rank >= torch.cuda.device_count():
                raise ValueError(
                    f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                    "launch at most one process per GPU"
                )
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    # Before any kernel runs: torch's default (every core, per rank) oversubscribes a shared
    # machine and a node of several ranks.
    size_torch_threads()

    owns_group = False
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if is_launched:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            # A world of one needs no rendezvous; an in-memory store keeps the ports free.
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        owns_group = True
    try:
        mesh = init_device_mesh(
            device.type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp")
        )
    except Exception:
        if owns_group:
            dist.destroy_process_group()
        raise
    set_seed(seed)
    return Runtime(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=backend,
        mesh=mesh,
        seed=seed,
        _owns_group=owns_group,
    )
