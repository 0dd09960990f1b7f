"""The parallel controller for RL post-training: every data-parallel rank runs the same loop.

Its code lives in families, each a folder that imports only the ones below it (never this
package): runtime (process groups, metrics, logs), config (YAML, overrides, --help, config
dataclasses from dicts) and cost (the cost model) at the bottom, then vision, data (sources,
loader, batches), rl (advantages, losses, sampling, rollout samples) and policy (the protocol, the train step, the torch and megatron backends).
Users import from here (and `yatt.core.megatron`); the modules under the families are private.
"""

from yatt.core._version import __version__
from yatt.core.config._cli import (
    ConfigParser,
    exit_on_config_error,
    read_raw_config,
    with_override,
)
from yatt.core.config._describe import describe_config
from yatt.core.config._from_dict import coerce_value, config_from_dict
from yatt.core.config._yaml import load_yaml, read_yaml_file
from yatt.core.cost._activation_memory import choose_max_tokens, estimate_activation_bytes
from yatt.core.data._batch import Batch
from yatt.core.data._draw import draw_prompts
from yatt.core.data._loader import ROW_INDEX_KEY, ShardedLoader
from yatt.core.data._mini_batches import split_mini_batches
from yatt.core.data._model_paths import resolve_model_dir
from yatt.core.data._prompts import (
    Prompt,
    PromptEncoder,
    PromptError,
    RowPrompt,
    check_takes_images,
    prompt_ids,
    prompt_text,
    prompt_token_counter,
)
from yatt.core.data._row_fields import get_field, has_field
from yatt.core.megatron import MegatronPolicy, MegatronPolicyConfig
from yatt.core.policy._backends import broadcast_to_tp_peers, build_policy, policy_config_from_dict
from yatt.core.policy._export import (
    EXPORT_MARKER,
    check_export_dir,
    export_hf,
    export_hf_from_checkpoint,
    export_lora_adapter,
)
from yatt.core.policy._head_logprobs import logprobs_in_head, supports_head_logprobs
from yatt.core.policy._logits import compute_entropy, compute_token_logprobs
from yatt.core.policy._lora import LoraConfig
from yatt.core.policy._optimization import LR_SCHEDULES, compute_lr
from yatt.core.policy._policy import LossFn, PolicyBackend, TorchPolicyConfig
from yatt.core.policy._torch_policy import TorchPolicy, image_patches_of
from yatt.core.policy._train_step import merge_step_metrics
from yatt.core.rl._advantages import compute_grpo_advantages, mask_groups_with_reward_variance
from yatt.core.rl._async_rollout import AsyncRollout
from yatt.core.rl._held_prompts import held_cut_groups, loaded_prompt, saved_prompt
from yatt.core.rl._in_flight import InFlightPrompt, InFlightPrompts
from yatt.core.rl._losses import (
    OBJECTIVES,
    OLD_LOGPROBS_FROM,
    PolicyLoss,
    aggregate,
    compute_kl,
    count_units,
    sum_over_units,
)
from yatt.core.rl._offpolicy_metrics import compute_staleness_metrics
from yatt.core.rl._overlong import (
    OverlongConfig,
    compute_overlong_penalty,
    compute_truncation_metrics,
    mask_truncated_responses,
)
from yatt.core.rl._partial_rollouts import (
    PartialGroup,
    PartialRollouts,
    PartialSample,
    check_partial_resumption,
)
from yatt.core.rl._rollout_correction import (
    ROLLOUT_CORRECTIONS,
    compute_mismatch_kl,
    compute_rollout_weights,
    engine_old_logprobs,
)
from yatt.core.rl._rollout_samples import ROLLOUT_TOKEN_KEYS, rollout_batch, rollout_samples
from yatt.core.rl._run_state import (
    RESUME_DROPPED_METRIC,
    Resumed,
    resume_run,
    save_stopped,
    track_run_state,
)
from yatt.core.rl._sampler import DynamicSampler, UnfilledBatchError
from yatt.core.rl._sampling import sample_dynamically
from yatt.core.rl._staleness import AdmissionControl, StalenessConfig, check_staleness
from yatt.core.rl._step_batch import StepStopped, take_step_batch
from yatt.core.rl._surrogates import (
    ClipRegions,
    compute_cispo_policy_loss,
    compute_clipped_policy_loss,
    compute_gspo_policy_loss,
    compute_gspo_token_policy_loss,
)
from yatt.core.rl._turn_versions import VersionRecordingEngine
from yatt.core.runtime._learning_guard import LearningGuard, NoLearningError
from yatt.core.runtime._metrics import reduce_metrics
from yatt.core.runtime._run_log import RunLog, check_wandb
from yatt.core.runtime._runtime import Runtime, init_runtime, set_seed
from yatt.core.runtime._threads import size_torch_threads
from yatt.core.runtime._turn_metrics import reduce_turn_metrics
from yatt.core.vision._vision_inputs import (
    VISION_INPUTS_KEY,
    VisionInputError,
    VisionInputs,
    encode_vision_prompt,
    load_image_processor,
)
from yatt.core.vision._vision_model import VisionModel

__all__ = [
    "EXPORT_MARKER",
    "LR_SCHEDULES",
    "OBJECTIVES",
    "OLD_LOGPROBS_FROM",
    "RESUME_DROPPED_METRIC",
    "ROLLOUT_CORRECTIONS",
    "ROLLOUT_TOKEN_KEYS",
    "ROW_INDEX_KEY",
    "VISION_INPUTS_KEY",
    "AdmissionControl",
    "AsyncRollout",
    "Batch",
    "ClipRegions",
    "ConfigParser",
    "DynamicSampler",
    "InFlightPrompt",
    "InFlightPrompts",
    "LearningGuard",
    "LoraConfig",
    "LossFn",
    "MegatronPolicy",
    "MegatronPolicyConfig",
    "NoLearningError",
    "OverlongConfig",
    "PartialGroup",
    "PartialRollouts",
    "PartialSample",
    "PolicyBackend",
    "PolicyLoss",
    "Prompt",
    "PromptEncoder",
    "PromptError",
    "Resumed",
    "RowPrompt",
    "RunLog",
    "Runtime",
    "ShardedLoader",
    "StalenessConfig",
    "StepStopped",
    "TorchPolicy",
    "TorchPolicyConfig",
    "UnfilledBatchError",
    "VersionRecordingEngine",
    "VisionInputError",
    "VisionInputs",
    "VisionModel",
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
    "draw_prompts",
    "encode_vision_prompt",
    "engine_old_logprobs",
    "estimate_activation_bytes",
    "exit_on_config_error",
    "export_hf",
    "export_hf_from_checkpoint",
    "export_lora_adapter",
    "get_field",
    "has_field",
    "held_cut_groups",
    "image_patches_of",
    "init_runtime",
    "load_image_processor",
    "load_yaml",
    "loaded_prompt",
    "logprobs_in_head",
    "mask_groups_with_reward_variance",
    "mask_truncated_responses",
    "merge_step_metrics",
    "policy_config_from_dict",
    "prompt_ids",
    "prompt_text",
    "prompt_token_counter",
    "read_raw_config",
    "read_yaml_file",
    "reduce_metrics",
    "reduce_turn_metrics",
    "resolve_model_dir",
    "resume_run",
    "rollout_batch",
    "rollout_samples",
    "sample_dynamically",
    "save_stopped",
    "saved_prompt",
    "set_seed",
    "size_torch_threads",
    "split_mini_batches",
    "sum_over_units",
    "supports_head_logprobs",
    "take_step_batch",
    "track_run_state",
    "with_override",
]
