"""Checkpoint state of a Megatron policy as `Stateful` objects for yatt.ckpt (DCP underneath).

Each rank saves its own shards under keys that carry its tensor- and data-parallel rank:

    model:     "tp<t>.<megatron param name>"               replicated over DP: written once
    optimizer: "tp<t>.dp<d>.g<group>.p<index>.<field>"     field: main, exp_avg, exp_avg_sq, step

so a resume with the same tp and dp sizes restores every bit (bf16 weights, fp32 main params,
Adam moments and step). Loading into another layout fails on missing keys instead of silently
mixing shards; resharding (Megatron's dist_checkpointing does it) is future work.
The state dicts return the live tensors, so DCP loads into them in place.
"""

from __future__ import annotations

from typing import Any

import torch


class MegatronModelState:
    """The bare GPTModel's parameters of this TP rank (views into DDP's buffers, if wrapped)."""

    def __init__(self, model: torch.nn.Module, *, tp_rank: int) -> None:
        self.model = model
        self.prefix = f"tp{tp_rank}."

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {self.prefix + name: p.detach() for name, p in self.model.named_parameters()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, param in self.model.named_parameters():
            value = state[self.prefix + name]
            if value.data_ptr() != param.data_ptr():
                param.copy_(value)


class MegatronOptimizerState:
    """The local shard of a Megatron mixed-precision (or distributed) Adam optimizer."""

    FIELDS = ("exp_avg", "exp_avg_sq", "step")

    def __init__(self, optimizer: Any, *, tp_rank: int, dp_rank: int) -> None:
        self.optimizer = optimizer  # a MegatronOptimizer; .optimizer is the torch Adam inside
        self.prefix = f"tp{tp_rank}.dp{dp_rank}."

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
        for key, p in self._params():
            p.copy_(loaded[key + "main"])
            for field in self.FIELDS:
                target = state[p][field]
                if isinstance(target, torch.Tensor):
                    target.copy_(loaded[key + field])
                else:
                    state[p][field] = float(loaded[key + field])
