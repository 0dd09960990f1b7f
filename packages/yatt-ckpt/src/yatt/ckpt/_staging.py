"""Copy a state dict into host memory, reusing the previous save's buffers.

This copy is all an async save blocks the training loop on; the background thread then writes
it while training goes on. torch has a stager for this (torch.distributed.checkpoint.staging.
DefaultStager), but it is young and moves between releases: it does not exist before torch 2.8,
and torch 2.11's clears its deep-copy dispatch table after each stage, so its second stage of
any state dict fails with `KeyError: <class 'type'>` (the fallback deep copy reaches a class
object, whose entry was cleared). Only tensors need care here, so this module copies them into
buffers it keeps and deep-copies every other leaf with `copy.deepcopy`.

    stager = HostStager(pin_memory=torch.cuda.is_available())
    staged = stager.stage(live)   # returns once every device-to-host copy has landed
    write(staged)                 # finish before the next stage(): it overwrites the buffers
    stager.close()
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

# A leaf's place in the state dict: the keys and list indices from the root.
Path = tuple[Hashable, ...]


class HostStager:
    """Stages state dicts into host buffers, one per tensor leaf, kept for the next stage().

    A buffer is reused while its leaf keeps its place, shape and dtype; buffers of leaves gone
    from the state are dropped. pin_memory: page-locked buffers for CUDA tensors (only those),
    so device-to-host copies run asynchronously at full link speed. share_memory: buffers in shared
    memory (`share_memory_()`), so a writer process maps them without a copy; with pin_memory
    they are page-locked in place with cudaHostRegister (torch's pinned allocator cannot hand
    out shared memory).
    """

    def __init__(self, *, pin_memory: bool, share_memory: bool = False) -> None:
        self._pin_memory = pin_memory
        self._share_memory = share_memory
        self._buffers: dict[Path, torch.Tensor] = {}
        # data_ptr -> storage of every buffer this stager registered with cudaHostRegister.
        self._registered: dict[int, torch.UntypedStorage] = {}

    def stage(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """A host copy of `state_dict`: same nesting, tensors in host buffers (DTensors keep
        their sharding spec), other leaves deep-copied. Tensors that are one object in the
        input are one object in the copy."""
        visit = _Visit()
        with torch.no_grad():
            staged = self._copy(state_dict, (), visit)
        # Non-blocking device-to-host copies are queued on each device's current stream; the
        # caller may change its tensors as soon as this returns, so wait for them here.
        for device in visit.cuda_devices:
            torch.cuda.synchronize(device)
        self._buffers = visit.buffers
        kept = {b.untyped_storage().data_ptr() for b in self._buffers.values()}
        for ptr in [p for p in self._registered if p not in kept]:
            self._unregister(ptr)
        return staged

    def close(self) -> None:
        """Drop the buffers (pinned host memory goes back to torch's host allocator, registered
        shared memory is unregistered)."""
        for ptr in list(self._registered):
            self._unregister(ptr)
        self._buffers = {}

    def _copy(self, value: Any, path: Path, visit: _Visit) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in visit.memo:
                visit.memo[id(value)] = self._copy_tensor(value, path, visit)
            return visit.memo[id(value)]
        if isinstance(value, Mapping):
            return {key: self._copy(item, (*path, key), visit) for key, item in value.items()}
        if type(value) in (list, tuple):
            items = [self._copy(item, (*path, i), visit) for i, item in enumerate(value)]
            return type(value)(items)
        return copy.deepcopy(value)

    def _copy_tensor(self, tensor: torch.Tensor, path: Path, visit: _Visit) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            local = self._copy_plain(tensor._local_tensor, path, visit)
            # The shard's spec (mesh, placements, global shape) is kept, so DCP writes this
            # rank's shard under the same global layout; the data is the host copy.
            return DTensor(local, tensor._spec, requires_grad=False)
        if type(tensor) in (torch.Tensor, torch.nn.Parameter):
            return self._copy_plain(tensor, path, visit)
        # Other tensor subclasses (e.g. ShardedTensor) copy themselves; correct, not reused.
        return copy.deepcopy(tensor)

    def _copy_plain(self, tensor: torch.Tensor, path: Path, visit: _Visit) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            # Only a device-to-host copy gains from page-locked memory. Leaves already on the
            # host (AdamW's step counters, unless fused or capturable) get plain buffers, as in
            # torch's own stager: a cudaHostRegister per scalar locks a page each and gains nothing.
            should_pin = self._pin_memory and tensor.is_cuda
            buffer = torch.empty_like(
                tensor,
                device="cpu",
                requires_grad=False,
                pin_memory=should_pin and not self._share_memory,
            )
            if self._share_memory:
                buffer.share_memory_()
                if should_pin:
                    self._register(buffer)
        is_cuda = tensor.is_cuda
        buffer.copy_(tensor.detach(), non_blocking=is_cuda)
        if is_cuda:
            visit.cuda_devices.add(tensor.device)
        visit.buffers[path] = buffer
        return buffer

    def _register(self, buffer: torch.Tensor) -> None:
        storage = buffer.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in self._registered:
            return
        # flags 1 (cudaHostRegisterPortable): pinned for every device's context, as torch's own
        # pinned allocator does, so states spread over several devices all copy at full speed.
        code = int(torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), 1))
        if code != 0:
            warnings.warn(
                f"cudaHostRegister of a {storage.nbytes()}-byte shared staging buffer failed "
                f"(cudaError {code}); staging into unpinned shared memory, which makes "
                "device-to-host copies slower",
                stacklevel=4,
            )
            self._pin_memory = False
            return
        self._registered[storage.data_ptr()] = storage

    def _unregister(self, ptr: int) -> None:
        self._registered.pop(ptr)
        code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if code != 0:
            warnings.warn(f"cudaHostUnregister failed (cudaError {code})", stacklevel=3)


class _Visit:
    """What one stage() collects while it walks the state dict."""

    def __init__(self) -> None:
        self.memo: dict[int, torch.Tensor] = {}
        self.buffers: dict[Path, torch.Tensor] = {}
        self.cuda_devices: set[torch.device] = set()
