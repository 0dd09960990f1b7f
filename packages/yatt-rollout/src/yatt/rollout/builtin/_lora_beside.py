"""A LoRA adapter applied beside the base GEMMs, per row: the base weights stay untouched.

EngineConfig.lora_mode="beside". Each target module <m> keeps its base weight W as it is
and adds the low-rank product to its output, gated per row of the forward pass:

    y_RO = x_RI W^T  +  (row_on_R * x_RI) A^T (s B)^T        R rows, I in, O out
    (row_on_R: 1 for a row whose request asked for the adapter, 0 for one that asked for the
    base, Request.use_adapter)

so one resident copy of the weights serves the policy (adapter on) and, in the same batch,
a self-judging GenRM or any request on the base (adapter off: the added term is exactly 0,
the base's output bit for bit). The gate is a device tensor the step fills from per-slot
state before the forward (a graph input under CUDA graphs; no Python branch per row).

Legend: R rows of the forward (a decode batch, or prefill prompts), I/O in/out features.

Buffers per target module, allocated at the first adapter of a rank and reused in place by
the next adapters of that rank (captured graphs stay valid; a new rank re-allocates them and
the engine drops its graphs):
    A   [rank, in]  served dtype
    sB  [out, rank] served dtype, the scaling folded in (computed in float32, then rounded)

A module trained whole (PEFT's modules_to_save, "<p>.lora_saved") keeps the base's value in
<p> and its trained value in a second buffer; rows with the adapter on take the trained
module's output (torch.where, exact). One extra copy of those modules only (the LM head).

A full sync of "<m>.weight" (or of <p>) is the new base and drops that module's adapter (A,
sB and the trained copy's device flag zeroed in place, buffers kept), as in merge mode.
EngineConfig.max_lora_rank and lora_modules_to_save make the buffers and hooks with the engine,
so no sync changes what its first compile holds.

Cost: two small GEMMs per target and layer in every forward, against none for merging
(bench/lora/lora_modes_gpu.py times both). What it buys: no per-sync pass over the weights
and adapter-on and -off rows in one batch. A sync of adapters already loaded at that rank
writes every module's factors of a bucket with multi-tensor copies and one multiply (in place
for a power-of-two scaling; _load_ready), not a handful of small kernels per module: issue
45's sync bar compares it with a full sync, which in this process is one device copy of the
weights (27 ms for a 7B).
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F

from yatt.rollout.builtin._adapter_binding import BoundCopies, can_scale_in_place
from yatt.rollout.builtin._lora import LORA_SAVED_SUFFIX, split_adapter_name

logger = logging.getLogger(__name__)


def selects(target_modules: str | tuple[str, ...], name: str) -> bool:
    """Whether PEFT's target_modules rule picks the module `name` (the output layer is left
    out by the caller): "all-linear" every one, another string a regular expression matched
    against the whole name, a tuple a name or a name's last dotted parts."""
    if isinstance(target_modules, str):
        return target_modules == "all-linear" or re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


class _Factors:
    """One target module's adapter buffers (see the module docstring)."""

    def __init__(self, A: torch.Tensor, sB: torch.Tensor) -> None:
        self.A = A
        self.sB = sB


class _Saved:
    """A module to save's trained weight, served to rows with the adapter on while `on` (a
    device flag: set and cleared in place, so captured graphs and compiled code stay valid)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.on = torch.zeros((), dtype=weight.dtype, device=weight.device)


class LowRankBeside:
    """Adapters beside the base GEMMs of one engine's model, gated per row."""

    def __init__(self, model: torch.nn.Module, *, max_rows: int, dtype, device) -> None:
        self._model = model
        # The per-row gate every hook reads: the first R entries hold the running forward's
        # rows (the step fills it before each forward). Outside any region: a few bytes, and
        # a captured graph's address stays valid across sleep.
        self.row_on_R = torch.ones(max_rows, dtype=dtype, device=device)
        self._factors: dict[str, _Factors] = {}
        self._saved: dict[str, _Saved] = {}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self.refreshed: set[str] = set()  # plain weights the running sync sent
        self._loaded_now: set[str] = set()  # modules (and saved parameters) it gave an adapter

    @property
    def modules(self) -> list[str]:
        return sorted(self._factors)

    @property
    def saved_parameters(self) -> list[str]:
        return sorted(self._saved)

    def factor_bytes(self) -> int:
        """Bytes of the adapter buffers beside the base (factors and trained modules)."""
        total = sum(f.A.nbytes + f.sB.nbytes for f in self._factors.values())
        return total + sum(s.weight.nbytes for s in self._saved.values())

    @torch.no_grad()
    def reserve(self, rank: int, target_modules: str | tuple[str, ...]) -> list[str]:
        """Zero buffers of `rank` and the hook of every selected Linear (the output layer
        aside) before any adapter (EngineConfig.max_lora_rank): the output stays the base's,
        and an adapter of rank <= `rank` later loads in place (no new layout). Allocated in
        the caller's memory region. Returns the modules; ValueError when none is selected."""
        output = self._model.get_output_embeddings()
        selected = [
            (name, module)
            for name, module in self._model.named_modules()
            if isinstance(module, torch.nn.Linear)
            and module is not output
            and selects(target_modules, name)
        ]
        if not selected:
            raise ValueError(
                f"EngineConfig.lora_target_modules={target_modules!r} selects no Linear module "
                "of the served model (the output layer is never a target); give module names "
                "such as ('q_proj', 'v_proj') or 'all-linear'"
            )
        for name, module in selected:
            weight = module.weight
            out_features, in_features = weight.shape
            self._factors[name] = _Factors(
                torch.zeros(rank, in_features, dtype=weight.dtype, device=weight.device),
                torch.zeros(out_features, rank, dtype=weight.dtype, device=weight.device),
            )
            self._hooks[name] = module.register_forward_hook(self._low_rank_hook(name))
        return [name for name, _ in selected]

    @torch.no_grad()
    def reserve_saved(self, modules: tuple[str, ...]) -> list[str]:
        """A zero trained copy, off, and the hook of each named module's weight (PEFT's
        modules_to_save: a name or its last dotted parts; Linear modules only) before any
        adapter (EngineConfig.lora_modules_to_save): the first sync then only fills it and
        turns it on. Returns the parameters; ValueError when a name selects nothing."""
        chosen = []
        for target in modules:
            found = [
                (name, module)
                for name, module in self._model.named_modules()
                if (name == target or name.endswith("." + target))
                and isinstance(module, torch.nn.Linear)
            ]
            if not found:
                raise ValueError(
                    f"EngineConfig.lora_modules_to_save: {target!r} names no Linear module of "
                    "the served model (a module to save is served beside the adapter only "
                    "when it is a Linear, e.g. 'lm_head')"
                )
            for name, _ in found:
                param = name + ".weight"
                if param not in self._saved:
                    self._add_saved(param)
                    chosen.append(param)
        return chosen

    def _add_saved(self, param: str) -> _Saved:
        """A module to save's trained copy of `param` (zeros, off) and its module's hook."""
        module = self._model.get_submodule(param.removesuffix(".weight"))
        saved = self._saved[param] = _Saved(torch.zeros_like(module.weight))
        self._hooks[param] = module.register_forward_hook(self._saved_hook(param))
        return saved

    def set_rows(self, row_on: torch.Tensor) -> None:
        """The gate of the next forward's rows (a device tensor, any dtype, 1 on / 0 off)."""
        self.row_on_R[: row_on.shape[0]].copy_(row_on)

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        return self.row_on_R[:rows].view(rows, *([1] * (x.ndim - 1)))

    # -- a sync's pieces ----------------------------------------------------------------------

    def begin(self) -> None:
        """A new update_weights call."""
        self.refreshed.clear()
        self._loaded_now.clear()
        self._pending.clear()

    def take(
        self, bucket: list[tuple[str, torch.Tensor]], targets, *, are_weights_lost: bool
    ) -> tuple[list, bool]:
        """Apply the bucket's adapter pieces and return (its plain weights, whether buffers
        were (re)allocated, hooks added or a trained module dropped, so captured graphs must
        go). A plain weight of a module with an adapter drops it: the new base.
        are_weights_lost: the base was woken without a backup; an adapter then needs its
        module's base weight in this same sync (`refreshed`, reset per update_weights)."""
        rest, is_new_layout = [], False
        ready: list[tuple[str, dict[str, torch.Tensor]]] = []  # complete in this bucket
        arrived: list[tuple[str, str]] = []  # (module, piece) this bucket sent
        for name, tensor in bucket:
            if are_weights_lost:
                self._check_base_refreshed(name)
            if name.endswith(LORA_SAVED_SUFFIX):
                param = name[: -len(LORA_SAVED_SUFFIX)]
                is_new_layout |= self._load_saved(param, tensor, targets)
                self._loaded_now.add(param)
                continue
            split = split_adapter_name(name)
            if split is None:
                self._drop(name)
                self.refreshed.add(name)
                rest.append((name, tensor))
                continue
            module, piece = split
            parts = self._pending.setdefault(module, {})
            parts[piece] = tensor.detach()
            arrived.append((module, piece))
            if len(parts) == 3:
                del self._pending[module]
                ready.append((module, parts))
                self._loaded_now.add(module)
        # Loaded together (a few multi-tensor kernels for the whole bucket, not ~6 small ones
        # per module), before the caller copies this bucket's plain weights, as one by one.
        is_new_layout |= self._load_ready(ready, targets)
        # This bucket's pieces still waiting for their module's others: the sender may reuse
        # its bucket's memory after the call, so they are kept as copies (once each).
        for module, piece in arrived:
            if module in self._pending:
                self._pending[module][piece] = self._pending[module][piece].clone()
        return rest, is_new_layout

    @staticmethod
    def check_bindable(pairs: list[tuple[str, torch.Tensor]]) -> None:
        """ValueError unless `pairs` is an adapter alone whose trained tensors (A, B, saved
        parameters) are the trainer's nn.Parameters: a detached copy would go stale."""
        for name, tensor in pairs:
            split = split_adapter_name(name)
            if split is None and not name.endswith(LORA_SAVED_SUFFIX):
                raise ValueError(
                    f"bind_adapter: {name!r} is a full weight; bind the adapter alone "
                    "(policy.named_adapter_weights(live=True)) and sync full weights with "
                    "update_weights"
                )
            is_trained = split is None or split[1] != "scaling"
            if is_trained and not isinstance(tensor, torch.nn.Parameter):
                raise ValueError(
                    f"bind_adapter: {name!r} is a {type(tensor).__name__}, not the trained "
                    "nn.Parameter: a copy or a view goes stale when the trainer moves it; "
                    "pass policy.named_adapter_weights(live=True)"
                )

    def bound_copies(self, pairs: list[tuple[str, torch.Tensor]]) -> BoundCopies:
        """The copies that refresh an adapter already loaded from `pairs` (check_bindable's,
        which update_weights just took) into its buffers: the engine's bind_adapter."""
        copies = BoundCopies()
        parts: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
        saved: list[tuple[str, torch.Tensor]] = []
        for name, tensor in pairs:
            split = split_adapter_name(name)
            if split is None:
                saved.append((name, tensor))
            else:
                parts.setdefault(split[0], {})[split[1]] = (name, tensor)
        names_B: list[str] = []
        for module, got in parts.items():
            factors = self._factors[module]
            (name_A, A), (name_B, B), (_, scaling) = got["A"], got["B"], got["scaling"]
            rank = A.shape[0]
            is_padded = factors.A.shape[0] != rank  # reserved at a larger rank: zeros after
            copies.A_dst.append(factors.A[:rank] if is_padded else factors.A)
            copies.sB_dst.append(factors.sB[:, :rank] if is_padded else factors.sB)
            copies.A_src.append(A)
            copies.B_src.append(B)
            copies.scalings.append(float(scaling))
            copies.names.append(name_A)
            names_B.append(name_B)
        copies.names += names_B
        for name, tensor in saved:
            copies.saved_dst.append(self._saved[name[: -len(LORA_SAVED_SUFFIX)]].weight)
            copies.saved_src.append(tensor)
            copies.names.append(name)
        copies.check()
        return copies

    def _check_base_refreshed(self, name: str) -> None:
        if name.endswith(LORA_SAVED_SUFFIX):
            base = name[: -len(LORA_SAVED_SUFFIX)]
        elif (split := split_adapter_name(name)) is not None:
            base = split[0] + ".weight"
        else:
            return
        if base not in self.refreshed:
            raise ValueError(
                f"update_weights: {name!r} while the weights are lost (woken with "
                "should_back_up_weights=False): sync the full weights first "
                "(policy.named_weights()), or keep the backup for adapter-only syncs"
            )

    def finish(self) -> None:
        if self._pending:
            module, parts = next(iter(self._pending.items()))
            self._pending.clear()
            missing = sorted({"A", "B", "scaling"} - set(parts))
            raise ValueError(
                f"update_weights: the adapter of {module!r} lacks {missing}; send "
                "'<module>.lora_A', '.lora_B' and '.lora_scaling' for each target "
                "(TorchPolicy.named_adapter_weights())"
            )

    @torch.no_grad()
    def _drop(self, name: str) -> None:
        """A full value of `name` is the new base: its adapter goes (in place: the forward's
        layout is unchanged, captured graphs stay valid)."""
        module = name.removesuffix(".weight")
        if name in self._loaded_now or (name.endswith(".weight") and module in self._loaded_now):
            raise ValueError(
                f"update_weights: {name!r} came after the adapter loaded for it; send full "
                "weights before the adapter"
            )
        if name.endswith(".weight") and module in self._factors:
            # In place: graphs stay valid. Both factors: after a wake without backup they hold
            # garbage, and a NaN in A times a zeroed sB is still NaN.
            self._factors[module].A.zero_()
            self._factors[module].sB.zero_()
        saved = self._saved.get(name)
        if saved is not None:  # whatever its state: woken without backup, the flag is garbage
            saved.on.zero_()  # in place: the hook reads the flag on the device

    @torch.no_grad()
    def _load_ready(self, ready: list[tuple[str, dict[str, torch.Tensor]]], targets) -> bool:
        """Load complete adapters: into the buffers they already have (same rank) with
        multi-tensor kernels, the others one by one (new buffers and hooks). True when any
        buffers were allocated (captured graphs must go)."""
        in_place: list[tuple[_Factors, dict[str, torch.Tensor]]] = []
        is_new_layout = False
        for module, parts in ready:
            weight = self._check(module, parts, targets)
            factors = self._factors.get(module)
            if factors is not None and factors.A.shape == parts["A"].shape:
                in_place.append((factors, parts))
            elif factors is not None and factors.A.shape[0] > parts["A"].shape[0]:
                self._load_padded(factors, parts)  # a lower rank than the buffers' (reserved)
            else:
                if factors is not None:
                    logger.warning(
                        "update_weights: %r's adapter has rank %d, over its buffers' %d "
                        "(EngineConfig.max_lora_rank): buffers made anew, graphs recompiled",
                        module,
                        parts["A"].shape[0],
                        factors.A.shape[0],
                    )
                is_new_layout |= self._load(module, parts, weight)
        if in_place:
            device = in_place[0][0].A.device
            sB = [f.sB for f, _ in in_place]
            # The scalings are host scalars in the wire format (no device sync to read them).
            scalings = [float(p["scaling"]) for _, p in in_place]
            torch._foreach_copy_(
                [f.A for f, _ in in_place], [p["A"].to(device) for _, p in in_place]
            )
            # sB as one by one: scaling * B in float32, rounded once into the served dtype;
            # for a power-of-two scaling, B cast first and scaled in place rounds alike.
            if can_scale_in_place(scalings, sB):
                torch._foreach_copy_(sB, [p["B"].to(device) for _, p in in_place])
                torch._foreach_mul_(sB, scalings)
            else:
                B = [p["B"].to(device, torch.float32) for _, p in in_place]
                torch._foreach_copy_(sB, torch._foreach_mul(B, scalings))
        return is_new_layout

    def _check(self, module: str, parts: dict[str, torch.Tensor], targets) -> torch.Tensor:
        """The module's served weight; ValueError when the adapter does not fit it."""
        weight = targets.get(module + ".weight")
        if weight is None:
            raise ValueError(
                f"update_weights: adapter for {module!r}, which has no '.weight' in the served "
                "model; give Hugging Face module names"
            )
        A, B, scaling = parts["A"], parts["B"], parts["scaling"]
        if A.ndim != 2 or B.ndim != 2 or B.shape[1] != A.shape[0] or scaling.ndim:
            raise ValueError(
                f"update_weights: adapter of {module!r} has A {tuple(A.shape)}, B "
                f"{tuple(B.shape)}, scaling {tuple(scaling.shape)}; expected A [rank, in], "
                "B [out, rank] and a 0-d scaling"
            )
        if (B.shape[0], A.shape[1]) != tuple(weight.shape):
            raise ValueError(
                f"update_weights: adapter of {module!r} makes a {B.shape[0]}x{A.shape[1]} "
                f"update for a {tuple(weight.shape)} weight"
            )
        return weight

    @torch.no_grad()
    def _load_padded(self, factors: _Factors, parts: dict[str, torch.Tensor]) -> None:
        """An adapter of rank r into buffers of a larger rank: its factors in the first r
        rows of A and columns of sB, zeros after (they add exactly 0), in place."""
        r = parts["A"].shape[0]
        device = factors.A.device
        factors.A[:r].copy_(parts["A"])
        factors.A[r:].zero_()
        B = parts["B"].to(device, torch.float32)
        factors.sB[:, :r].copy_(B * float(parts["scaling"]))
        factors.sB[:, r:].zero_()

    @torch.no_grad()
    def _load(self, module: str, parts: dict[str, torch.Tensor], weight: torch.Tensor) -> bool:
        """A module's first adapter, or one of a new rank: new buffers (and its hook)."""
        # Copies, never views of the sender's tensors (a colocated trainer's live LoRA
        # parameters): the buffers change only at the next sync.
        A = parts["A"].to(weight.device, weight.dtype, copy=True)
        B = parts["B"].to(weight.device, torch.float32)
        sB = (B * float(parts["scaling"])).to(weight.dtype)
        # New buffers in the weights' region (the caller's region scope) and a hook if new.
        new = _Factors(A, sB)
        self._factors[module] = new
        if module not in self._hooks:
            self._hooks[module] = self._model.get_submodule(module).register_forward_hook(
                self._low_rank_hook(module)
            )
        return True

    @torch.no_grad()
    def _load_saved(self, name: str, tensor: torch.Tensor, targets) -> bool:
        served = targets.get(name)
        if served is None:
            raise ValueError(
                f"update_weights: '{name}{LORA_SAVED_SUFFIX}' is a module to save's value for "
                f"{name!r}, which the served model lacks; give Hugging Face parameter names"
            )
        if tuple(tensor.shape) != tuple(served.shape):
            raise ValueError(
                f"update_weights: '{name}{LORA_SAVED_SUFFIX}' has shape {tuple(tensor.shape)}; "
                f"the served {name!r} is {tuple(served.shape)}"
            )
        if not name.endswith(".weight"):
            raise ValueError(
                f"update_weights: '{name}{LORA_SAVED_SUFFIX}': lora_mode='beside' serves a "
                "module to save's weight only (a Linear, e.g. lm_head.weight); use "
                "EngineConfig.lora_mode='merge'"
            )
        saved = self._saved.get(name)
        is_new = saved is None
        if is_new:
            saved = self._add_saved(name)
        saved.weight.copy_(tensor)
        saved.on.fill_(1)
        return is_new

    # -- the forward hooks --------------------------------------------------------------------

    def _low_rank_hook(self, module: str):
        factors_of = self._factors

        def hook(_mod, args, out):
            f = factors_of[module]
            x = args[0]
            # The gate on the low-rank input: an off row adds exactly 0 to the base output.
            return out + F.linear(F.linear(x * self._gate(x), f.A), f.sB)

        return hook

    def _saved_hook(self, name: str):
        saved_of = self._saved

        def hook(_mod, args, out):
            saved = saved_of[name]
            x = args[0]
            trained = F.linear(x, saved.weight, _mod.bias)
            # Rows with the adapter on, while a trained value is set (device flags: no host
            # branch, so setting or clearing it keeps captured graphs); a select, exact.
            return torch.where(self._gate(x) * saved.on > 0, trained, out)

        return hook
