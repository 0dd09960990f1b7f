"""Offload for FSDP2 modules and for optimizers whose state is sharded (DTensor).

The `.data` swap that `_offload` uses does not work here. FSDP2 keeps each parameter's shard in
padded storage of its own (`FSDPParam._sharded_param_data`) behind the DTensor parameter:
swapping the parameter's data leaves that storage on the GPU, and DTensor's device checks reject
an empty placeholder. `module.to(device)` is FSDP2's own way to move a sharded module: its
`_apply` re-points the padded storage at the moved shard (`reset_sharded_param`), and the swap
it does for tensor subclasses keeps every Parameter object, so optimizer keys and the user's
references stay valid. An optimizer's state tensors belong to it alone, so they are replaced by
moved copies (scalar `step` counters, which AdamW keeps on the host, are left alone).
"""

from __future__ import annotations

import torch


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_fsdp2_module(obj: object) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(obj, FSDPModule)


def _sharded_state(optimizer: torch.optim.Optimizer) -> list[tuple[dict, str]]:
    dtensor = _dtensor_type()
    if dtensor is None:
        return []
    return [
        (state, key)
        for state in optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, dtensor)
    ]


def moves_by_to(obj: object) -> bool:
    """Whether `obj` must be moved with `.to()` (FSDP2 module, or optimizer over DTensors)."""
    if isinstance(obj, torch.nn.Module):
        return is_fsdp2_module(obj)
    return isinstance(obj, torch.optim.Optimizer) and bool(_sharded_state(obj))


def device_of(obj: torch.nn.Module | torch.optim.Optimizer) -> torch.device:
    """The device `obj`'s (sharded) tensors live on (the first one's)."""
    if isinstance(obj, torch.nn.Module):
        tensor = next(obj.parameters(), None)
    else:
        tensor = next((state[key] for state, key in _sharded_state(obj)), None)
    if tensor is None:
        return torch.device("cpu")
    return local_tensor(tensor).device


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def move(obj: torch.nn.Module | torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move `obj`'s (local shards of) tensors to `device`."""
    if isinstance(obj, torch.nn.Module):
        obj.to(device)
        return
    for state, key in _sharded_state(obj):
        state[key] = state[key].to(device)
