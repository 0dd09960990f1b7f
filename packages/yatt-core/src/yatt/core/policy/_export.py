"""Save a policy as a Hugging Face model folder that `transformers` and vLLM load as they are.

    export_hf(policy, out_dir)                      live policy, every rank calls it
      each parameter: gather (FSDP2 DTensor -> full_tensor, one at a time; host copies of an
      offloaded policy read where they are) -> cast to dtype -> rank 0 keeps a CPU copy
      (a LoRA policy: its adapter merged in, W + scaling B A, under the base's names)
    export_lora_adapter(policy, out_dir)            a LoRA policy's adapter alone, PEFT's format
      (adapter_config.json, adapter_model.safetensors), same gathering, marker and commit
    export_hf_from_checkpoint(ckpt_dir, out_dir, model_dir=...)     one process
      read the "model" tensors of a torch.distributed.checkpoint folder (any number of writer
      ranks) -> cast to dtype
    then, on rank 0 only:
      check the names against the architecture (built on the meta device: no memory)
      out_dir.export.tmp/  <- .yatt-export.json (the marker: what was exported, when)
                           <- config.json (dtype set), model*.safetensors (+ index if sharded)
                           <- tokenizer files, generation_config.json, ... copied from model_dir
      fsync, rename to out_dir                       a crash never leaves a complete-looking folder
        out_dir exists (should_overwrite): swap the two names in one renameat2(RENAME_EXCHANGE),
        then delete the old export; where the filesystem cannot swap, move it aside first

Only a folder yatt exported (it holds the marker) or an empty one is ever replaced: out_dir is
checked before any tensor is read, so `out_dir="."`, a checkpoint folder or a model folder is
refused at once instead of deleted.

The weights are written by the architecture's own `save_pretrained`, so tied embeddings are
saved once and any renaming transformers applies on load is reverted on save. Rank 0 holds the
model once in host memory, in the exported dtype.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import inspect
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from yatt.core._version import __version__
from yatt.core.policy._checkpoint_tensors import read_model_tensors
from yatt.core.policy._lora import merge_lora_weights, peft_saved_name
from yatt.core.policy._policy import DTYPES
from yatt.core.policy._torch_policy import TorchPolicy
from yatt.core.vision._vision_forward import is_vision_language_config
from yatt.placement import offloaded_named_parameters

logger = logging.getLogger("yatt.core")

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
_TMP_SUFFIX = ".export.tmp"
# Written into every export folder; its presence is what allows should_overwrite to replace it.
EXPORT_MARKER = ".yatt-export.json"
_MARKER_FORMAT = 1
# Files of a model folder that are weights or the config: written anew, never copied.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def export_hf(
    policy: Any,
    out_dir: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    should_overwrite: bool = False,
) -> Path:
    """Write `policy`'s current weights as a Hugging Face model folder at `out_dir`.

    Collective: every rank calls it (FSDP2 gathers each parameter; TP peers gather shards);
    global rank 0 writes. A sleeping `TorchPolicy` is exported from its host copies, without
    waking it. dtype: "float32", "bfloat16", "float16" or a torch dtype; default the dtype in
    the config.json of the policy's model_dir. Config, tokenizer files and
    generation_config.json come from that model_dir. Returns `out_dir` on every rank; raises on
    every rank if rank 0 failed.
    """
    model_dir = _policy_model_dir(policy)
    target = _check_dtype(dtype, model_dir)
    out = _absolute(out_dir)
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    error = _check_out_dir(out, should_overwrite, model_dir=model_dir) if is_writer else None
    error = _agree_on_error(error)  # every rank stops before the collectives if rank 0 cannot write
    if error is not None:
        raise ValueError(error)
    is_alone = not dist.is_initialized() or dist.get_world_size() == 1
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in _full_named_weights(policy):
        # Every rank gathers (collectives), only the writer keeps a host copy. A writer that
        # fails still drains the iterator, so the other ranks' gathers complete.
        if is_writer and error is None:
            try:
                tensors[name] = _to_host(tensor, target)
            except Exception as e:  # host memory: reported to every rank below
                if is_alone:
                    raise
                error = f"export_hf to {str(out)!r} failed copying {name!r} to host: {e!r}"
                tensors.clear()
    if is_writer and error is None:
        try:
            _write_folder(
                tensors, model_dir, out, target, max_shard_bytes, should_overwrite, source="policy"
            )
        except Exception as e:  # reported to every rank below
            if is_alone:
                raise
            error = f"export_hf to {str(out)!r} failed: {e!r}"
    error = _agree_on_error(error)
    if error is not None:
        raise RuntimeError(error)
    return out


def export_lora_adapter(
    policy: Any,
    out_dir: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    should_overwrite: bool = False,
) -> Path:
    """Write a LoRA policy's adapter in PEFT's format (adapter_config.json naming the policy's
    model_dir as base_model_name_or_path, adapter_model.safetensors): what
    `peft.PeftModel.from_pretrained(base, out_dir)` and vLLM's LoRA loading read. For the
    adapter merged into a plain Hugging Face folder, call `export_hf(policy, ...)`.

    Collective like export_hf (FSDP2 gathers each adapter tensor); rank 0 writes, with the same
    atomic replacement and marker. dtype: default model_dir's. ValueError without policy.lora.
    """
    from safetensors.torch import save_file

    if not isinstance(policy, TorchPolicy) or policy.config.lora is None:
        raise ValueError(
            "export_lora_adapter: the policy has no LoRA adapter (TorchPolicyConfig.lora is "
            "None); export its weights with export_hf"
        )
    model_dir = _policy_model_dir(policy)
    target = _check_dtype(dtype, model_dir)
    out = _absolute(out_dir)
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    error = _check_out_dir(out, should_overwrite, model_dir=model_dir) if is_writer else None
    error = _agree_on_error(error)
    if error is not None:
        raise ValueError(error)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in offloaded_named_parameters(policy.module):
        # PEFT's saved names: the PeftModel's prefix, no adapter name; a module to save
        # (policy.lora.modules_to_save) is stored whole under its own name.
        key = peft_saved_name(name)
        if key is not None:
            tensor = _full_tensor(param.detach())  # every rank: FSDP2 gathers
            tensors[key] = _to_host(tensor, target)
    if is_writer:
        config = copy.copy(policy.peft_config)  # target_modules as PEFT resolved them
        config.base_model_name_or_path = str(model_dir.absolute())
        tmp = _tmp_path(out)
        try:
            if tmp.exists():
                reason = _why_not_replaceable(tmp)
                if reason is not None:
                    raise ValueError(f"{str(tmp)!r} {reason}; move it away")
                shutil.rmtree(tmp)  # an earlier export that crashed
            tmp.mkdir()
            _write_marker(tmp, source="policy adapter", model_dir=model_dir, dtype=target)
            config.save_pretrained(tmp)
            save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
            _fsync_tree(tmp)
            _commit(tmp, out, should_overwrite)
        except Exception as e:
            error = f"export_lora_adapter to {str(out)!r} failed: {e!r}"
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    error = _agree_on_error(error)
    if error is not None:
        raise RuntimeError(error)
    return out


def export_hf_from_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    model_dir: str | os.PathLike[str],
    dtype: str | torch.dtype | None = None,
    state_key: str = "model",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    should_overwrite: bool = False,
) -> Path:
    """Write the model saved in a torch.distributed.checkpoint folder as a Hugging Face folder.

    checkpoint_dir: one checkpoint (the folder holding `.metadata`), e.g. a yatt-ckpt step
    folder `checkpoints/step-00000100` (`Checkpointer.verify(step).path`), written by any
    number of ranks under DDP, FSDP2 or one process. state_key: the key the policy's module had
    in the saved state (`policy.state()` uses "model"). model_dir: the folder the policy was
    built from (config, tokenizer, generation config). Runs in one process, no collectives.
    Raises ValueError for a missing, unfinished or damaged checkpoint.
    """
    model_dir = _check_model_dir(Path(model_dir).expanduser())
    target = _check_dtype(dtype, model_dir)
    out = _absolute(out_dir)
    checkpoint = Path(checkpoint_dir).expanduser()
    error = _check_out_dir(out, should_overwrite, model_dir=model_dir, checkpoint_dir=checkpoint)
    if error is not None:
        raise ValueError(error)
    tensors = read_model_tensors(checkpoint, state_key, dtype=target)
    adapter = next((n for n in tensors if ".lora_A." in n or ".lora_B." in n), None)
    if adapter is not None:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} holds a LoRA adapter ({adapter!r}), not a model: "
            "build the policy with its policy.lora, load the checkpoint into it "
            "(ckpt.load(policy.state())), then export_hf(policy, ...) for the merged model or "
            "export_lora_adapter(policy, ...) for the adapter"
        )
    source = f"checkpoint {checkpoint.absolute()}"
    _write_folder(tensors, model_dir, out, target, max_shard_bytes, should_overwrite, source=source)
    return out


def check_export_dir(
    out_dir: str | os.PathLike[str],
    *,
    should_overwrite: bool = False,
    model_dir: str | os.PathLike[str] | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Raise ValueError if an export to `out_dir` would be refused; returns it as an absolute path.

    The checks export_hf and export_hf_from_checkpoint run first, for a trainer to run when it
    starts rather than when it exports: out_dir must not be (or hold) `model_dir` or
    `checkpoint_dir` (pass the checkpoint root: it need not exist yet), must not be a file, and
    may exist only with should_overwrite=True and only as an empty folder or an earlier yatt
    export (a folder holding .yatt-export.json).
    """
    out = _absolute(out_dir)
    error = _check_out_dir(
        out,
        should_overwrite,
        model_dir=None if model_dir is None else Path(model_dir).expanduser(),
        checkpoint_dir=None if checkpoint_dir is None else Path(checkpoint_dir).expanduser(),
    )
    if error is not None:
        raise ValueError(error)
    return out


# -- inputs ------------------------------------------------------------------------------------


def _policy_model_dir(policy: Any) -> Path:
    model_dir = getattr(getattr(policy, "config", None), "model_dir", None)
    if model_dir is None:
        raise TypeError(
            f"export_hf takes a policy whose .config.model_dir names the folder it was built "
            f"from (TorchPolicy, MegatronPolicy); got {type(policy).__name__}"
        )
    return _check_model_dir(Path(model_dir).expanduser())


def _check_model_dir(model_dir: Path) -> Path:
    if not (model_dir / "config.json").is_file():
        raise ValueError(
            f"model_dir={str(model_dir)!r} has no config.json; pass the local folder the policy "
            "was built from (a Hub id resolves to one with yatt.core.resolve_model_dir)"
        )
    return model_dir


def _check_dtype(dtype: str | torch.dtype | None, model_dir: Path) -> torch.dtype:
    if dtype is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved, str):
            saved = DTYPES.get(saved)
        return saved if saved in DTYPES.values() else torch.float32
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype={dtype!r}: use one of {sorted(DTYPES)} (or None: model_dir's dtype)")


def _absolute(path: str | os.PathLike[str]) -> Path:
    # abspath, not Path.absolute(): "out/.." must name the folder it means (with_name on a
    # path ending in ".." would not), and symlinks stay as they are (rename acts on the link).
    return Path(os.path.abspath(os.path.expanduser(path)))


def _check_out_dir(
    out: Path,
    should_overwrite: bool,
    *,
    model_dir: Path | None,
    checkpoint_dir: Path | None = None,
) -> str | None:
    """Why `out` cannot receive an export (None: it can); nothing is changed but its parent
    created."""
    where = f"out_dir={str(out)!r}"
    real = out.resolve()
    for what, source in (("model_dir", model_dir), ("checkpoint", checkpoint_dir)):
        if source is None:
            continue
        source_real = source.resolve()
        if source_real == real:
            return f"{where} is the {what} it reads from; pass another folder"
        if source_real.is_relative_to(real):
            return (
                f"{where} holds the {what} {str(source_real)!r} it reads from; replacing it "
                "would delete that: pass a folder of its own (e.g. out_dir/export)"
            )
    if out.is_symlink():
        return f"{where} is a symbolic link; pass the folder itself"
    if out.exists() and not out.is_dir():
        return f"{where} is a file; pass a folder path"
    if out.exists():
        if not should_overwrite:
            return f"{where} exists; pass should_overwrite=True to replace it, or a new path"
        reason = _why_not_replaceable(out)
        if reason is not None:
            return (
                f"{where} exists and {reason}; an export replaces only a folder that yatt "
                f"exported (one holding {EXPORT_MARKER}) or an empty one: pass a new path, or "
                "move that folder away yourself"
            )
    tmp = _tmp_path(out)
    if tmp.exists() and _why_not_replaceable(tmp) is not None:
        return f"{where}: {str(tmp)!r} exists and is not an unfinished yatt export; move it away"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{where}: cannot create its parent folder ({e.strerror or e})"
    return None


def _why_not_replaceable(folder: Path) -> str | None:
    """None for an empty folder or a yatt export (marked); else why it must not be deleted."""
    if folder.is_symlink() or not folder.is_dir():
        return "is not a folder"
    if not any(folder.iterdir()):
        return None
    try:
        marker = json.loads((folder / EXPORT_MARKER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"is not a yatt export (it has no {EXPORT_MARKER})"
    except (OSError, ValueError) as e:
        return f"has an unreadable {EXPORT_MARKER} ({e})"
    if not isinstance(marker, dict) or "format" not in marker:
        return f"has a {EXPORT_MARKER} that yatt did not write"
    return None


def _tmp_path(out: Path) -> Path:
    return out.with_name(out.name + _TMP_SUFFIX)


def _agree_on_error(error: str | None) -> str | None:
    """Rank 0's error (or None), on every rank; a no-op in a single process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# -- gathering ---------------------------------------------------------------------------------


def _full_named_weights(policy: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if not isinstance(policy, TorchPolicy):
        yield from policy.named_weights()  # MegatronPolicy: TP shards gathered, HF names
        return
    # The module's own names are Hugging Face names (DDP wraps it, FSDP2 shards it in place).
    # While the policy sleeps, its values wait in host copies: read them there, no wake_up.
    pairs = (
        (name, _full_tensor(param.detach()))
        for name, param in offloaded_named_parameters(policy.module)
    )
    if policy.config.lora is None:
        yield from pairs
    else:  # PEFT's names ("<m>.base_layer.weight", "<m>.lora_A...") -> the merged HF weights
        yield from merge_lora_weights(pairs, policy.lora_scalings)


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if not hasattr(tensor, "full_tensor"):
        return tensor
    # An offloaded FSDP2 shard sits on the host while NCCL gathers device memory only.
    mesh_device = tensor.device_mesh.device_type
    if tensor.device.type != mesh_device:
        tensor = tensor.to(mesh_device)
    return tensor.full_tensor()


def _to_host(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.is_floating_point():
        tensor = tensor.to(dtype)  # on the device first: less to copy
    # A copy even on the host: the live parameters keep training, the export must not follow.
    return tensor.to("cpu", copy=True).contiguous()


# -- writing -----------------------------------------------------------------------------------


def _write_folder(
    tensors: dict[str, torch.Tensor],
    model_dir: Path,
    out: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
    should_overwrite: bool,
    *,
    source: str,
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    # The class TorchPolicy loads (_load_model): a VLM's names include its vision tower.
    auto = (
        AutoModelForImageTextToText if is_vision_language_config(config) else AutoModelForCausalLM
    )
    config.dtype = dtype
    if not isinstance(inspect.getattr_static(type(config), "torch_dtype", None), property):
        config.torch_dtype = dtype  # transformers < 4.56 reads and writes only this name
    with torch.device("meta"):
        # The architecture without memory: its names, tied weights and save logic.
        skeleton = auto.from_config(config)
    _check_names(tensors, skeleton, model_dir)
    # Counted now: save_pretrained may consume the state dict it is given (transformers 5).
    num_tensors, num_bytes = len(tensors), sum(t.nbytes for t in tensors.values())
    tmp = _tmp_path(out)
    if tmp.exists():
        reason = _why_not_replaceable(tmp)
        if reason is not None:  # checked before the tensors were read; changed since
            raise ValueError(f"{str(tmp)!r} {reason}; move it away")
        shutil.rmtree(tmp)  # an earlier export that crashed
    try:
        tmp.mkdir()
        # First, so a leftover of a crash is recognisably ours.
        _write_marker(tmp, source=source, model_dir=model_dir, dtype=dtype)
        skeleton.save_pretrained(tmp, state_dict=tensors, max_shard_size=max_shard_bytes)
        copied = _copy_side_files(model_dir, tmp)
        _fsync_tree(tmp)
        _commit(tmp, out, should_overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not any(name in copied for name in _TOKENIZER_FILES):
        logger.warning(
            "export: %s has no tokenizer files to copy; vLLM needs one in %s: save it there "
            "with tokenizer.save_pretrained",
            model_dir,
            out,
        )
    logger.info("exported %d tensors (%.2f GB, %s) to %s", num_tensors, num_bytes / 1e9, dtype, out)


def _check_names(tensors: dict[str, torch.Tensor], skeleton: Any, model_dir: Path) -> None:
    """Every tensor is one the architecture has, and every weight is there (tied ones once)."""
    expected = skeleton.state_dict(keep_vars=True)  # tied names share one Parameter object
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ValueError(
            f"{len(unknown)} weight names are not names of the {type(skeleton).__name__} of "
            f"{str(model_dir)!r}, e.g. {unknown[:3]}; was the checkpoint saved from another "
            "model (or a MegatronPolicy, whose checkpoints hold TP shards: export it live)?"
        )
    aliases: dict[int, list[str]] = {}
    for name, value in expected.items():
        aliases.setdefault(id(value), []).append(name)
    missing = [names[0] for names in aliases.values() if not any(n in tensors for n in names)]
    if missing:
        raise ValueError(
            f"{len(missing)} weights of the {type(skeleton).__name__} of {str(model_dir)!r} "
            f"are missing, e.g. {missing[:3]}; the weights come from another model"
        )
    for name, tensor in tensors.items():
        shape = tuple(expected[name].shape)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the config of "
                f"{str(model_dir)!r} gives {shape}; the weights come from another model"
            )


def _copy_side_files(model_dir: Path, tmp: Path) -> list[str]:
    """Copy model_dir's top-level files other than weights and config (tokenizer files,
    generation_config.json, chat template, custom code); returns their names."""
    copied = []
    for entry in sorted(model_dir.iterdir()):
        name = entry.name
        is_weights = name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")
        if not entry.is_file() or name.startswith(".") or name == "config.json" or is_weights:
            continue
        shutil.copyfile(entry, tmp / name)  # follows symlinks (a Hugging Face cache snapshot)
        copied.append(name)
    return copied


def _fsync_tree(folder: Path) -> None:
    for entry in folder.iterdir():
        with open(entry, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(folder: Path, *, source: str, model_dir: Path, dtype: torch.dtype) -> None:
    marker = {
        "format": _MARKER_FORMAT,
        "written_by": f"yatt-core {__version__}",
        "time_unix": time.time(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source,
        "model_dir": str(model_dir.absolute()),
        "dtype": str(dtype).removeprefix("torch."),
    }
    (folder / EXPORT_MARKER).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")


def _commit(tmp: Path, out: Path, should_overwrite: bool) -> None:
    """Put the finished folder at `out`; an existing export there is replaced so that at every
    moment one of the two is at `out` (or, where the filesystem cannot swap, beside it)."""
    if not (out.exists() or out.is_symlink()):
        tmp.rename(out)
        _fsync_dir(out.parent)
        return
    assert should_overwrite
    reason = _why_not_replaceable(out)
    if reason is not None:  # checked before the tensors were read; changed since
        raise ValueError(f"out_dir={str(out)!r} {reason}; it is not replaced")
    if _exchange(tmp, out):
        _fsync_dir(out.parent)
        shutil.rmtree(tmp)  # now the old export
        return
    old = out.with_name(out.name + ".old" + _TMP_SUFFIX)
    if old.exists():
        if _why_not_replaceable(old) is not None:
            raise ValueError(f"{str(old)!r} is in the way and is not a yatt export; move it away")
        shutil.rmtree(old)
    # A crash between these renames leaves the old export at `old`, beside out_dir.
    out.rename(old)
    tmp.rename(out)
    _fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the
    kernel, libc or filesystem cannot (the caller falls back to two renames)."""
    if sys.platform != "linux":
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    renameat2.restype = ctypes.c_int
    code = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if code == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))
