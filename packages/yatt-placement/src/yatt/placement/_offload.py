"""Offload a module's or an optimizer's tensors to host memory and bring them back in place.

For memory allocated outside any region (a trainer built by ordinary code), moving is the way
to free the GPU. Every tensor keeps its Python object: only its `.data` is swapped, so
`Parameter`s, `.grad`s, optimizer state entries and any reference a user holds stay valid,
and training continues as if nothing happened.

    offload(model); offload(optimizer)      # params, grads, buffers, optimizer state -> host
    ...                                     # the GPU is free for the rollout engine
    engine.update_weights(offloaded_named_parameters(model))  # weight sync from the host copies
    onload(model); onload(optimizer)        # back to the devices they came from

Host copies are pinned when CUDA is available (fast, asynchronous copies). On a CPU-only
machine the move is a copy within host memory: nothing is freed, but the same path runs, so
CPU tests cover it.

Why onload allocates in a private pool: torch's caching allocator carves tensors out of any
cached segment big enough, so a trainer built (or onloaded) right after a large tensor was
freed shares that segment with whatever else is allocated next (a clone of the weights, a batch,
another model). Freeing the trainer's blocks then returns nothing to the device: the segment
stays as long as one neighbour lives. Onload therefore puts an object's tensors in a
`torch.cuda.MemPool` of its own, which offload drops, so from the first onload on an offload
returns every byte. The first offload of a trainer built by ordinary code can still be short;
offload logs a warning with the numbers when it is.

Why a CUDA tensor keeps a CUDA placeholder while offloaded: assigning `.data` of another device
resets a parameter's autograd grad accumulator, and with it every hook registered there (DDP's
gradient all-reduce hooks among them: DDP would then silently skip the all-reduce). So an
offloaded CUDA tensor's `.data` is an empty tensor on the same device and dtype, and its
contents wait in `_Moved.hosts`; only the device-less CPU case swaps in the host copy itself.
Code that reads an offloaded model's values (weight sync) therefore goes through
`offloaded_named_parameters`, and `is_offload_placeholder` tells such a placeholder apart.

Why host copies are views into shared slabs: torch's caching host allocator rounds each pinned
allocation up to a power of two (unless torch's pinned_max_round_threshold_mb says otherwise),
and keeps the rounded block cached after onload. A 7B model's float32 matrices (272 MB MLP
rows, 2.2 GB embeddings) then pin 54 GiB for 28 GiB of weights, and the AdamW state 108 GiB
for 57. Offload therefore packs an object's contiguous tensors into slabs whose sizes are
powers of two already (`plan_host_slabs`), so the allocator rounds nothing and host RAM pinned
is the bytes moved plus at most one slab's tail. `pinned_host_bytes` is what it pins, for a
host-memory check before anything moves.

FSDP2 modules, and optimizers whose state is sharded, move with `.to()` instead: see
`_offload_dtensor`.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from yatt.placement import _offload_dtensor
from yatt.placement._capture_guard import empty_cache, synchronize

logger = logging.getLogger(__name__)

Offloadable = torch.nn.Module | torch.optim.Optimizer
# An offload that returns less than this share of the bytes it moved is reported.
_MIN_SHORTFALL_BYTES = 2**20
_SHORT_RELEASE_FRACTION = 0.9
# Host slabs: a tensor's copy starts at a multiple of this (any dtype's alignment), and a slab
# is at least this large unless the whole object is smaller (see plan_host_slabs).
_SLAB_ALIGN_BYTES = 512
_SLAB_BYTES = 1 << 30


@dataclass(kw_only=True)
class _Moved:
    """Where each tensor of one offloaded object lives when onloaded."""

    tensors: list[torch.Tensor]
    devices: list[torch.device]
    hosts: list[torch.Tensor]  # the contents, in host memory, while offloaded
    num_bytes: int
    device_bytes: int  # of num_bytes, those that left a CUDA device
    by_to: bool = False  # moved with .to() (FSDP2): tensors/hosts are empty, devices[0] is home
    host_bytes: int = 0  # host memory held: the slabs, and the unpacked tensors' copies


# Keyed weakly so an offloaded object that the user drops is not kept alive by the books.
_OFFLOADED: weakref.WeakKeyDictionary[Offloadable, _Moved] = weakref.WeakKeyDictionary()
# The private pools (one per CUDA device) holding an onloaded object's tensors; see the top.
_POOLS: weakref.WeakKeyDictionary[Offloadable, dict[torch.device, object]] = (
    weakref.WeakKeyDictionary()
)


def _tensors_of(obj: Offloadable) -> Iterator[torch.Tensor]:
    """Every tensor `obj` owns, each once (tied weights share one Parameter)."""
    seen: set[int] = set()

    def once(tensor: torch.Tensor | None) -> Iterator[torch.Tensor]:
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor

    if isinstance(obj, torch.nn.Module):
        for param in obj.parameters():
            yield from once(param)
            yield from once(param.grad)
        for buffer in obj.buffers():
            yield from once(buffer)
    elif isinstance(obj, torch.optim.Optimizer):
        # Parameters belong to the module; the optimizer owns only its state.
        for state in obj.state.values():
            for value in state.values():
                yield from once(value)
    else:
        raise TypeError(
            f"offload/onload take a torch.nn.Module or torch.optim.Optimizer, got {type(obj).__name__}"
        )


def _synchronize_all() -> None:
    synchronize()  # never inside another thread's CUDA-graph capture (_capture_guard)


def _has_private_pools() -> bool:
    # torch.cuda.MemPool and use_mem_pool arrived in torch 2.5; older versions allocate as before.
    return hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")


def _reserved_bytes(devices: Iterable[torch.device]) -> int:
    return sum(torch.cuda.memory_reserved(device) for device in set(devices))


def _release_device_memory(devices: list[torch.device], *, moved_bytes: int, before: int) -> None:
    """Hand freed cached blocks back to the driver; warn when fewer bytes came back than the
    `moved_bytes` offload moved off the device (`before`: memory_reserved of `devices` then)."""
    empty_cache()
    released = before - _reserved_bytes(devices)
    shortfall = moved_bytes - max(released, 0)
    # Under a MiB is allocator rounding (a few small tensors), not memory held back.
    if released < _SHORT_RELEASE_FRACTION * moved_bytes and shortfall >= _MIN_SHORTFALL_BYTES:
        logger.warning(
            "offload moved %.1f MiB to host but the caching allocator returned only %.1f MiB to "
            "the device: the rest shares allocator segments with tensors still alive (allocated "
            "after a large tensor was freed), or someone holds the old storage of an offloaded "
            "tensor. From the next offload on, the object's tensors live in a pool of their own "
            "and come back whole.",
            moved_bytes / 2**20,
            max(released, 0) / 2**20,
        )


def _next_power_of_two(num_bytes: int) -> int:
    return 1 << max(0, num_bytes - 1).bit_length()


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // _SLAB_ALIGN_BYTES) * _SLAB_ALIGN_BYTES


@dataclass(frozen=True)
class HostSlabs:
    """Where offload puts an object's host copies: `sizes[k]` bytes per slab (each a power of
    two, so torch's pinned allocator rounds nothing), and per tensor (slab, byte offset)."""

    sizes: list[int]
    places: list[tuple[int, int]]


def plan_host_slabs(tensor_sizes: Sequence[int]) -> HostSlabs:
    """Pack tensors of `tensor_sizes` bytes (each > 0) into power-of-two slabs, largest first.

    A slab has the size of the next power of two of the largest tensor, or of
    min(total, `_SLAB_BYTES`) if larger; each tensor goes into the first slab with room (each
    copy starts on a `_SLAB_ALIGN_BYTES` boundary), and each slab then shrinks to the next
    power of two of what it holds. What is pinned beyond the bytes moved: the alignment, the
    slabs' unfilled tails (small tensors fill the big ones' gaps) and the last slab's rounding.
    """
    if any(size <= 0 for size in tensor_sizes):
        raise ValueError(f"plan_host_slabs: sizes must be > 0, got {list(tensor_sizes)[:8]}")
    if not tensor_sizes:
        return HostSlabs(sizes=[], places=[])
    total = sum(_aligned(size) for size in tensor_sizes)
    slab = _next_power_of_two(max(_aligned(max(tensor_sizes)), min(total, _SLAB_BYTES)))
    used: list[int] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(tensor_sizes)
    for index in sorted(range(len(tensor_sizes)), key=lambda i: -tensor_sizes[i]):
        need = _aligned(tensor_sizes[index])
        k = next((k for k, u in enumerate(used) if u + need <= slab), len(used))
        if k == len(used):
            used.append(0)
        places[index] = (k, used[k])
        used[k] += need
    return HostSlabs(sizes=[_next_power_of_two(u) for u in used], places=places)


def _packs(tensor: torch.Tensor) -> bool:
    """Whether offload copies `tensor` into a slab: contiguous, not empty, and bound for pinned
    memory (a CUDA tensor), or any tensor without CUDA (the same path, unpinned, for tests)."""
    return (
        tensor.is_contiguous()
        and tensor.nbytes > 0
        and (tensor.is_cuda or not torch.cuda.is_available())
    )


def pinned_host_bytes(tensor_sizes: Sequence[int]) -> int:
    """Host bytes offload holds for tensors of these sizes (bytes): its slabs. Tensors that are
    not packed (non-contiguous) take their own, rounded, block; not counted here."""
    return sum(plan_host_slabs([size for size in tensor_sizes if size > 0]).sizes)


def host_bytes_of(obj: Offloadable) -> int:
    """Host bytes offloading `obj` as it is now holds (its slabs), wherever it is now."""
    moved = _OFFLOADED.get(obj)
    if moved is not None:
        return moved.host_bytes
    if _offload_dtensor.moves_by_to(obj):
        return sum(_offload_dtensor.local_tensor(t).nbytes for t in _tensors_of(obj))
    return pinned_host_bytes([t.nbytes for t in _tensors_of(obj) if _packs(t)])


def _host_copies(tensors: Sequence[torch.Tensor], pin: bool) -> tuple[list[torch.Tensor], int]:
    """An empty host tensor per tensor, packed ones as views into shared slabs; and the slabs'
    bytes."""
    packed = [i for i, tensor in enumerate(tensors) if _packs(tensor)]
    slabs = plan_host_slabs([tensors[i].nbytes for i in packed])
    buffers = [
        torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=pin) for size in slabs.sizes
    ]
    hosts: list[torch.Tensor | None] = [None] * len(tensors)
    for i, (k, offset) in zip(packed, slabs.places, strict=True):
        tensor = tensors[i]
        flat = buffers[k][offset : offset + tensor.nbytes]
        hosts[i] = flat.view(tensor.dtype).view(tensor.shape)
    for i, tensor in enumerate(tensors):
        if hosts[i] is None:
            hosts[i] = torch.empty_like(
                tensor.data, device="cpu", pin_memory=pin and tensor.is_cuda
            )
    return [host for host in hosts if host is not None], sum(slabs.sizes)


def _move_to_host(obj: Offloadable) -> _Moved:
    if _offload_dtensor.moves_by_to(obj):
        home = _offload_dtensor.device_of(obj)
        num_bytes = sum(_offload_dtensor.local_tensor(t).nbytes for t in _tensors_of(obj))
        _offload_dtensor.move(obj, "cpu")
        moved = _Moved(
            tensors=[],
            devices=[home],
            hosts=[],
            num_bytes=num_bytes,
            device_bytes=num_bytes if home.type == "cuda" else 0,
            by_to=True,
            host_bytes=num_bytes,
        )
        _OFFLOADED[obj] = moved
        return moved
    tensors = list(_tensors_of(obj))
    # Pinned slabs come from torch's caching host allocator: freed at onload they stay cached,
    # and the next offload of the same tensors asks for the same sizes and takes them back, so
    # cudaMallocHost runs in the first cycle only; the cache keeps that host RAM pinned while
    # the object is onloaded.
    hosts, slab_bytes = _host_copies(tensors, pin=torch.cuda.is_available())
    for tensor, host in zip(tensors, hosts, strict=True):
        # Device-to-pinned copies are asynchronous; the synchronize below completes them.
        host.copy_(tensor.data, non_blocking=True)
    _synchronize_all()
    devices = [tensor.device for tensor in tensors]
    for tensor, host in zip(tensors, hosts, strict=True):
        # Same device and dtype: keeps the grad accumulator and its hooks (see the top).
        tensor.data = (
            torch.empty(0, dtype=host.dtype, device=tensor.device) if tensor.is_cuda else host
        )
    moved = _Moved(
        tensors=tensors,
        devices=devices,
        hosts=hosts,
        num_bytes=sum(h.nbytes for h in hosts),
        device_bytes=sum(h.nbytes for h, d in zip(hosts, devices, strict=True) if d.type == "cuda"),
        host_bytes=slab_bytes
        + sum(h.nbytes for h, t in zip(hosts, tensors, strict=True) if not _packs(t)),
    )
    _OFFLOADED[obj] = moved
    # Without its pools nothing keeps the object's old segments; empty_cache can return them.
    _POOLS.pop(obj, None)
    return moved


def offload(obj: Offloadable, *, should_empty_cache: bool = True) -> int:
    """Move `obj`'s tensors to host memory; returns the bytes moved.

    For a module: parameters, their gradients and buffers. For an optimizer: its state (moments,
    steps). should_empty_cache: return the freed blocks from torch's caching allocator to the
    device, so other processes (an SGLang or vLLM server) can use them; a warning is logged when
    fewer bytes come back than were moved.
    Raises RuntimeError if `obj` is already offloaded.
    """
    return offload_all((obj,), should_empty_cache=should_empty_cache)


def offload_all(objs: Sequence[Offloadable], *, should_empty_cache: bool = True) -> int:
    """`offload` for several objects with one empty_cache at the end; returns the bytes moved.

    Raises RuntimeError, before moving anything, if one of them is already offloaded.
    """
    for obj in objs:
        if obj in _OFFLOADED:
            raise RuntimeError(
                f"offload: this {type(obj).__name__} is already offloaded; onload it first"
            )
    devices = sorted({t.device for obj in objs for t in _tensors_of(obj) if t.is_cuda}, key=str)
    reserved_before = _reserved_bytes(devices)
    moves = [_move_to_host(obj) for obj in objs]
    if should_empty_cache and devices:
        moved_bytes = sum(move.device_bytes for move in moves)
        _release_device_memory(devices, moved_bytes=moved_bytes, before=reserved_before)
    return sum(move.num_bytes for move in moves)


def onload(obj: Offloadable) -> int:
    """Move `obj`'s tensors back to the devices they were offloaded from; returns the bytes moved.

    Tensors added to `obj` while it was offloaded (e.g. a gradient created on the host) are left
    where they are. Raises RuntimeError if `obj` is not offloaded.
    """
    moved = _OFFLOADED.get(obj)
    if moved is None:
        raise RuntimeError(f"onload: this {type(obj).__name__} is not offloaded; offload it first")
    if moved.by_to:
        _offload_dtensor.move(obj, moved.devices[0])
        del _OFFLOADED[obj]
        return moved.num_bytes
    pools: dict[torch.device, object] = {}
    backs = []
    with contextlib.ExitStack() as private_pools:
        for host, device in zip(moved.hosts, moved.devices, strict=True):
            if device.type == "cuda" and device not in pools and _has_private_pools():
                with torch.cuda.device(device):  # a pool belongs to the device it is made on
                    pools[device] = torch.cuda.MemPool()
                # This thread's allocations on `device` go to the pool until the stack closes.
                private_pools.enter_context(torch.cuda.use_mem_pool(pools[device], device=device))
            back = torch.empty_like(host, device=device)
            back.copy_(host, non_blocking=True)
            backs.append(back)
    # The pinned sources are freed when `.data` is swapped; wait for the copies out of them.
    _synchronize_all()
    for tensor, back in zip(moved.tensors, backs, strict=True):
        tensor.data = back
    del _OFFLOADED[obj]
    if pools:
        _POOLS[obj] = pools
    return moved.num_bytes


def is_offloaded(obj: Offloadable) -> bool:
    """Whether `obj` is offloaded now."""
    return obj in _OFFLOADED


def offloaded_named_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`module.named_parameters()`, each value read from where offload keeps it now.

    While `module` is offloaded its CUDA parameters are empty placeholders (see the top) and
    their values wait in host copies, pinned on CUDA; this yields those host copies, so weight
    sync can stream an offloaded trainer to a rollout engine without onloading it:

        offload(trainer)
        engine.update_weights(offloaded_named_parameters(trainer))  # pinned host -> engine

    While `module` is onloaded (Plan(offload="auto") may have kept it awake) this yields the
    parameters themselves, and an FSDP2 module offloaded with .to() yields its CPU DTensors.
    The host copies are offload's: read them before onload(module), which frees them.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"offloaded_named_parameters takes a torch.nn.Module, got {type(module).__name__}"
        )
    moved = _OFFLOADED.get(module)
    hosts: dict[int, torch.Tensor] = {}
    if moved is not None:
        # Keyed by id: the record keeps every tensor in `moved.tensors` alive, so ids are stable.
        hosts = {id(t): host for t, host in zip(moved.tensors, moved.hosts, strict=True)}
    # A generator, like named_parameters(): a sender consumes it one bucket at a time.
    return ((name, hosts.get(id(param), param)) for name, param in module.named_parameters())


def is_offload_placeholder(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is an empty placeholder that offload() left on a device while the
    values (a non-empty host copy) wait in host memory; read those with
    `offloaded_named_parameters`, or onload the owner first."""
    if tensor.numel() != 0:  # the common case, answered without looking through the books
        return False
    for moved in list(_OFFLOADED.values()):  # a snapshot: the weak dict may shrink meanwhile
        for owned, host in zip(moved.tensors, moved.hosts, strict=True):
            if owned is tensor:
                return host.numel() != 0
    return False


def offloaded_bytes(obj: Offloadable) -> int:
    """Bytes of `obj` held in host memory by offload(); 0 when onloaded."""
    moved = _OFFLOADED.get(obj)
    return 0 if moved is None else moved.num_bytes


def tensor_bytes(obj: Offloadable) -> int:
    """Bytes of every tensor `obj` owns, wherever they are."""
    return sum(tensor.nbytes for tensor in _tensors_of(obj))
