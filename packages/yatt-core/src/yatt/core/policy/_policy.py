"""The policy backend protocol and the config of the PyTorch backend.

A backend owns a model (and its optimizer) sharded over the data-parallel ranks. The trainer
sees only this protocol, so the Megatron-Core backend can replace `TorchPolicy` unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from yatt.core.data._batch import Batch
from yatt.core.policy._lora import LoraConfig, check_lora_targets, lora_from_value
from yatt.core.policy._optimization import LRSchedule, check_optimizer_fields

Parallel = Literal["ddp", "fsdp2", "none"]
PARALLEL_MODES: tuple[str, ...] = ("ddp", "fsdp2", "none")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@runtime_checkable
class NeedsEntropy(Protocol):
    """A loss that reads the policy's entropy: the backend computes entropy_BT only for one."""

    @property
    def needs_entropy(self) -> bool: ...


class LossFn(Protocol):
    """What `train_step` needs of a loss (`yatt.core.PolicyLoss` is one).

    `__call__` returns the loss summed over this micro-batch's units and metric sums over its
    loss tokens; `count_units` counts a batch's units. The backend divides by the global
    count of units (all micro-batches, all ranks), so the step's gradient is that of the mean
    over the whole global batch however it is split.
    """

    def count_units(self, batch: Batch) -> torch.Tensor: ...

    def __call__(
        self, batch: Batch, logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@runtime_checkable
class PolicyBackend(Protocol):
    """A trainable policy, also a placement role (sleep/wake_up)."""

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] float32 log softmax(logits / temperature) of each input token (0 at t = 0)."""
        ...

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this rank's batch (collective); globally reduced metrics."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) per parameter, for weight sync (collective)."""
        ...

    def estimate_costs(self, lengths: Sequence[int]) -> list[float]:
        """Relative compute per sample of these lengths: what to pass to
        Batch.rebalance(costs=...) and split_mini_batches(costs=...) so ranks and mini-batches
        are balanced alike (and, for packed sequences, the weights of their packing)."""
        ...

    def estimate_batch_costs(self, batch: Batch) -> list[float]:
        """Relative compute of each of this batch's samples, read from the batch itself: its
        tokens and, for a model that takes images, its images. What to pass to
        Batch.rebalance(costs=...) and split_mini_batches(costs=...), with or without images."""
        ...

    def state(self) -> dict[str, Any]:
        """{"model": module, "optimizer": optimizer} for torch.distributed.checkpoint."""
        ...

    def sleep(self) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...


@dataclass(kw_only=True, frozen=True)
class TorchPolicyConfig:
    """A Hugging Face causal LM (or a Qwen2-VL-family vision-language model) trained with AdamW
    under DDP or FSDP2."""

    model_dir: str  # a local directory with config.json and weights (save_pretrained output)
    lr: float = 1e-6  # AdamW peak learning rate (reached after warm-up; see lr_schedule)
    lr_schedule: LRSchedule = "constant"  # after warm-up: "constant", or "cosine" to min_lr_ratio
    num_warmup_steps: int = 0  # optimizer steps of linear warm-up (step t: lr * (t + 1) / n)
    num_decay_steps: int | None = None  # cosine: steps (warm-up included) to its lowest lr
    min_lr_ratio: float = 0.0  # cosine: the lowest lr, as a fraction of lr
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    weight_decay: float = 0.0  # AdamW decoupled weight decay (not on biases and norm weights)
    grad_clip: float | None = 1.0  # max global grad norm; 0 or None: no clipping (norm logged)
    # Cap per forward/backward on padded tokens (rows x longest row): what activations scale by.
    # None: chosen at the first train step from the device's free memory (CUDA; 8192 on CPU).
    max_tokens_per_microbatch: int | None = 8192
    parallel: Parallel = "ddp"  # "ddp", "fsdp2" (shard params/grads/optimizer), "none" (1 rank)
    dtype: str = "bfloat16"  # compute dtype; parameters and optimizer state stay float32
    # Recompute each decoder layer's activations in backward: a layer keeps only its input,
    # about 1/10 of the activations (a 7B model at 16k tokens: ~118 GiB -> ~11 GiB), ~1/3 more
    # compute. The one-GPU setting for large models beside their engines.
    gradient_checkpointing: bool = False
    # AdamW's state waits in pinned host memory through forward and backward and comes to the
    # device only for the optimizer step, which runs fused (no parameter-sized temporaries):
    # the train phase holds activations or the state, never both. A 7B policy's 61 GB of state
    # cross twice a step (~5 s at 25 GB/s); what lets it train on one 141 GB GPU.
    should_offload_optimizer: bool = False
    # torch.compile the head's logprob chunks (inductor fuses their float32 passes over the
    # vocabulary): 0.76x the eager train step on the fixed mix, 0.78x on the long tail (0.5B
    # shape, one H200, bench/results/train_step_profile_nvidia_h200.md), the same logprobs.
    # None: on for CUDA, off on CPU (where it needs a C++ compiler and gains little).
    compile_head_logprobs: bool | None = None
    seed: int = 0  # seeds torch before loading (dropout, if the model has any)
    temperature: float = 1.0  # the rollout's sampling temperature; logprobs use logits / it
    is_reference: bool = False  # frozen (no optimizer, no grads): a KL reference policy
    attn_implementation: str = "sdpa"  # passed to from_pretrained ("eager", "flash_attention_2")
    # A vision-language model: also train its vision tower. Off by default: the reward speaks
    # about the text, a weak and noisy signal for the encoder (its features are the prompt's
    # context), and a frozen tower keeps no gradients or AdamW state.
    should_train_vision: bool = False
    # LoRA through PEFT (yatt.core.LoraConfig: rank, alpha, dropout, target_modules): only the
    # adapter trains, is checkpointed and syncs; the base stays frozen and is read from
    # model_dir (its linear weights held in `dtype`: what autocast computes with anyway), and
    # the KL reference is the base with the adapter off. None: full fine-tuning.
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        model_dir = Path(self.model_dir)
        if not (model_dir / "config.json").is_file():
            state = "does not exist" if not model_dir.exists() else "has no config.json"
            raise ValueError(
                f"TorchPolicyConfig.model_dir={self.model_dir!r} {state}; pass a local directory "
                "written by save_pretrained (config.json + weights)"
            )
        check_optimizer_fields("TorchPolicyConfig", self)
        cap = self.max_tokens_per_microbatch
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(
                f"TorchPolicyConfig.max_tokens_per_microbatch={cap!r}: must be an int >= 1, "
                "or None (chosen from the free device memory at the first train step)"
            )
        if not isinstance(self.should_offload_optimizer, bool):
            raise ValueError(
                f"TorchPolicyConfig.should_offload_optimizer={self.should_offload_optimizer!r}: "
                "must be a bool"
            )
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(
                f"TorchPolicyConfig.gradient_checkpointing={self.gradient_checkpointing!r}: "
                "must be a bool"
            )
        if self.compile_head_logprobs is not None and not isinstance(
            self.compile_head_logprobs, bool
        ):
            raise ValueError(
                f"TorchPolicyConfig.compile_head_logprobs={self.compile_head_logprobs!r}: "
                "must be a bool, or None (on for CUDA, off on CPU)"
            )
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(
                f"TorchPolicyConfig.parallel={self.parallel!r}: use one of {PARALLEL_MODES}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"TorchPolicyConfig.dtype={self.dtype!r}: use one of {sorted(DTYPES)}")
        if not isinstance(self.should_train_vision, bool):
            raise ValueError(
                f"TorchPolicyConfig.should_train_vision={self.should_train_vision!r}: must be a bool"
            )
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(
                f"TorchPolicyConfig.temperature={self.temperature!r}: must be >= 0 (0 = greedy)"
            )
        lora = lora_from_value(self.lora, "TorchPolicyConfig.lora")
        object.__setattr__(self, "lora", lora)  # a mapping (YAML) becomes its LoraConfig
        if lora is not None:
            self._check_lora(lora)

    def _check_lora(self, lora: LoraConfig) -> None:
        if self.is_reference:
            raise ValueError(
                "TorchPolicyConfig.lora with is_reference=True: a LoRA policy is its own "
                "reference (reference_logprobs: the base with the adapter off); drop the "
                "reference policy or its lora"
            )
        if self.should_train_vision:
            raise ValueError(
                "TorchPolicyConfig.lora with should_train_vision=True: under LoRA only the "
                "adapter trains; set should_train_vision=False (or target the vision tower's "
                "layers in lora.target_modules)"
            )
        check_lora_targets(lora, self.model_dir, "TorchPolicyConfig.lora.target_modules")
