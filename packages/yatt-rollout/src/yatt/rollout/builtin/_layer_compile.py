"""EngineConfig.compile_scope="layers": each decoder layer compiled once, reused by every layer.

The engine's default compiles its decode step and its prefill each as one graph over the whole
model, so the first call's compile grows with depth (bench/results/compile_time_cpu.md). Here
each decoder layer is compiled on its own (dynamic in every size); every layer then replays the
first layer's graph, provided nothing in the traced layer differs between layers. The KV
attention (_static_kv.py) would pick its cache by module.layer_idx, an int dynamo guards on
(one graph per layer again), so each attention module gets its own layer's buffers bound as
plain attributes, which dynamo reads as graph inputs.
"""

from __future__ import annotations

from typing import Any

import torch

# The attribute names of an attention module's bound buffers (layer_caches reads them).
BOUND_KEYS, BOUND_VALUES = "yatt_key_cache", "yatt_value_cache"


def bind_layer_caches(model: torch.nn.Module, cache: Any) -> None:
    """Give every attention module of `model` (a module with an int `layer_idx` in range) its
    layer's key and value buffers (of `cache`, a _static_kv.StaticKVCache) as plain
    attributes, or remove them (cache None)."""
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or isinstance(layer, bool):
            continue
        if cache is None:
            module.__dict__.pop(BOUND_KEYS, None)
            module.__dict__.pop(BOUND_VALUES, None)
        elif 0 <= layer < len(cache.keys):
            # Plain attributes (not buffers): no state dict, no weight sync, no .to() sees them.
            module.__dict__[BOUND_KEYS] = cache.keys[layer]
            module.__dict__[BOUND_VALUES] = cache.values[layer]


def compile_decoder_layers(model: torch.nn.Module) -> None:
    """Compile each decoder layer of `model` (the children of a ModuleList of modules with a
    `self_attn`), dynamic in every size: dynamo traces one layer and the others reuse its
    graph (with the caches bound by bind_layer_caches). Once per model."""
    if getattr(model, "_yatt_layers_compiled", False):
        return
    layers = [
        layer
        for module in model.modules()
        if isinstance(module, torch.nn.ModuleList)
        for layer in module
        if hasattr(layer, "self_attn")
    ]
    if not layers:
        raise ValueError(
            f"EngineConfig.compile_scope='layers': {type(model).__name__} has no decoder layers "
            "(a ModuleList of modules with a self_attn); use compile_scope='step'"
        )
    for layer in layers:
        layer.compile(dynamic=True)
    model._yatt_layers_compiled = True


def layer_caches(module: torch.nn.Module, cache: Any) -> tuple[torch.Tensor, ...]:
    """The attention module's layer's (keys, values) buffers: bound to it (compile_scope
    "layers"), else the cache's at its layer_idx."""
    keys = getattr(module, BOUND_KEYS, None)
    if keys is not None:
        return keys, getattr(module, BOUND_VALUES)
    return cache.keys[module.layer_idx], cache.values[module.layer_idx]
