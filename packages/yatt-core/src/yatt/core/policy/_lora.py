"""LoRA on the torch backend through PEFT: only the adapter trains, saves and travels.

    TorchPolicyConfig(lora=LoraConfig(rank=8, alpha=16, target_modules="all-linear",
                                      modules_to_save=("lm_head",)))
      config:   check_lora_targets  target_modules against the model built on the meta device
      build:    attach_lora         peft.get_peft_model: LoRA layers injected into the HF model
                                    in place (its module names stay Hugging Face's), base frozen
      optimize: AdamW over requires_grad parameters = the adapter's A and B only
      save:     lora_state          {"lora_base": fingerprint, "model": adapter tensors,
                                     "optimizer": adapter AdamW state}; the base is re-read from
                                    model_dir, and a resume checks the fingerprint
      sync:     iter_adapter_weights  per targeted module "<name>.lora_A" [r, in],
                                    "<name>.lora_B" [out, r], "<name>.lora_scaling" (0-d float32:
                                    alpha / rank); the engine adds scaling * B @ A to "<name>.weight";
                                    then per parameter <p> of a module to save (trained whole)
                                    "<p>.lora_saved", its full value: the engine serves it in <p>
                                    instead of the base's, which it keeps for the adapter-off base
                merge_lora_weights  a full sync's Hugging Face weights, the adapter merged in
      reference: PeftModel.disable_adapter(): the base model itself, no frozen second copy
                                    (a module to save then runs its original, frozen copy)

PEFT's own LoraLayer does the forward (dropout on the adapter's input in training, scaling),
so the trained function is exactly what `peft.PeftModel.from_pretrained` reloads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The adapter's wire format for a weight sync: "<module>" + one of these. yatt-rollout's
# built-in engine (yatt.rollout.builtin._lora) reads the same suffixes.
LORA_A_SUFFIX = ".lora_A"
LORA_B_SUFFIX = ".lora_B"
LORA_SCALING_SUFFIX = ".lora_scaling"
# A parameter of a module to save (PEFT's modules_to_save), sent whole: "<HF param name>" + this.
LORA_SAVED_SUFFIX = ".lora_saved"
_ADAPTER = "default"  # PEFT's adapter name: one adapter per policy
_FINGERPRINT_ELEMENTS = 4096  # elements hashed of each of a few base weights


@dataclass(kw_only=True, frozen=True)
class LoraConfig:
    """Low-rank adapters (Hu et al. 2021, LoRA) on the policy's linear layers, through PEFT:
    W x + (alpha / rank) B A dropout(x), with only A [rank, in] and B [out, rank] trained."""

    rank: int = 8  # r: the adapter's inner dimension (trainable params ~ rank x (in + out))
    alpha: float = 16.0  # the update's scale is alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapter's input while training (PEFT's lora_dropout)
    # PEFT's names: "all-linear" (every linear layer but the LM head), a list of module names
    # matched as name suffixes (["q_proj", "v_proj"]), or one regular expression (full match).
    target_modules: str | tuple[str, ...] = "all-linear"
    # PEFT's modules_to_save: modules trained whole beside the adapter (a trained copy; the
    # original stays for the adapter-off base), e.g. ["lm_head"]; matched as name suffixes.
    modules_to_save: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        rank = self.rank
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"LoraConfig.rank={rank!r}: must be an int >= 1 (e.g. 8 or 16)")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
            raise ValueError(
                f"LoraConfig.alpha={alpha!r}: must be a number > 0 (the update's scale is "
                "alpha / rank; 2 x rank is usual)"
            )
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, int | float):
            raise ValueError(f"LoraConfig.dropout={dropout!r}: must be a number in [0, 1)")
        if not 0 <= dropout < 1:
            raise ValueError(f"LoraConfig.dropout={dropout!r}: must be in [0, 1)")
        targets = self.target_modules
        if isinstance(targets, list):  # YAML gives lists; the frozen config keeps a tuple
            targets = tuple(targets)
            object.__setattr__(self, "target_modules", targets)
        is_names = isinstance(targets, tuple) and all(isinstance(t, str) and t for t in targets)
        if not (isinstance(targets, str) and targets) and not (is_names and targets):
            raise ValueError(
                f"LoraConfig.target_modules={targets!r}: give 'all-linear', a list of module "
                "names (e.g. ['q_proj', 'v_proj']) or one regular expression"
            )
        saved = self.modules_to_save
        if isinstance(saved, list):
            saved = tuple(saved)
            object.__setattr__(self, "modules_to_save", saved)
        if not isinstance(saved, tuple) or not all(isinstance(m, str) and m for m in saved):
            raise ValueError(
                f"LoraConfig.modules_to_save={saved!r}: give a list of module names trained "
                "whole beside the adapter (e.g. ['lm_head']), or [] for none"
            )

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor on B A (PEFT's LoraLayer.scaling, rsLoRA off)."""
        return self.alpha / self.rank


def lora_from_value(value: Any, field: str) -> LoraConfig | None:
    """TorchPolicyConfig.lora as given: None, a LoraConfig, or a mapping of its fields (YAML)."""
    if value is None or isinstance(value, LoraConfig):
        return value
    if isinstance(value, Mapping):
        from yatt.core.config._from_dict import config_from_dict

        return config_from_dict(LoraConfig, value, path=field)
    raise ValueError(
        f"{field}={value!r}: give LoRA's fields (rank, alpha, dropout, target_modules, "
        "modules_to_save) or None"
    )


def to_peft_config(lora: LoraConfig) -> Any:
    try:
        import peft
    except ImportError as e:
        raise ImportError(
            "TorchPolicyConfig.lora needs PEFT: pip install 'yatt-core[lora]' (peft>=0.13)"
        ) from e

    targets = lora.target_modules
    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets if isinstance(targets, str) else list(targets),
        modules_to_save=list(lora.modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def check_lora_targets(lora: LoraConfig, model_dir: str, field: str) -> None:
    """ValueError naming `field` (target_modules) when an entry matches no module of the model
    in model_dir, matches its LM head, or matches a module that is not a linear layer (PEFT
    would wrap an embedding, but its adapter has no A/B the sync can carry); and naming the
    sibling field modules_to_save when one of those matches nothing, is also a LoRA target, or
    is tied to another module (tied input and output embeddings: training one copy would
    untie them). PEFT's own matching rules. The model is built on the meta device from its
    config: no weights are read."""
    from peft.tuners.tuners_utils import (
        _maybe_include_all_linear_layers,
        check_target_module_exists,
    )

    model = _meta_model(model_dir)
    modules = {name: module for name, module in model.named_modules() if name}
    head = model.get_output_embeddings()
    head_name = next((n for n, m in modules.items() if m is head), None)
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if _is_linear(m)})
    targets = lora.target_modules
    entries = [targets] if isinstance(targets, str) else list(targets)
    targeted: set[str] = set()
    # PEFT's target matching skips modules to save: the targets are matched alone here, and an
    # overlap is refused below.
    adapter_only = dataclasses.replace(lora, modules_to_save=())
    for entry in entries:
        if targets == "all-linear":  # PEFT's shorthand, resolved against this model
            single = _maybe_include_all_linear_layers(to_peft_config(adapter_only), model)
        elif isinstance(targets, str):
            single = to_peft_config(adapter_only)  # one regular expression
        else:
            single = to_peft_config(dataclasses.replace(adapter_only, target_modules=(entry,)))
        matched = [n for n in modules if check_target_module_exists(single, n)]
        if not matched:
            raise ValueError(
                f"{field}: {entry!r} matches no module of the model in {model_dir!r}; its linear "
                f"layers are named {linears} (or use 'all-linear')"
            )
        if head_name is not None and head_name in matched:
            raise ValueError(
                f"{field}: {entry!r} matches the LM head {head_name!r}, whose logprobs are "
                "computed chunk by chunk from its weight (an adapter there would be skipped); "
                "target the decoder's layers, and train the head whole with "
                f"modules_to_save=[{head_name.rsplit('.', 1)[-1]!r}]"
            )
        other = next((n for n in matched if not _is_linear(modules[n])), None)
        if other is not None:
            raise ValueError(
                f"{field}: {entry!r} matches {other!r}, a {type(modules[other]).__name__}, not "
                f"a linear layer: yatt's LoRA adapts linear layers only (its layers are named "
                f"{linears}); train an embedding whole with modules_to_save instead"
            )
        targeted.update(matched)
    _check_modules_to_save(lora, model, modules, targeted, model_dir, field)


def _check_modules_to_save(
    lora: LoraConfig,
    model: torch.nn.Module,
    modules: Mapping[str, torch.nn.Module],
    targeted: set[str],
    model_dir: str,
    field: str,
) -> None:
    saved_field = field.rsplit(".", 1)[0] + ".modules_to_save"
    embeddings = {model.get_input_embeddings(), model.get_output_embeddings()}
    is_tied = bool(getattr(model.config, "tie_word_embeddings", False)) or _shares_weight(
        *embeddings
    )
    for entry in lora.modules_to_save:
        matched = [n for n in modules if n.endswith(entry)]  # PEFT's rule (_set_trainable)
        if not matched:
            tops = sorted({n.split(".", 1)[0] for n in modules})
            raise ValueError(
                f"{saved_field}: {entry!r} matches no module of the model in {model_dir!r} "
                f"(name suffixes, e.g. 'lm_head'; its top-level modules are {tops})"
            )
        both = next((n for n in matched if n in targeted or _has_target(n, targeted)), None)
        if both is not None:
            raise ValueError(
                f"{saved_field}: {entry!r} matches {both!r}, which target_modules also adapts: "
                "a module either trains whole or gets an adapter; drop it from one of them"
            )
        tied = next((n for n in matched if is_tied and modules[n] in embeddings), None)
        if tied is not None:
            raise ValueError(
                f"{saved_field}: {entry!r} matches {tied!r}, whose weight is tied to the other "
                f"embedding (tie_word_embeddings in {model_dir!r}'s config): training one copy "
                "would untie them, and the engine serves one tensor for both; use a model with "
                "untied embeddings, or leave modules_to_save empty"
            )


def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear)


def _has_target(name: str, targeted: set[str]) -> bool:
    return any(t.startswith(name + ".") for t in targeted)


def _shares_weight(a: Any, b: Any) -> bool:
    weight_a, weight_b = getattr(a, "weight", None), getattr(b, "weight", None)
    return weight_a is not None and weight_a is weight_b


def _meta_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from yatt.core.vision._vision_forward import is_vision_language_config

    hf_config = AutoConfig.from_pretrained(model_dir)
    auto = (
        AutoModelForImageTextToText
        if is_vision_language_config(hf_config)
        else AutoModelForCausalLM
    )
    with torch.device("meta"):
        return auto.from_config(hf_config)


def attach_lora(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """The PeftModel around `model`: LoRA layers injected into it in place (so `model`'s own
    module names are unchanged, each target's weight now at "<name>.base_layer.weight"), every
    parameter but the adapter's frozen."""
    import peft

    # autocast_adapter_dtype=False: the adapter in the model's float32 (yatt's master weights).
    return peft.get_peft_model(model, to_peft_config(lora), autocast_adapter_dtype=False)


@torch.no_grad()
def cast_frozen_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Hold the frozen weights of the model's linear layers (LoRA's base, and any linear it
    does not target) in the compute dtype; their count. Autocast, or FSDP2's mixed precision,
    casts a float32 weight to this dtype for every matmul anyway, so the forward and the
    gradients are the same while the frozen base takes half the memory (no float32 master
    is needed for weights that never step) and autocast keeps no cast copies of them. The LM
    head keeps float32 (its logprobs are computed from its weight, chunk by chunk), as do
    embeddings, norms, biases and the adapter. So does a module to save's original (the
    adapter-off base), whatever it is."""
    kept = {id(m) for m in model.get_output_embeddings().modules()}
    kept.update(id(m) for _, wrapper in saved_modules(model) for m in wrapper.modules())
    count = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or id(module) in kept:
            continue
        weight = module.weight
        if not weight.requires_grad and weight.dtype != dtype:
            weight.data = weight.data.to(dtype)
            count += 1
    return count


def lora_layers(module: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(module name, PEFT LoraLayer) of each targeted module, in module order."""
    from peft.tuners.lora import LoraLayer

    for name, layer in module.named_modules():
        if isinstance(layer, LoraLayer):
            yield name, layer


def saved_modules(module: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(module name, PEFT ModulesToSaveWrapper) of each module to save, in module order."""
    from peft.utils.other import ModulesToSaveWrapper

    for name, wrapper in module.named_modules():
        if isinstance(wrapper, ModulesToSaveWrapper):
            yield name, wrapper


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def iter_adapter_weights(
    module: torch.nn.Module, *, live: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter in the sync's wire format (see the module docstring), full tensors (FSDP2
    all-gathers each on its own: every rank must consume the iterator to the end).

    live: A, B and the saved modules' parameters are the trained nn.Parameters themselves
    (no detach, no gather), for an engine that binds them once and re-reads them each step
    (BuiltinEngine.bind_adapter); ValueError for a sharded (FSDP2) parameter."""
    get = _live if live else _full
    for name, layer in lora_layers(module):
        yield name + LORA_A_SUFFIX, get(layer.lora_A[_ADAPTER].weight)
        yield name + LORA_B_SUFFIX, get(layer.lora_B[_ADAPTER].weight)
        scaling = torch.tensor(float(layer.scaling[_ADAPTER]), dtype=torch.float32)
        yield name + LORA_SCALING_SUFFIX, scaling
    for name, wrapper in saved_modules(module):
        for param_name, param in wrapper.modules_to_save[_ADAPTER].named_parameters():
            yield f"{name}.{param_name}{LORA_SAVED_SUFFIX}", get(param)


def _live(param: torch.Tensor) -> torch.Tensor:
    if hasattr(param, "full_tensor"):
        raise ValueError(
            "named_adapter_weights(live=True): the adapter's parameters are FSDP2 shards, "
            "which an engine cannot bind; sync named_adapter_weights() (gathered) instead"
        )
    return param


def peft_saved_name(name: str) -> str | None:
    """The key PEFT's save_pretrained gives the PEFT model's parameter `name` (its prefix, no
    adapter name): an adapter A or B, or a module to save's trained copy; None for the rest."""
    for marker, plain in (
        (f".lora_A.{_ADAPTER}.", ".lora_A."),
        (f".lora_B.{_ADAPTER}.", ".lora_B."),
        (f".modules_to_save.{_ADAPTER}.", "."),
    ):
        if marker in name:
            return "base_model.model." + name.replace(marker, plain)
    return None


def merge_lora_weights(
    named_parameters: Iterable[tuple[str, torch.Tensor]], scalings: Mapping[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) pairs of the model with its adapter merged in, from the PEFT
    model's (name, full tensor) pairs: "<m>.base_layer.<p>" becomes "<m>.<p>", a target's weight
    W + scaling B A (float32); the adapter's own tensors are consumed. A module to save's
    trained copy "<m>.modules_to_save.default.<p>" becomes "<m>.<p>", its original (the
    adapter-off base, "<m>.original_module.<p>") is dropped. scalings: per target module name.
    Streams: a target's base weight waits only for its own A and B."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_parameters:
        if ".original_module." in name:
            continue
        name = name.replace(f".modules_to_save.{_ADAPTER}.", ".")
        module, sep, rest = name.partition(".base_layer.")
        if sep:
            if rest == "weight":
                pending.setdefault(module, {})["W"] = tensor
                yield from _merged_if_ready(module, pending, scalings)
            else:
                yield f"{module}.{rest}", tensor  # the bias: unchanged by LoRA
            continue
        for key, marker in (
            ("A", f".lora_A.{_ADAPTER}.weight"),
            ("B", f".lora_B.{_ADAPTER}.weight"),
        ):
            if name.endswith(marker):
                module = name[: -len(marker)]
                pending.setdefault(module, {})[key] = tensor
                yield from _merged_if_ready(module, pending, scalings)
                break
        else:
            yield name, tensor
    assert not pending, f"adapter tensors without their base weight: {sorted(pending)}"


def _merged_if_ready(
    module: str, pending: dict[str, dict[str, torch.Tensor]], scalings: Mapping[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    parts = pending[module]
    if len(parts) < 3:
        return
    del pending[module]
    # float32, whatever dtype the frozen base is held in (cast_frozen_linears): the receiver
    # rounds once, to its own dtype.
    delta = (parts["B"].float() @ parts["A"].float()) * scalings[module]
    yield f"{module}.weight", parts["W"].float() + delta


# -- what a checkpoint holds -------------------------------------------------------------------


def compute_base_fingerprint(model_dir: str, model: torch.nn.Module) -> torch.Tensor:
    """sha256 (32 uint8) of the model's config.json (parsed, keys sorted: formatting aside)
    and the first elements of its first, middle and last weights as loaded in float32."""
    digest = hashlib.sha256()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    params = list(model.named_parameters())
    for index in sorted({0, len(params) // 2, len(params) - 1}):
        name, param = params[index]
        head = param.detach().reshape(-1)[:_FINGERPRINT_ELEMENTS].to("cpu", torch.float32)
        digest.update(name.encode())
        digest.update(head.numpy().tobytes())
    return torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8).clone()


class BaseFingerprint:
    """The base model's fingerprint in a checkpoint: a resume on another base is refused."""

    def __init__(self, fingerprint: torch.Tensor, model_dir: str, field: str) -> None:
        self._fingerprint = fingerprint
        self._model_dir = model_dir
        self._field = field

    def state_dict(self) -> dict[str, Any]:
        # A copy: the checkpoint loads into the live dict in place, the check compares to ours.
        return {"fingerprint": self._fingerprint.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not torch.equal(state["fingerprint"].to("cpu"), self._fingerprint):
            raise ValueError(
                f"{self._field}={self._model_dir!r} is not the base model this checkpoint's "
                "LoRA adapter was trained on (its config or weights differ); point "
                f"{self._field} at the model the run started from"
            )


class AdapterWeights:
    """The module's trainable (adapter) tensors only, by their PEFT-injected names; FSDP2
    shards as DTensors, so a checkpoint written by N ranks loads on M."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(ignore_frozen_params=True)
        return get_model_state_dict(self._module, options=options)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        # strict=False: the frozen base is not in the checkpoint (it is read from model_dir).
        options = StateDictOptions(ignore_frozen_params=True, strict=False)
        set_model_state_dict(self._module, dict(state), options=options)


class AdapterOptimizer:
    """AdamW's state of the adapter (the only parameters it holds), keyed by parameter name."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._module = module
        self._optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self._module, self._optimizer)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self._module, self._optimizer, dict(state))
