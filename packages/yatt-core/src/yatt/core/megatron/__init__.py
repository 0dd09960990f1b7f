"""The Megatron-Core policy backend (`pip install yatt-core[megatron]`): its public path.

The backend lives in the policy family, beside the torch one (yatt.core.policy.megatron); this
package re-exports its public names, so `yatt.core.megatron` stays what users import.
"""

from yatt.core.policy.megatron import (
    FAMILIES,
    GPTLayout,
    MegatronPolicy,
    MegatronPolicyConfig,
    export_hf_weights,
    gpt_model_kwargs,
    hf_to_megatron,
    layout_from_hf_config,
    megatron_to_hf,
    padded_vocab_size,
    tp_gather,
    tp_split,
    transformer_config_kwargs,
)

__all__ = [
    "FAMILIES",
    "GPTLayout",
    "MegatronPolicy",
    "MegatronPolicyConfig",
    "export_hf_weights",
    "gpt_model_kwargs",
    "hf_to_megatron",
    "layout_from_hf_config",
    "megatron_to_hf",
    "padded_vocab_size",
    "tp_gather",
    "tp_split",
    "transformer_config_kwargs",
]
