"""`MegatronPolicyConfig`: what `MegatronPolicy` needs; validated without importing megatron."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from yatt.core._policy import DTYPES
from yatt.core.megatron._model import ATTENTIONS, Attention


@dataclass(kw_only=True, frozen=True)
class MegatronPolicyConfig:
    """A Llama/Qwen2/Qwen3 HF checkpoint trained with Megatron-Core (TP x DP, distributed Adam).

    The fields shared with TorchPolicyConfig mean the same thing there.
    """

    model_dir: str  # a local directory with config.json and *.safetensors (save_pretrained output)
    lr: float = 1e-6  # Adam learning rate (constant)
    betas: tuple[float, float] = (0.9, 0.999)  # Adam betas
    weight_decay: float = 0.0  # decoupled weight decay (Megatron skips norms and biases)
    grad_clip: float | None = 1.0  # max global grad norm; None = no clipping (norm still logged)
    max_tokens_per_microbatch: int = 8192  # token cap per forward/backward (padded b x T)
    dtype: str = "bfloat16"  # parameter/compute dtype; the optimizer keeps float32 main params
    seed: int = 0  # Megatron's model-parallel RNG seed
    temperature: float = 1.0  # the rollout's sampling temperature; logprobs use logits / it
    is_reference: bool = False  # frozen (no DDP, no optimizer): a KL reference policy
    tp_size: int = 1  # tensor-parallel size; must equal init_runtime(tp_size=...)
    sequence_parallel: bool = False  # split activations over TP ranks between TP regions
    use_distributed_optimizer: bool = True  # shard fp32 main params and Adam moments over DP
    attention: Attention = (
        "sdpa"  # "sdpa": torch flash/efficient kernels; "megatron": local unfused
    )
    vocab_divisible_by: int = 128  # pad the vocabulary to a multiple of this x tp_size
    weight_sync_bucket_bytes: int = 512 << 20  # bytes gathered per bucket in named_weights()

    def __post_init__(self) -> None:
        name = "MegatronPolicyConfig"
        model_dir = Path(self.model_dir)
        if not (model_dir / "config.json").is_file():
            state = "does not exist" if not model_dir.exists() else "has no config.json"
            raise ValueError(
                f"{name}.model_dir={self.model_dir!r} {state}; pass a local directory written by "
                "save_pretrained (config.json + safetensors)"
            )
        if not (self.lr > 0 and self.lr < float("inf")):
            raise ValueError(f"{name}.lr={self.lr!r}: must be a finite number > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"{name}.betas={self.betas!r}: need two values in [0, 1)")
        if not self.weight_decay >= 0:
            raise ValueError(f"{name}.weight_decay={self.weight_decay!r}: must be >= 0")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(
                f"{name}.grad_clip={self.grad_clip!r}: must be > 0, or None to disable"
            )
        for field in (
            "max_tokens_per_microbatch",
            "tp_size",
            "vocab_divisible_by",
            "weight_sync_bucket_bytes",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}.{field}={value!r}: must be an int >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype={self.dtype!r}: use one of {sorted(DTYPES)}")
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"{name}.temperature={self.temperature!r}: must be >= 0 (0 = greedy)")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"{name}.attention={self.attention!r}: use one of {ATTENTIONS}")
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError(f"{name}.sequence_parallel=True needs tp_size > 1")
