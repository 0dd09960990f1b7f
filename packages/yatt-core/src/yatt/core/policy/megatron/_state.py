"""Checkpoint state of a Megatron policy as `Stateful` objects for yatt.ckpt (DCP underneath).

Each rank saves its own shards under keys that carry its parallel ranks:

    model:     "tp<t>.<megatron param name>"         global layer index; replicated over DP, CP
    optimizer: "tp<t>.pp<p>.cp<c>.dp<d>.g<group>.p<index>.<field>"
                                                     field: main, exp_avg, exp_avg_sq, step

so a resume with the same sizes restores every bit (bf16 weights, fp32 main params, Adam
moments and step). The model's keys name layers by their global index, so the weights load
at another pp_size (or cp or dp size; not another tp_size): each stage asks for its own
layers, and DCP reads them from whichever stage saved them.

The optimizer's keys are positional (Megatron's flat buffers order and shard the parameters
per stage and DP rank), so its state loads only at the same layout. Its state dict leads with
a marker naming the layout it was saved at,

    "layout(tp_size=1,pp_size=2,virtual_pp_size=1,cp_size=1,dp_size=1)"  (one element)

the same key on every rank: at another layout every rank misses this run's marker before any
tensor is read (yatt.ckpt compares the stored keys with the live ones first, and names the
missing key), instead of one stage failing alone while the others wait in the load, or
positional keys of equal shapes mixing shards silently. To change pp_size (or cp or dp size)
load the model state alone, `ckpt.load({"model": policy.state()["model"]})`, and start the
optimizer afresh. Resharding the optimizer state (Megatron's dist_checkpointing does it) is
future work. The state dicts return the live tensors, so DCP loads into them in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class MegatronModelState:
    """The bare GPTModels' parameters of this rank (views into DDP's buffers, if wrapped), by
    global name: a chunk's `decoder.layers.<i>` renumbered with its layer offset."""

    def __init__(self, chunks: Sequence[Any], *, tp_rank: int) -> None:
        self.chunks = chunks  # ModelChunk: .model, .layer_offset
        self.prefix = f"tp{tp_rank}."

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        from yatt.core.policy.megatron._weights import global_layer_name

        return [
            (self.prefix + global_layer_name(name, chunk.layer_offset), p)
            for chunk in self.chunks
            for name, p in chunk.model.named_parameters()
        ]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {key: p.detach() for key, p in self._named()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        named = self._named()
        missing = [key for key, _ in named if key not in state]
        if missing:
            raise ValueError(
                f"the checkpoint's model state lacks {len(missing)} of this rank's tensors "
                f"(e.g. {missing[:2]}): it was saved at another tp_size or for another model"
            )
        for key, param in named:
            value = state[key]
            if value.data_ptr() != param.data_ptr():
                param.copy_(value)


LAYOUT_FIELDS = ("tp_size", "pp_size", "virtual_pp_size", "cp_size", "dp_size")


def layout_key(layout: dict[str, int]) -> str:
    """The marker key of a parallel layout (module docstring)."""
    return "layout(" + ",".join(f"{name}={layout[name]}" for name in LAYOUT_FIELDS) + ")"


def parse_layout_key(key: str) -> dict[str, int] | None:
    """The layout a marker key names (None for any other key)."""
    if not (key.startswith("layout(") and key.endswith(")")):
        return None
    pairs = [item.split("=", 1) for item in key[len("layout(") : -1].split(",")]
    return {name: int(value) for name, value in pairs}


class MegatronOptimizerState:
    """The local shard of a Megatron mixed-precision (or distributed) Adam optimizer.

    layout: the run's sizes (LAYOUT_FIELDS), whose marker leads the state dict; None omits it.
    """

    FIELDS = ("exp_avg", "exp_avg_sq", "step")

    def __init__(
        self,
        optimizer: Any,
        *,
        tp_rank: int,
        dp_rank: int,
        pp_rank: int = 0,
        cp_rank: int = 0,
        layout: dict[str, int] | None = None,
    ) -> None:
        self.optimizer = optimizer  # a MegatronOptimizer; .optimizer is the torch Adam inside
        self.prefix = f"tp{tp_rank}.pp{pp_rank}.cp{cp_rank}.dp{dp_rank}."
        self.layout = layout

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        torch_opt = self.optimizer.optimizer
        return [
            (f"{self.prefix}g{gi}.p{pi}.", p)
            for gi, group in enumerate(torch_opt.param_groups)
            for pi, p in enumerate(group["params"])
        ]

    def _ensure_state(self) -> None:
        # Adam creates its state on the first step; a zero state with step 0 is the same
        # optimizer, and gives save and load the same set of keys before any step.
        state = self.optimizer.optimizer.state
        for _, p in self._params():
            if not state.get(p):
                state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }

    def state_dict(self) -> dict[str, torch.Tensor]:
        self._ensure_state()
        state = self.optimizer.optimizer.state
        out: dict[str, torch.Tensor] = {}
        if self.layout is not None:  # first: the key a load at another layout misses first
            out[layout_key(self.layout)] = torch.zeros(1)
        for key, p in self._params():
            out[key + "main"] = p.detach()
            for field in self.FIELDS:
                value = state[p][field]
                out[key + field] = (
                    value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
                )
        return out

    @torch.no_grad()
    def load_state_dict(self, loaded: dict[str, Any]) -> None:
        self._ensure_state()
        state = self.optimizer.optimizer.state
        if self.layout is not None:
            check_saved_layout(loaded, self.layout)
        missing = [key + "main" for key, _ in self._params() if key + "main" not in loaded]
        if missing:
            raise ValueError(
                f"the checkpoint's optimizer state lacks this rank's {missing[:2]}: it was saved "
                "at another (tp, pp, cp, dp) layout; the optimizer state does not reshard "
                "(the model weights do, across pp, cp and dp sizes)"
            )
        for key, p in self._params():
            p.copy_(loaded[key + "main"])
            for field in self.FIELDS:
                target = state[p][field]
                if isinstance(target, torch.Tensor):
                    target.copy_(loaded[key + field])
                else:
                    state[p][field] = float(loaded[key + field])


def check_saved_layout(loaded: dict[str, Any], layout: dict[str, int]) -> None:
    """ValueError naming the sizes that differ when `loaded` (an optimizer state dict) was
    saved at another layout than `layout`; nothing when it carries no marker."""
    saved = [found for key in loaded if (found := parse_layout_key(key)) is not None]
    if not saved or saved[0] == layout:
        return
    differing = ", ".join(
        f"{name}={saved[0][name]} saved, {layout[name]} now"
        for name in LAYOUT_FIELDS
        if saved[0][name] != layout[name]
    )
    raise ValueError(
        f"the checkpoint's optimizer state was saved at another parallel layout ({differing}); "
        "the optimizer state does not reshard. Resume at the saved sizes, or load the model "
        "state alone (ckpt.load({'model': policy.state()['model']})), which loads at another "
        "pp_size, cp_size or dp_size, and start the optimizer afresh"
    )
