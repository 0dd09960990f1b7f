"""The public names of yatt.core and its public submodules, frozen: adding, renaming or removing
one is a deliberate edit of PUBLIC_NAMES below (and of the README), never a side effect.

A module's public names are its `__all__` (else every name in dir() without a leading "_").
A new public submodule must be listed too.
"""

NUM_GPUS = 0

import pytest

from yatt.testing import check_public_modules, check_public_names

PUBLIC_NAMES: dict[str, list[str]] = {
    "yatt.core": [
        "AdmissionControl",
        "Batch",
        "ClipRegions",
        "DynamicSampler",
        "EXPORT_MARKER",
        "LR_SCHEDULES",
        "LearningGuard",
        "LoraConfig",
        "LossFn",
        "MegatronPolicy",
        "MegatronPolicyConfig",
        "NoLearningError",
        "OBJECTIVES",
        "OLD_LOGPROBS_FROM",
        "OverlongConfig",
        "PartialGroup",
        "PartialRollouts",
        "PartialSample",
        "PolicyBackend",
        "PolicyLoss",
        "Prompt",
        "PromptEncoder",
        "PromptError",
        "ROLLOUT_CORRECTIONS",
        "ROLLOUT_TOKEN_KEYS",
        "ROW_INDEX_KEY",
        "RowPrompt",
        "RunLog",
        "Runtime",
        "ShardedLoader",
        "StalenessConfig",
        "VisionModel",
        "TorchPolicy",
        "TorchPolicyConfig",
        "UnfilledBatchError",
        "VISION_INPUTS_KEY",
        "VisionInputError",
        "VisionInputs",
        "__version__",
        "aggregate",
        "broadcast_to_tp_peers",
        "build_policy",
        "check_export_dir",
        "check_partial_resumption",
        "check_staleness",
        "check_takes_images",
        "check_wandb",
        "choose_max_tokens",
        "coerce_value",
        "compute_cispo_policy_loss",
        "compute_clipped_policy_loss",
        "compute_entropy",
        "compute_grpo_advantages",
        "compute_gspo_policy_loss",
        "compute_gspo_token_policy_loss",
        "compute_kl",
        "compute_lr",
        "compute_mismatch_kl",
        "compute_overlong_penalty",
        "compute_rollout_weights",
        "compute_staleness_metrics",
        "compute_token_logprobs",
        "compute_truncation_metrics",
        "config_from_dict",
        "count_units",
        "describe_config",
        "encode_vision_prompt",
        "engine_old_logprobs",
        "estimate_activation_bytes",
        "export_hf",
        "export_hf_from_checkpoint",
        "export_lora_adapter",
        "get_field",
        "has_field",
        "image_patches_of",
        "init_runtime",
        "load_image_processor",
        "logprobs_in_head",
        "mask_groups_with_reward_variance",
        "mask_truncated_responses",
        "merge_step_metrics",
        "policy_config_from_dict",
        "prompt_ids",
        "prompt_text",
        "prompt_token_counter",
        "reduce_metrics",
        "resolve_model_dir",
        "rollout_batch",
        "rollout_samples",
        "sample_dynamically",
        "set_seed",
        "split_mini_batches",
        "sum_over_units",
        "supports_head_logprobs",
    ],
    "yatt.core.megatron": [
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
    ],
    # The family folders (issue 25) export nothing of their own: yatt.core's names are the API.
    "yatt.core.cost": [],
    "yatt.core.data": [],
    "yatt.core.policy": [],
    "yatt.core.policy.megatron": [],  # the backend's code; its names are yatt.core.megatron's
    "yatt.core.rl": [],
    "yatt.core.runtime": [],
    "yatt.core.vision": [],
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_public_names_are_frozen(module_name):
    check_public_names(module_name, PUBLIC_NAMES[module_name], __file__)


def test_every_public_submodule_is_frozen():
    check_public_modules("yatt.core", PUBLIC_NAMES, __file__)
