"""Turn the caller's `state` (modules, optimizers, tensors, stateful objects) into one DCP state
dict and back.

Modules and optimizers go through `torch.distributed.checkpoint.state_dict`, so plain, DDP and
FSDP2 models produce the same keys ("model.layer.weight", "optim.state.layer.weight.exp_avg") with
DTensor shards where FSDP2 shards: a checkpoint written by N ranks then loads on M ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


def validate_state(state: Mapping[str, Any]) -> dict[str, nn.Module]:
    """Check `state`'s values; return, per optimizer key, the module that owns its parameters."""
    if not isinstance(state, Mapping) or not state:
        raise ValueError(
            f"state={type(state).__name__} must be a non-empty dict of modules, optimizers, "
            "tensors or objects with state_dict()/load_state_dict()"
        )
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    owners: dict[str, nn.Module] = {}
    for key, value in state.items():
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(f"state key {key!r} must be a non-empty str without '.'")
        if isinstance(value, torch.optim.Optimizer):
            owners[key] = _find_owner(key, value, modules)
        elif not isinstance(value, nn.Module | torch.Tensor | Stateful):
            raise ValueError(
                f"state[{key!r}] is a {type(value).__name__}; state holds modules, optimizers, "
                "tensors or objects with state_dict()/load_state_dict(): pass JSON-able values "
                "in `extra` instead"
            )
    return owners


def _find_owner(key: str, optim: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> nn.Module:
    param_ids = {id(p) for group in optim.param_groups for p in group["params"]}
    for module in modules.values():
        if param_ids <= {id(p) for p in module.parameters()}:
            return module
    raise ValueError(
        f"state[{key!r}] is an optimizer whose parameters do not all belong to one module in "
        f"state (modules: {sorted(modules)}); add the module it optimizes to state"
    )


def collect_state_dict(state: Mapping[str, Any], owners: dict[str, nn.Module]) -> dict[str, Any]:
    """The live state as one nested dict of tensors (sharing storage with the live objects)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            out[key] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            # DCP initialises an optimizer that has not stepped yet with a zero-lr step, so the
            # saved and the loading side agree on which state tensors exist.
            out[key] = get_optimizer_state_dict(owners[key], value)
        elif isinstance(value, torch.Tensor):
            out[key] = value
        else:
            out[key] = value.state_dict()
    return out


def apply_state_dict(
    state: Mapping[str, Any], owners: dict[str, nn.Module], loaded: dict[str, Any]
) -> None:
    """Push a loaded state dict into the live objects (tensors were filled in place by DCP)."""
    for key, value in state.items():
        if isinstance(value, nn.Module):
            set_model_state_dict(value, loaded[key])
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(owners[key], value, loaded[key])
        elif isinstance(value, torch.Tensor):
            if loaded[key] is not value:  # DCP may replace rather than fill; keep the caller's
                with torch.no_grad():
                    value.copy_(loaded[key])
        else:
            value.load_state_dict(loaded[key])


def flatten_tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensor leaves by DCP's flattened key (dict keys and list indices joined by '.')."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            out.update(flatten_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            out.update(flatten_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def check_shapes(
    live: dict[str, Any],
    metadata: Metadata,
    *,
    name: str,
    all_live_keys: set[str] | None = None,
) -> None:
    """Raise ValueError naming the first key whose stored shape differs from the live one.

    all_live_keys: the tensor keys every rank loads (their union). States keyed per rank (a
    tensor-parallel shard under "model.tp{r}...") hold on each rank only that rank's keys; a
    stored key counts as extra only if no rank asks for it.
    """
    stored = {
        k: tuple(m.size)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    live_tensors = flatten_tensors(live)
    for key, tensor in live_tensors.items():
        if key not in stored:
            raise ValueError(
                f"checkpoint {name!r} does not match the live state: it has no tensor {key!r} "
                f"(live shape {tuple(tensor.shape)}); it was saved from a different model"
            )
        if stored[key] != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint {name!r} does not match the live state: {key!r} has shape "
                f"{stored[key]} in the checkpoint and {tuple(tensor.shape)} in the live state"
            )
    roots = {k.split(".", 1)[0] for k in live}
    for key, shape in stored.items():
        known = live_tensors.keys() if all_live_keys is None else all_live_keys
        if key.split(".", 1)[0] in roots and key not in known:
            raise ValueError(
                f"checkpoint {name!r} does not match the live state: it has tensor {key!r} "
                f"(shape {shape}) that the live state lacks; it was saved from a different model"
            )
