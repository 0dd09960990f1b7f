"""The Megatron-Core policy backend (`pip install yatt-core[megatron]`): its public path.

The backend lives in the policy family, beside the torch one (yatt.core.policy.megatron); this
package is its public path: `yatt.core.megatron` stays what users import.
"""

from yatt.core.policy.megatron._config import (
    FAMILIES,
    GPTLayout,
    gpt_model_kwargs,
    layout_from_hf_config,
    padded_vocab_size,
    transformer_config_kwargs,
)
from yatt.core.policy.megatron._policy import MegatronPolicy
from yatt.core.policy.megatron._policy_config import MegatronPolicyConfig
from yatt.core.policy.megatron._weights import (
    export_hf_weights,
    hf_to_megatron,
    megatron_to_hf,
    tp_gather,
    tp_split,
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
