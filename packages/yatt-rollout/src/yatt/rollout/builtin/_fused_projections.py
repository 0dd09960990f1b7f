"""Projections that read the same input run as one GEMM: q/k/v, and gate/up, of each layer.

Why: at decode a small model is bound by kernel count, not by bytes. Qwen2.5-0.5B at batch 256
spent 1.1 ms of a 2.6 ms step in 169 GEMMs, most of them far from their roofline (k_proj and
v_proj write 128 columns each); one [q|k|v] GEMM and one [gate|up] GEMM per layer launch 3 GEMMs
fewer per layer and read the layer's input once. On an H200: GEMM time 0.83 ms, decode 1.07x
faster at batch 256 and 1.13x at 64 (bench/results/rollout_nvidia_h200.md).

How, without rewriting the model's forward: each projection becomes a `GroupedLinear` whose
parameters are views into its group's fused weight (the state-dict names and shapes are
unchanged, so `update_weights` copies into the fused storage as it did into the separate ones).
The first member called with an input computes the whole group's output and the others take
their slice of it, so Hugging Face's attention and MLP code runs as it is, eager or compiled.
A member called with another input, or twice, computes the group anew: never a wrong slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Sibling projections of one module that read the same input, in their fused order.
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class ProjectionGroup:
    """The fused weight (and bias) of a group's projections, and its last output until every
    member has taken its slice (then dropped: a prefill's output is large)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        self.weight = weight
        self.bias = bias
        self.sizes = sizes
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._unread: set[int] = set()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Member `index`'s projection of x: its slice of the group's output for x, computed
        now unless this input's output is pending and the member has not taken its slice."""
        if not (self._input is x and index in self._unread):
            # A new input (or an odd call pattern, or a forward that raised half way): the
            # group's output for x replaces whatever was pending. Always the right values.
            out = F.linear(x, self.weight, self.bias)
            self._outputs = tuple(out.split(self.sizes, dim=-1))
            self._input = x
            self._unread = set(range(len(self.sizes)))
        part = self._outputs[index]
        self._unread.discard(index)
        if not self._unread:
            self._input, self._outputs = None, ()
        return part


class GroupedLinear(torch.nn.Linear):
    """A projection of a ProjectionGroup: same parameters (views into the fused weight), same
    name in the state dict; its forward takes its slice of the group's output."""

    def __init__(self, linear: torch.nn.Linear, group: ProjectionGroup, index: int) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The same Parameter objects: whoever holds them (a weight sync, a placement region's
        # bookkeeping) still holds the served weights.
        self.weight = linear.weight
        self.bias = linear.bias
        self.group = group
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)


def _fusable(linears: list[object]) -> bool:
    if not all(type(m) is torch.nn.Linear for m in linears):  # not a subclass (quantized, LoRA)
        return False
    first = linears[0]
    return all(
        m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in linears
    )


@torch.no_grad()
def fuse_projections(model: torch.nn.Module) -> int:
    """Group every module's q/k/v and gate/up projections (plain `nn.Linear`s of one input
    size, dtype and device); returns the number of groups made.

    The fused weights are allocated where this runs (call it inside the weights' placement
    region) and the members' storage is released. Call it once the weights are where they stay:
    moving a parameter afterwards (`model.to(...)`) would give it storage of its own that the
    group's GEMM no longer reads.
    """
    count = 0
    for module in list(model.modules()):
        for names in PROJECTION_GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if not _fusable(linears):
                continue
            sizes = [m.out_features for m in linears]
            weight = torch.cat([m.weight for m in linears])
            bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
            group = ProjectionGroup(weight, bias, sizes)
            start = 0
            for index, (name, linear) in enumerate(zip(names, linears, strict=True)):
                stop = start + sizes[index]
                linear.weight.data = weight[start:stop]
                if bias is not None:
                    linear.bias.data = bias[start:stop]
                setattr(module, name, GroupedLinear(linear, group, index))
                start = stop
            count += 1
    return count
