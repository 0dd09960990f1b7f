"""Offload a module's or an optimizer's tensors to host memory and bring them back in place.

For memory allocated outside any region (a trainer built by ordinary code), moving is the way
to free the GPU. Every tensor keeps its Python object: only its `.data` is swapped, so
`Parameter`s, `.grad`s, optimizer state entries and any reference a user holds stay valid,
and training continues as if nothing happened.

    offload(model); offload(optimizer)      # params, grads, buffers, optimizer state -> host
    ...                                     # the GPU is free for the rollout engine
    onload(model); onload(optimizer)        # back to the devices they came from

Host copies are pinned when CUDA is available (fast, asynchronous copies). On a CPU-only
machine the move is a copy within host memory: nothing is freed, but the same path runs, so
CPU tests cover it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

Offloadable = torch.nn.Module | torch.optim.Optimizer


@dataclass(kw_only=True)
class _Moved:
    """Where each tensor of one offloaded object lives when onloaded."""

    tensors: list[torch.Tensor]
    devices: list[torch.device]
    num_bytes: int


# Keyed weakly so an offloaded object that the user drops is not kept alive by the books.
_OFFLOADED: weakref.WeakKeyDictionary[Offloadable, _Moved] = weakref.WeakKeyDictionary()


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
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def offload(obj: Offloadable, *, should_empty_cache: bool = True) -> int:
    """Move `obj`'s tensors to host memory; returns the bytes moved.

    For a module: parameters, their gradients and buffers. For an optimizer: its state (moments,
    steps). should_empty_cache: return the freed blocks from torch's caching allocator to the
    device, so other processes (an SGLang or vLLM server) can use them.
    Raises RuntimeError if `obj` is already offloaded.
    """
    if obj in _OFFLOADED:
        raise RuntimeError(
            f"offload: this {type(obj).__name__} is already offloaded; onload it first"
        )
    tensors = list(_tensors_of(obj))
    pin = torch.cuda.is_available()
    hosts = []
    for tensor in tensors:
        host = torch.empty_like(tensor.data, device="cpu", pin_memory=pin and tensor.is_cuda)
        # Device-to-pinned copies are asynchronous; the synchronize below completes them.
        host.copy_(tensor.data, non_blocking=True)
        hosts.append(host)
    _synchronize_all()
    devices = [tensor.device for tensor in tensors]
    for tensor, host in zip(tensors, hosts, strict=True):
        tensor.data = host
    num_bytes = sum(host.nbytes for host in hosts)
    _OFFLOADED[obj] = _Moved(tensors=tensors, devices=devices, num_bytes=num_bytes)
    if should_empty_cache and any(device.type == "cuda" for device in devices):
        torch.cuda.empty_cache()
    return num_bytes


def onload(obj: Offloadable) -> int:
    """Move `obj`'s tensors back to the devices they were offloaded from; returns the bytes moved.

    Tensors added to `obj` while it was offloaded (e.g. a gradient created on the host) are left
    where they are. Raises RuntimeError if `obj` is not offloaded.
    """
    moved = _OFFLOADED.get(obj)
    if moved is None:
        raise RuntimeError(f"onload: this {type(obj).__name__} is not offloaded; offload it first")
    backs = []
    for tensor, device in zip(moved.tensors, moved.devices, strict=True):
        back = torch.empty_like(tensor.data, device=device)
        back.copy_(tensor.data, non_blocking=True)
        backs.append(back)
    # The pinned sources are freed when `.data` is swapped; wait for the copies out of them.
    _synchronize_all()
    for tensor, back in zip(moved.tensors, backs, strict=True):
        tensor.data = back
    del _OFFLOADED[obj]
    return moved.num_bytes


def is_offloaded(obj: Offloadable) -> bool:
    """Whether `obj` is offloaded now."""
    return obj in _OFFLOADED


def offloaded_bytes(obj: Offloadable) -> int:
    """Bytes of `obj` held in host memory by offload(); 0 when onloaded."""
    moved = _OFFLOADED.get(obj)
    return 0 if moved is None else moved.num_bytes


def tensor_bytes(obj: Offloadable) -> int:
    """Bytes of every tensor `obj` owns, wherever they are."""
    return sum(tensor.nbytes for tensor in _tensors_of(obj))
