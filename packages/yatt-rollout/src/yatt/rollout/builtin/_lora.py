"""A LoRA adapter synced into the built-in engine by merging it into the served weights.

The trainer sends only the adapter (yatt.core's TorchPolicy.named_adapter_weights()), per
target module <m> (a Hugging Face module name):
    "<m>.lora_A"        [rank, in]
    "<m>.lora_B"        [out, rank]
    "<m>.lora_scaling"  0-d: alpha / rank
and the engine serves W = base + scaling B A in "<m>.weight", with no second full copy of the
weights: it keeps, per module, the factors it merged last (rank x (in + out) numbers) and the
few base values the merge cannot give back (below), and a new adapter replaces them:

    pieces arrive (any bucket split) -> a module's three are in ->
      base = to_dtype(float32(W) - delta_prev); base[kept] = kept values   un-apply, exactly
      W    = to_dtype(float32(base) + delta)        delta = scaling * (B @ A), float32
      kept = where to_dtype(float32(W) - delta) != base: those base values, kept sparse
      remember (A, B, scaling, kept)

Why it is exact: W = round(base + delta), so W - delta is the base plus at most half a unit in
the last place of W, and rounding it to the served dtype gives the base back wherever W's
spacing is the base's (bf16 or float32 alike). Where it is not (the merge crossed a power of
two, the base is 0, a rounding tie) the check above finds it at merge time and keeps the base
value: a few elements in a hundred when the delta is ~1% of the weight, all of them when it
dwarfs it. Without the rounding step, each sync's rounding error would carry into the next: in
bf16, updates smaller than half a unit would never show (W stays put while the adapter grows).
So the engine serves what a full sync of the merged weights serves (the trainer merges
W + scaling B A in float32 and the copy rounds it), bit for bit where both compute B A alike.

The same exact un-apply turns the adapter off and on in place (AdapterMerger.set_enabled): the
resident weights serve the base bit for bit, for a self-judging GenRM or a KL reference, and
then base + adapter again; a pass over the targets' weights each way.

A full sync of "<m>.weight" replaces the served weight outright: the module's remembered
factors are dropped (the next adapter is added to that weight as the new base).

A module trained whole beside the adapter (PEFT's modules_to_save, e.g. the LM head) arrives
as "<p>.lora_saved" per parameter <p>, its full trained value: the engine copies it into <p>
outright (not a low-rank delta), and the first time keeps the base's value of <p> aside (one
copy of those modules only), which set_enabled(False) serves again; a full sync of <p> makes
the new value the base.

Merging keeps the forward untouched (no extra GEMMs per decode step, CUDA graphs stay valid:
the weights change in place). The alternative, EngineConfig.lora_mode="beside"
(_lora_beside.py), runs the low-rank product beside each base GEMM: the base stays exact and
rows with and without the adapter share a batch, for two small GEMMs per target and layer in
every forward (bench/lora/lora_modes_gpu.py times both).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from yatt.rollout._weights import LORA_SUFFIXES, copy_bucket

# The wire format (yatt.core.policy._lora writes it).
LORA_A_SUFFIX, LORA_B_SUFFIX, LORA_SCALING_SUFFIX = LORA_SUFFIXES
# A module to save's parameter, whole (yatt.core.policy._lora.LORA_SAVED_SUFFIX).
LORA_SAVED_SUFFIX = ".lora_saved"
_PIECES = {LORA_A_SUFFIX: "A", LORA_B_SUFFIX: "B", LORA_SCALING_SUFFIX: "scaling"}


def split_adapter_name(name: str) -> tuple[str, str] | None:
    """(module, piece "A" | "B" | "scaling") of an adapter tensor's name; None for a weight."""
    for suffix, piece in _PIECES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], piece
    return None


@dataclass
class _Delta:
    """One module's merged adapter: scaling * B @ A, factors in float32 on the weight's device;
    and the base values that un-merging would not give back (flat indices, values)."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    kept_index: torch.Tensor | None = None
    kept_values: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        return (self.B @ self.A).mul_(self.scaling)

    def unapply(self, weight: torch.Tensor) -> torch.Tensor:
        """The base this delta was merged into, exactly (module docstring): a new tensor."""
        # Back onto the served dtype's grid, then the values rounding cannot give back. (A
        # bf16/fp16 weight minus the float32 delta computes in float32, exactly as weight.float()
        # would, without that copy: every merge and un-merge is a few passes over the weight.)
        base = (weight - self.dense()).to(weight.dtype)
        if self.kept_index is not None:
            base.view(-1)[self.kept_index] = self.kept_values
        return base


class AdapterMerger:
    """The adapter merged into one engine's served weights (see the module docstring)."""

    def __init__(self) -> None:
        self._merged: dict[str, _Delta] = {}  # per module: the delta its weight holds now
        # Per parameter of a module to save: the value not served now (the base's while the
        # adapter is on, the trained one while it is off).
        self._saved: dict[str, torch.Tensor] = {}
        self.is_disabled = False  # the weights hold the base (set_enabled(False))

    @property
    def merged_modules(self) -> list[str]:
        return sorted(self._merged)

    def kept_bytes(self) -> int:
        """Bytes of the merged factors and kept base values (what un-merging needs)."""
        total = 0
        for delta in self._merged.values():
            total += delta.A.nbytes + delta.B.nbytes
            if delta.kept_index is not None:
                total += delta.kept_index.nbytes + delta.kept_values.nbytes
        return total

    @property
    def saved_parameters(self) -> list[str]:
        """Parameters served from a module to save's trained value (their base kept aside)."""
        return sorted(self._saved)

    def begin(self, targets: dict[str, torch.Tensor], *, are_weights_lost: bool) -> AdapterSync:
        """One update_weights call's view: route its pairs, merge modules as they complete.
        are_weights_lost: the weights were woken without a backup (garbage until a full sync):
        an adapter then merges only into weights this same call sent in full."""
        if self.is_disabled:
            raise RuntimeError(
                "update_weights while the LoRA adapter is off (serving the base); turn it "
                "back on first"
            )
        return AdapterSync(self, targets, are_weights_lost=are_weights_lost)

    @torch.no_grad()
    def set_enabled(self, targets: dict[str, torch.Tensor], is_enabled: bool) -> None:
        """Serve the base (False) or base + adapter (True) again, in place and exactly: the
        base a self-judging GenRM or a KL reference reads from the same resident weights.
        A pass over the targets' weights each way; no-op when already so."""
        if is_enabled != self.is_disabled:
            return
        for module, delta in self._merged.items():
            weight = targets[module + ".weight"]
            if is_enabled:
                weight.copy_(weight + delta.dense())  # the copy rounds, as .to() would
            else:
                weight.copy_(delta.unapply(weight))
        for name, other in self._saved.items():
            served = targets[name]
            current = served.clone()
            served.copy_(other)
            self._saved[name] = current
        self.is_disabled = not is_enabled


class AdapterSync:
    def __init__(
        self, merger: AdapterMerger, targets: dict[str, torch.Tensor], *, are_weights_lost: bool
    ) -> None:
        self._merger = merger
        self._targets = targets
        self._are_weights_lost = are_weights_lost
        self._refreshed: set[str] = set()  # modules (and parameters) this call sent in full
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._ready: list[tuple[str, dict[str, torch.Tensor]]] = []  # complete, not merged yet
        self._merged_now: set[str] = set()  # modules this call merged an adapter into
        self._saved_ready: list[tuple[str, torch.Tensor]] = []  # whole values, not copied yet
        self._saved_now: set[str] = set()  # parameters this call served a saved value in

    def copy_bucket(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the bucket's plain weights (yatt.rollout._weights.copy_bucket), then merge the
        adapters it completed: full weights and an adapter in one bucket give base + adapter."""
        copy_bucket(self._targets, self.take(bucket))
        saved, self._saved_ready = self._saved_ready, []
        for name, tensor in saved:
            self._serve_saved(name, tensor)
        ready, self._ready = self._ready, []
        for module, parts in ready:
            self._merge(module, parts)
            self._merged_now.add(module)

    def take(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Collect the bucket's adapter pieces (a module is ready once its A, B and scaling are
        in) and return its other pairs, the plain weights, for copying. A plain "<m>.weight"
        drops the module's remembered adapter: it is the new base."""
        rest = []
        for name, tensor in bucket:
            if name.endswith(LORA_SAVED_SUFFIX):
                param = name[: -len(LORA_SAVED_SUFFIX)]
                self._saved_ready.append((param, tensor))
                self._saved_now.add(param)
                continue
            split = split_adapter_name(name)
            if split is None:
                if name in self._saved_now:
                    raise ValueError(
                        f"update_weights: {name!r} came after its module to save's value "
                        f"('{name}{LORA_SAVED_SUFFIX}'); send full weights before the adapter"
                    )
                self._merger._saved.pop(name, None)  # a full value: the new base
                self._refreshed.add(name)
                if name.endswith(".weight"):
                    module = name[: -len(".weight")]
                    if module in self._merged_now:
                        raise ValueError(
                            f"update_weights: {name!r} came after the adapter merged into it; "
                            "send full weights before the adapter"
                        )
                    self._merger._merged.pop(module, None)
                    self._refreshed.add(module)
                rest.append((name, tensor))
                continue
            module, piece = split
            parts = self._pending.setdefault(module, {})
            # A copy on the engine's side: the sender may reuse its bucket after the sync.
            parts[piece] = tensor.detach().to(torch.float32, copy=True)
            if len(parts) == len(_PIECES):
                del self._pending[module]
                self._ready.append((module, parts))
        return rest

    def finish(self) -> None:
        """ValueError naming the first module whose adapter arrived incomplete."""
        if self._pending:
            module, parts = next(iter(self._pending.items()))
            missing = sorted(set(_PIECES.values()) - set(parts))
            raise ValueError(
                f"update_weights: the adapter of {module!r} lacks {missing}; send "
                f"'<module>{LORA_A_SUFFIX}', '{LORA_B_SUFFIX}' and '{LORA_SCALING_SUFFIX}' for "
                "each target (TorchPolicy.named_adapter_weights())"
            )

    @torch.no_grad()
    def _serve_saved(self, name: str, tensor: torch.Tensor) -> None:
        """Serve a module to save's whole value in `name`, the base's value kept aside."""
        served = self._targets.get(name)
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
        saved = self._merger._saved
        if name not in saved:
            if self._are_weights_lost and name not in self._refreshed:
                raise ValueError(
                    f"update_weights: a module to save's value for {name!r} while the weights "
                    "are lost (woken with should_back_up_weights=False): its base is gone; sync "
                    "the full weights first (policy.named_weights())"
                )
            saved[name] = served.detach().clone()  # the base, for set_enabled(False)
        served.copy_(tensor)

    @torch.no_grad()
    def _merge(self, module: str, parts: dict[str, torch.Tensor]) -> None:
        weight = self._targets.get(module + ".weight")
        if weight is None:
            raise ValueError(
                f"update_weights: adapter for {module!r}, which has no '.weight' in the served "
                "model; give Hugging Face module names"
            )
        A, B = parts["A"].to(weight.device), parts["B"].to(weight.device)
        if A.ndim != 2 or B.ndim != 2 or B.shape[1] != A.shape[0] or parts["scaling"].ndim:
            raise ValueError(
                f"update_weights: adapter of {module!r} has A {tuple(A.shape)}, B "
                f"{tuple(B.shape)}, scaling {tuple(parts['scaling'].shape)}; expected A "
                "[rank, in], B [out, rank] and a 0-d scaling"
            )
        if (B.shape[0], A.shape[1]) != tuple(weight.shape):
            raise ValueError(
                f"update_weights: adapter of {module!r} makes a {B.shape[0]}x{A.shape[1]} "
                f"update for a {tuple(weight.shape)} weight"
            )
        if self._are_weights_lost and module not in self._refreshed:
            raise ValueError(
                f"update_weights: an adapter for {module!r} while the weights are lost (woken "
                "with should_back_up_weights=False): sync the full weights first "
                "(policy.named_weights()), or keep the backup for adapter-only syncs"
            )
        delta = _Delta(A, B, float(parts["scaling"]))
        previous = self._merger._merged.get(module)
        base = weight if previous is None else previous.unapply(weight)
        dense = delta.dense()
        merged = (base + dense).to(weight.dtype)
        # What the next un-apply would give back, checked now while the base is at hand.
        is_lost = (merged - dense).to(weight.dtype) != base
        index = is_lost.view(-1).nonzero().squeeze(1)
        if index.numel():
            is_small = base.numel() < 2**31
            delta.kept_index = index.to(torch.int32) if is_small else index
            delta.kept_values = base.reshape(-1)[index].clone()
        weight.copy_(merged)
        self._merger._merged[module] = delta
