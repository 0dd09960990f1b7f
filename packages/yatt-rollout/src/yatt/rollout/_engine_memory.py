"""What a vLLM or SGLang engine holds on its GPU, from its config, for a placement plan.

    engine_memory_need(weight_bytes=..., pool_fraction=0.5, device_total_bytes=80 << 30,
                       graph_bytes=..., settings=...) -> yatt.placement.MemoryNeed

Both engines size one static pool as a fraction of the GPU's TOTAL memory (vLLM's
gpu_memory_utilization, SGLang's mem_fraction_static): the weights and the KV cache live in it,
the KV cache taking what the weights leave. So awake an engine holds about
fraction x total: "weights" (the checkpoint's parameters in the served dtype, over the TP
ranks) and "kv_cache" (the rest of the pool). CUDA graphs come on top ("cuda_graph", an
estimate: their size is only known once captured; 0 when the engine runs eagerly). Generation
works inside that memory: the reported peak is empty.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

from yatt.placement import MemoryNeed

# Bytes of one element per safetensors dtype code and per `dtype` setting.
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
# CUDA graphs of a small batch ladder (vLLM and SGLang capture a few dozen sizes): about this
# much per engine and GPU on the models yatt runs (an estimate; the engines log the real size).
CUDA_GRAPH_BYTES_ESTIMATE = 1 << 30


def checkpoint_parameters(model_dir: str | Path) -> tuple[int, int] | None:
    """(number of parameters, bytes of one element as stored) from a local folder's safetensors
    headers (no tensor is read); None when the folder is not local or holds no safetensors."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    num_params, element_bytes = 0, 0
    for path in files:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            num_params += count
            element_bytes = max(element_bytes, _SAFETENSORS_BYTES.get(entry["dtype"], 0))
    return num_params, element_bytes


def served_weight_bytes(model_dir: str | Path, dtype: str, *, tp_size: int) -> int | None:
    """Bytes of the weights one rank of a `tp_size` engine serves (the parameters split evenly
    over the ranks; norms and biases, a rounding error at any size, are counted split too)."""
    found = checkpoint_parameters(model_dir)
    if found is None:
        return None
    num_params, stored_bytes = found
    element_bytes = _DTYPE_BYTES.get(dtype, 0)
    if not element_bytes:  # "auto": the checkpoint's own (config.json's dtype when present)
        config = Path(model_dir) / "config.json"
        declared = json.loads(config.read_text()).get("torch_dtype") if config.is_file() else None
        element_bytes = _DTYPE_BYTES.get(str(declared), stored_bytes) or 2
    return num_params * element_bytes // tp_size


def engine_memory_need(
    *,
    weight_bytes: int,
    pool_fraction: float,
    device_total_bytes: int,
    graph_bytes: int,
    settings: Mapping[str, str],
) -> MemoryNeed:
    """An engine's MemoryNeed: its pool split into weights and KV cache, and its graphs."""
    pool_bytes = int(pool_fraction * device_total_bytes)
    return MemoryNeed(
        resident={
            "weights": weight_bytes,
            "kv_cache": max(pool_bytes - weight_bytes, 0),
            "cuda_graph": graph_bytes,
        },
        settings=dict(settings),
    )
