"""Read a model's full tensors out of a torch.distributed.checkpoint (DCP) folder, in one process.

    ckpt/.metadata        key -> global shape, dtype, and where each shard's bytes are
    ckpt/__0_0.distcp ... the shards' bytes, one file per writer rank

Keys are "<state_key>.<parameter name>" (`get_model_state_dict` names: the same under DDP,
FSDP2 or one process). DCP assembles each full tensor from however many ranks wrote it, so a
checkpoint of N ranks reads in one. yatt-ckpt's own layout (step folders, `latest`) is its
business: the caller passes one checkpoint folder (`Checkpointer.verify(step).path`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

_METADATA = ".metadata"
_CHUNK_BYTES = 1 << 30  # tensors read per dcp.load call: bounds the transient float32 copies


def read_model_tensors(
    checkpoint_dir: Path, state_key: str, *, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """{parameter name: full CPU tensor} under `state_key`, floating ones cast to `dtype`.

    ValueError naming the folder and the problem if it is missing, unfinished or damaged.
    """
    metadata = _read_metadata(checkpoint_dir)
    _check_data_files(checkpoint_dir, metadata)
    prefix = state_key + "."
    stored = {
        key[len(prefix) :]: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not stored:
        roots = sorted({key.split(".", 1)[0] for key in metadata.state_dict_metadata})
        raise ValueError(
            f"checkpoint {str(checkpoint_dir)!r} holds no tensors under state_key={state_key!r}; "
            f"its top-level keys are {roots}"
        )
    out: dict[str, torch.Tensor] = {}
    chunk: dict[str, torch.Tensor] = {}
    chunk_bytes = 0
    for name, meta in stored.items():
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        chunk[name] = tensor
        chunk_bytes += tensor.nbytes
        if chunk_bytes >= _CHUNK_BYTES:
            out.update(_load_chunk(checkpoint_dir, state_key, chunk, dtype))
            chunk, chunk_bytes = {}, 0
    if chunk:
        out.update(_load_chunk(checkpoint_dir, state_key, chunk, dtype))
    return out


def _read_metadata(checkpoint_dir: Path) -> Metadata:
    where = str(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise ValueError(f"checkpoint {where!r} does not exist; pass a checkpoint folder")
    if checkpoint_dir.name.endswith(".tmp"):
        raise ValueError(
            f"checkpoint {where!r} is an unfinished save (a .tmp folder); pass a committed one"
        )
    if not (checkpoint_dir / _METADATA).is_file():
        inner = sorted(p.name for p in checkpoint_dir.iterdir() if (p / _METADATA).is_file())
        hint = (
            f"it holds checkpoints {inner}: pass one of them, e.g. {str(checkpoint_dir / inner[-1])!r}"
            if inner
            else "a torch.distributed.checkpoint folder holds one (an interrupted save does not)"
        )
        raise ValueError(f"checkpoint {where!r} has no {_METADATA} file; {hint}")
    try:
        return dcp.FileSystemReader(checkpoint_dir).read_metadata()
    except Exception as e:
        raise ValueError(f"checkpoint {where!r}: {_METADATA} is unreadable ({e!r})") from e


def _check_data_files(checkpoint_dir: Path, metadata: Metadata) -> None:
    """Every byte range the index points at exists on disk (a truncated copy fails here)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        path = checkpoint_dir / name
        if not path.is_file():
            raise ValueError(f"checkpoint {str(checkpoint_dir)!r} is incomplete: {name} is missing")
        size = path.stat().st_size
        if size < end:
            raise ValueError(
                f"checkpoint {str(checkpoint_dir)!r} is incomplete: {name} has {size} bytes, "
                f"its index needs {end}"
            )


def _load_chunk(
    checkpoint_dir: Path, state_key: str, chunk: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    state = {state_key: chunk}
    try:
        with warnings.catch_warnings():
            # no_dist=True is what we ask for; DCP warns about it anyway.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoint_dir), no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        raise ValueError(
            f"checkpoint {str(checkpoint_dir)!r}: reading tensors failed: {e!r}"
        ) from e
    loaded = state[state_key]
    return {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in loaded.items()
    }
