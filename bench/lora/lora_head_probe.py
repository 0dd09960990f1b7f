"""An experiment, not a yatt feature: the reference trainer with LoRA plus a fully trained LM
head (what PEFT's `modules_to_save=["lm_head"]` gives), the head's weight sent with each adapter
sync. It backs the change proposed for issue 45's CPU bar (bench/results/lora_cpu.md):

    python bench/lora/lora_cpu_gain.py --trainer bench/lora/lora_head_probe.py \\
        --md /tmp/lora_head/lora_cpu_head.md

Arguments are the trainer's (`policy.lora.rank=8 ...`); without policy.lora it is the trainer.
It wraps two names that yatt.core's TorchPolicy imported (attach_lora, iter_adapter_weights):
after PEFT freezes the base, the LM head's weight trains again (AdamW is built after, so it holds
it), and the sync yields "lm_head.weight" whole after the adapter (the built-in engine replaces a
full weight outright). The checkpoint does not hold the head: no --resume with it.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from yatt.core.policy import _torch_policy

ROOT = Path(__file__).resolve().parents[2]
_attach_lora = _torch_policy.attach_lora
_iter_adapter_weights = _torch_policy.iter_adapter_weights


def attach_lora_and_head(model, lora):
    peft_model = _attach_lora(model, lora)
    model.get_output_embeddings().weight.requires_grad_(True)
    return peft_model


def iter_adapter_and_head(module):
    yield from _iter_adapter_weights(module)
    yield "lm_head.weight", module.get_output_embeddings().weight.detach()


if __name__ == "__main__":
    _torch_policy.attach_lora = attach_lora_and_head
    _torch_policy.iter_adapter_weights = iter_adapter_and_head
    trainer = ROOT / "examples" / "train_grpo.py"
    sys.argv = [str(trainer), *sys.argv[1:]]
    sys.path.insert(0, str(trainer.parent))
    runpy.run_path(str(trainer), run_name="__main__")
