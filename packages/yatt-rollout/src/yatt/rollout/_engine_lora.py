"""A LoRA adapter synced to vLLM or SGLang: the wire format as PEFT's, and what each engine takes.

    wire (yatt.core TorchPolicy.named_adapter_weights())   PEFT (what save_pretrained writes)
    "<m>.lora_A"       [r, in]                              "base_model.model.<m>.lora_A.weight"
    "<m>.lora_B"       [out, r]                             "base_model.model.<m>.lora_B.weight"
    "<m>.lora_scaling" 0-d, alpha / r                       adapter_config.json: r, lora_alpha =
                                                            scaling x r, target_modules (leaf names)
    "<p>.lora_saved"   a module trained whole               refused: neither engine serves one

    peft_adapter(pairs)            -> PeftAdapter(tensors, config)    checked: one rank, one scale
    AdapterFolders.write(adapter)  -> a folder on tmpfs (/dev/shm), renamed into place whole
    lora_engine_options(...)       -> backend_options that serve policy.lora (checked first)

How each engine loads it (read in their sources at the pinned versions):
- vLLM 0.26.0 loads an adapter from a folder only: LoRARequest(lora_name, lora_int_id,
  lora_path) (vllm/lora/request.py has no tensors field; verl and SkyRL patch
  WorkerLoRAManager._load_adapter to serve tensors, which yatt does not). The adapter is
  written to tmpfs (no disk) and registered with LLMEngine.add_lora: safetensors to host
  memory, then vLLM reads it back to the GPU. The folder must live while the adapter does
  (vLLM reloads it from the path when its LRU cache evicts it).
- SGLang 0.5.17 loads one from memory: Engine.load_lora_adapter_from_tensors(lora_name,
  tensors, config_dict) serializes the tensors (CUDA IPC handles for GPU tensors) and every TP
  worker copies them (LoRAAdapter.initialize_weights_from_tensors). An engine without that
  method falls back to the folder and load_lora_adapter(lora_name, lora_path).
modules_to_save: vLLM's loader takes LoRA A/B of its supported modules only, and SGLang's
takes per-layer LoRA weights and LoRA on embeddings, neither a module's full trained weight: a
LoRA with modules_to_save is refused for both, before any model loads.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from yatt.rollout._weights import LORA_SUFFIXES

_A, _B, _SCALING = LORA_SUFFIXES
SAVED_SUFFIX = ".lora_saved"
PEFT_PREFIX = "base_model.model."  # PEFT's saved names: the PeftModel's own prefix
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
# The linear layers each engine's LoRA wraps in the model families yatt serves (Llama,
# Qwen2/3 and their VL language models): vLLM's packed qkv_proj / gate_up_proj take the HF
# names; SGLang's lora_target_modules names the same. Others (a vision tower's qkv, fc1) are not.
ENGINE_LORA_MODULES = {
    "vllm": frozenset(
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    ),
    "sglang": frozenset(
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    ),
}
# vLLM 0.26.0's LoRAConfig.max_lora_rank is a closed set (vllm/config/lora.py MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class PeftAdapter:
    """One adapter as PEFT saves it: tensors by PEFT name, adapter_config.json's values."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def module_names(self) -> list[str]:
        """The adapted modules' Hugging Face names, in sync order."""
        suffix = _A + ".weight"
        return [n[len(PEFT_PREFIX) : -len(suffix)] for n in self.tensors if n.endswith(suffix)]


def peft_adapter(named_tensors: Iterable[tuple[str, torch.Tensor]], engine: str) -> PeftAdapter:
    """The wire format (module docstring) as PEFT's names and config; ValueError for a pair
    that is not an adapter tensor, a module to save, a module missing a part, or ranks/scales
    that differ between modules (adapter_config.json holds one r and one lora_alpha)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        if name.endswith(SAVED_SUFFIX):
            raise ValueError(
                f"update_weights: {name!r} is a module trained whole (LoraConfig."
                f"modules_to_save); the {engine} engine's LoRA API serves adapters only: train "
                "without modules_to_save, or roll out with the built-in engine"
            )
        suffix = next((s for s in LORA_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            raise ValueError(
                f"update_weights: {name!r} is a full weight in an adapter sync; send the "
                "adapter alone (policy.named_adapter_weights()) or full weights alone"
            )
        parts.setdefault(name[: -len(suffix)], {})[suffix] = tensor
    if not parts:
        raise ValueError("update_weights: the adapter sync holds no tensors")
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    scalings: dict[str, float] = {}
    for module, found in parts.items():
        missing = [s for s in LORA_SUFFIXES if s not in found]
        if missing:
            raise ValueError(f"update_weights: adapter module {module!r} lacks {missing}")
        a, b = found[_A], found[_B]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"update_weights: {module!r} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; expected [r, in] and [out, r]"
            )
        ranks[module] = a.shape[0]
        scalings[module] = float(found[_SCALING])
        tensors[f"{PEFT_PREFIX}{module}{_A}.weight"] = a
        tensors[f"{PEFT_PREFIX}{module}{_B}.weight"] = b
    if len(set(ranks.values())) > 1 or len(set(scalings.values())) > 1:
        raise ValueError(
            f"update_weights: the adapter's modules differ in rank or scale (ranks "
            f"{sorted(set(ranks.values()))}, scalings {sorted(set(scalings.values()))}); "
            "adapter_config.json holds one r and one lora_alpha"
        )
    rank = next(iter(ranks.values()))
    alpha = next(iter(scalings.values())) * rank
    # An integral alpha as an int: what PEFT itself writes for lora_alpha=16.
    alpha_value: float | int = round(alpha) if math.isclose(alpha, round(alpha)) else alpha
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha_value,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        # Leaf names, as PEFT's configs usually list them; every module of that name that
        # the sync left out holds B = 0 when PEFT reloads it (no change to the output).
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in parts}),
    }
    return PeftAdapter(tensors=tensors, config=config)


def check_served_modules(adapter: PeftAdapter, engine: str, backend: str) -> None:
    """ValueError naming the adapted modules `backend`'s LoRA does not wrap."""
    supported = ENGINE_LORA_MODULES[backend]
    bad = [m for m in adapter.module_names if m.rsplit(".", 1)[-1] not in supported]
    if bad:
        raise ValueError(
            f"update_weights: the {engine} engine's LoRA does not adapt {bad[:3]} (it adapts "
            f"{sorted(supported)}); set policy.lora.target_modules to those names"
        )


class AdapterFolders:
    """PEFT folders on tmpfs, one per adapter version, removed on close.

    Each is written under a hidden name and renamed into place, so an engine never reads half
    of one. parent: a tmpfs directory (/dev/shm: host memory, no disk)."""

    def __init__(self, parent: str | os.PathLike) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="yatt-lora-", dir=parent))

    def write(self, adapter: PeftAdapter, name: str) -> Path:
        from safetensors.torch import save_file

        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.root))
        # safetensors writes host tensors; each is small (rank x (in + out)).
        host = {k: t.detach().to("cpu").contiguous() for k, t in adapter.tensors.items()}
        save_file(host, str(staging / ADAPTER_WEIGHTS_FILE))
        (staging / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter.config, indent=1))
        final = self.root / name
        os.rename(staging, final)  # atomic within one filesystem
        return final

    def remove(self, path: str | os.PathLike) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def check_adapter_dir(field: str, path: str) -> None:
    """The folder adapters are written to exists and is writable (checked before a model loads)."""
    if not (os.path.isdir(path) and os.access(path, os.W_OK)):
        raise ValueError(
            f"{field}={path!r} is not a writable directory: point it at a tmpfs folder "
            "(/dev/shm on Linux) that exists"
        )


def lora_engine_options(
    backend: str,
    options: Mapping[str, Any],
    *,
    rank: int,
    target_modules: str | tuple[str, ...],
    modules_to_save: tuple[str, ...],
    options_field: str,
    lora_field: str,
) -> dict[str, Any]:
    """`options` (VLLMConfig/SGLangConfig fields) with what serving a LoRA of this rank needs:
    enable_lora, max_lora_rank (vLLM: the least of its allowed ranks >= rank) and, for SGLang,
    lora_target_modules. ValueError naming the field, before any model loads, for a LoRA the
    engine cannot take: modules to save, a rank over the engine's (or the options') maximum,
    target module names it does not adapt, or enable_lora=False. target_modules as a pattern
    ("all-linear", a regular expression) is checked against the model at the first sync."""
    supported = ENGINE_LORA_MODULES[backend]
    if modules_to_save:
        raise ValueError(
            f"{lora_field}.modules_to_save={list(modules_to_save)!r} with {backend}: its LoRA "
            "API serves adapters only, not a module trained whole; leave modules_to_save "
            "empty or roll out with the built-in engine"
        )
    if isinstance(target_modules, tuple):
        bad = [t for t in target_modules if t.rsplit(".", 1)[-1] not in supported]
        if bad:
            raise ValueError(
                f"{lora_field}.target_modules={list(target_modules)!r}: {backend}'s LoRA does "
                f"not adapt {bad}; use some of {sorted(supported)}"
            )
    if options.get("enable_lora") is False:
        raise ValueError(
            f"{options_field}.enable_lora=False with {lora_field} set: the engine must serve "
            "the adapter; drop the option"
        )
    given = options.get("max_lora_rank")
    if given is not None and given < rank:
        raise ValueError(
            f"{options_field}.max_lora_rank={given} is below {lora_field}.rank={rank}; raise "
            "it or drop it (the rank is then used)"
        )
    max_rank = given if given is not None else rank
    if backend == "vllm":
        fitting = [r for r in VLLM_MAX_LORA_RANKS if r >= max_rank]
        if not fitting:
            raise ValueError(
                f"{lora_field}.rank={rank}: vLLM serves LoRA ranks up to "
                f"{VLLM_MAX_LORA_RANKS[-1]}; lower it"
            )
        if given is not None and given not in VLLM_MAX_LORA_RANKS:
            raise ValueError(
                f"{options_field}.max_lora_rank={given}: vLLM takes one of "
                f"{list(VLLM_MAX_LORA_RANKS)}"
            )
        max_rank = fitting[0]
    served = {**options, "enable_lora": True, "max_lora_rank": max_rank}
    if backend == "sglang" and "lora_target_modules" not in options:
        # SGLang sizes its LoRA buffers per module type at launch; "all": every one it adapts.
        names = target_modules if isinstance(target_modules, tuple) else ("all",)
        served["lora_target_modules"] = sorted({t.rsplit(".", 1)[-1] for t in names})
    return served
