"""vLLM worker extension: mixed into vLLM's GPU worker by `worker_extension_cls`.

It imports nothing from vLLM, so vLLM can import it by its qualified name in the worker.
`self.model_runner` and `self.device` belong to the vLLM worker it is mixed into.
"""

from __future__ import annotations

import torch


class WeightLoaderExtension:
    def yatt_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of Hugging Face-named tensors; returns how many were given.

        vLLM's `load_weights` maps HF names onto its fused layers (qkv_proj, gate_up_proj).
        Under tensor parallelism (external launcher: one worker per yatt rank) the tensors are
        the FULL ones on every rank: each layer's weight loader keeps this rank's slice.
        """
        device = self.device
        moved = [(name, tensor.to(device, non_blocking=True)) for name, tensor in named_tensors]
        self.model_runner.model.load_weights(weights=moved)
        torch.cuda.synchronize(device)
        return len(moved)
