"""An experiment, not a yatt feature: the reference trainer with LoRA plus a fully trained LM
head (what PEFT's `modules_to_save=["lm_head"]` gives), the head's weight sent with each adapter
sync. It backs the change proposed for issue 45's CPU bar (bench/results/lora_cpu.md):

    python bench/lora/lora_cpu_gain.py --trainer bench/lora/lora_head_probe.py \\
        --md /tmp/lora_head/lora_cpu_head.md --lora policy.lora.rank=8 policy.lora.alpha=8

Arguments are the trainer's; without policy.lora it is the trainer unchanged. Two methods of
yatt.core.TorchPolicy are wrapped: after __init__ (PEFT froze the base, AdamW was built over the
adapter) the LM head's weight trains again, in its own AdamW group; named_adapter_weights()
yields the head's weight whole after the adapter (the built-in engine replaces a full weight
outright). One process only (a DDP wrapper built before would not reduce the head's gradient);
the checkpoint does not hold the head, so no --resume.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from yatt import core

ROOT = Path(__file__).resolve().parents[2]
_init = core.TorchPolicy.__init__
_named_adapter_weights = core.TorchPolicy.named_adapter_weights


def _head(policy) -> tuple[str, object]:
    head = policy.module.get_output_embeddings()
    name = next(n for n, m in policy.module.named_modules() if m is head)
    return name, head


def init_with_head(self, config, *args, **kwargs):
    _init(self, config, *args, **kwargs)
    if config.lora is not None and self.optimizer is not None:
        _, head = _head(self)
        head.weight.requires_grad_(True)
        self.optimizer.add_param_group({"params": [head.weight], "weight_decay": 0.0})


def adapter_and_head(self):
    yield from _named_adapter_weights(self)
    name, head = _head(self)
    yield f"{name}.weight", head.weight.detach()


if __name__ == "__main__":
    core.TorchPolicy.__init__ = init_with_head
    core.TorchPolicy.named_adapter_weights = adapter_and_head
    trainer = ROOT / "examples" / "train_grpo.py"
    sys.argv = [str(trainer), *sys.argv[1:]]
    sys.path.insert(0, str(trainer.parent))
    runpy.run_path(str(trainer), run_name="__main__")
