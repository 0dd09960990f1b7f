"""Weight sync: stream (name, tensor) pairs into an engine bucket by bucket.

The source is any iterable (a trainer's `named_parameters()`, a generator that gathers shards
one at a time, an offloaded trainer's host copies from
`yatt.placement.offloaded_named_parameters`). It is consumed lazily and at most one bucket of
references is held at once, so the sender never needs a second full copy of the model.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

import torch

from yatt.placement import is_offload_placeholder

NamedTensors = Iterable[tuple[str, torch.Tensor]]
# A LoRA adapter synced alone (yatt.core's TorchPolicy.named_adapter_weights()): per target
# module "<m>" + each suffix. The built-in engine merges it (builtin/_lora.py).
LORA_SUFFIXES = (".lora_A", ".lora_B", ".lora_scaling")
# A module trained whole beside the adapter (LoraConfig.modules_to_save) travels as
# "<p>.lora_saved": only an engine that applies adapters knows to serve it as <p>.
_ADAPTER_ONLY_SUFFIXES = (*LORA_SUFFIXES, ".lora_saved")
# Maps one trainer tensor to zero or more Hugging Face (name, tensor) pairs, e.g. a Megatron
# fused QKV weight to q_proj/k_proj/v_proj. Returning nothing skips the tensor.
NameMapper = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def map_names(
    named_tensors: NamedTensors, mapper: NameMapper
) -> Iterator[tuple[str, torch.Tensor]]:
    """Apply `mapper` to each pair lazily; pass the result to any engine's `update_weights`.

    engine.update_weights(map_names(megatron_model.named_parameters(), to_hf_names))
    """
    for name, tensor in named_tensors:
        yield from mapper(name, tensor)


def is_adapter_tensor(pair: object) -> bool:
    """Whether a synced (name, tensor) pair belongs to a LoRA adapter (by its name's suffix)."""
    return (
        isinstance(pair, tuple)
        and len(pair) == 2
        and isinstance(pair[0], str)
        and pair[0].endswith(_ADAPTER_ONLY_SUFFIXES)
    )


def peek_adapter_sync(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> tuple[bool, Iterator[tuple[str, torch.Tensor]]]:
    """Whether a sync is a LoRA adapter's (its first pair names one: "<m>.lora_A" ...), and
    every pair, the first one included (the sync is read once)."""
    pairs = iter(named_tensors)
    first = next(pairs, None)
    if first is None:
        return False, pairs
    return is_adapter_tensor(first), itertools.chain([first], pairs)


def refuse_adapter_tensors(bucket: list[tuple[str, torch.Tensor]], engine: str) -> None:
    """ValueError when a full-weight bucket holds a LoRA adapter's tensor: `engine` takes an
    adapter only as a sync of its own (the adapter's tensors alone), when built to serve LoRA."""
    name = next((n for n, _ in bucket if n.endswith(_ADAPTER_ONLY_SUFFIXES)), None)
    if name is not None:
        raise ValueError(
            f"update_weights: {name!r} is a LoRA adapter tensor; the {engine} engine takes "
            "one only in an adapter sync (the adapter's tensors alone, "
            "policy.named_adapter_weights()) with enable_lora=True in its config (the trainer "
            "sets it when policy.lora is set); else sync the merged weights, "
            "policy.named_weights()"
        )


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named_tensors: NamedTensors, *, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group pairs into lists of at most `bucket_bytes` (a larger tensor gets a bucket alone)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: must be a positive int (e.g. 512 << 20)")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for pair in named_tensors:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], torch.Tensor)):
            raise ValueError(
                f"update_weights got {type(pair).__name__} {pair!r:.80}; pass an iterable of "
                "(name, tensor) pairs such as model.named_parameters()"
            )
        if is_offload_placeholder(pair[1]):
            # Syncing the placeholder would load nothing, or fail inside the engine with a
            # shape error that does not say why. A tensor that is empty for real passes.
            raise ValueError(
                f"update_weights got {pair[0]!r} with shape {tuple(pair[1].shape)}: an empty "
                "placeholder that yatt.placement.offload left on the device (the values are in "
                "host memory). Onload the module first (onload(model), or sync inside a plan "
                "phase that wakes the trainer's weights), or stream the host copies with "
                "yatt.placement.offloaded_named_parameters(model)"
            )
        nbytes = tensor_bytes(pair[1])
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(pair)
        size += nbytes
    if bucket:
        yield bucket


def named_targets(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by its state-dict name, tied names included."""
    targets: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    state_names = set(module.state_dict(keep_vars=True))
    for name, buffer in module.named_buffers(remove_duplicate=False):
        if name in state_names:
            targets[name] = buffer
    return targets


def copy_bucket(targets: dict[str, torch.Tensor], bucket: list[tuple[str, torch.Tensor]]) -> int:
    """Copy one bucket in place (addresses kept: CUDA graphs and regions stay valid); bytes copied."""
    copied = 0
    for name, source in bucket:
        target = targets.get(name)
        if target is None:
            close = [n for n in targets if n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
            raise ValueError(
                f"update_weights: {name!r} is not a parameter of the served model (similar: "
                f"{close}); give Hugging Face names, or translate with map_names(...)"
            )
        if target.shape != source.shape:
            raise ValueError(
                f"update_weights: {name!r} has shape {tuple(source.shape)}, the served model "
                f"expects {tuple(target.shape)}; a tensor-parallel shard must be gathered first"
            )
        with torch.no_grad():
            target.copy_(source, non_blocking=True)
        copied += tensor_bytes(source)
    return copied


def move_into_current_region(model: torch.nn.Module, device: torch.device) -> int:
    """Give every parameter and buffer fresh storage, allocated in the open region; their bytes.

    Copying (rather than loading straight into the region) keeps loader threads and memory maps
    out of it, so the region holds exactly the model's tensors.
    """
    seen: set[int] = set()
    num_bytes = 0
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            fresh = torch.empty_like(tensor, device=device)
            fresh.copy_(tensor)
            tensor.data = fresh
            num_bytes += fresh.numel() * fresh.element_size()
    return num_bytes
