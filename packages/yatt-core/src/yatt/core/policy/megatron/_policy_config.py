"""`MegatronPolicyConfig`: what `MegatronPolicy` needs; validated without importing megatron."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yatt.core.policy._optimization import LRSchedule, check_optimizer_fields
from yatt.core.policy._policy import DTYPES
from yatt.core.policy.megatron._config import RecomputeGranularity, RecomputeMethod
from yatt.core.policy.megatron._model import ATTENTIONS, Attention


@dataclass(kw_only=True, frozen=True)
class MegatronPolicyConfig:
    """A Llama/Qwen2/Qwen3 HF checkpoint trained with Megatron-Core (TP x PP x CP x DP,
    distributed Adam).

    The fields shared with TorchPolicyConfig mean the same thing there. The ranks of one
    model replica (tp_size x pp_size x cp_size, `model_parallel_size`) share a batch: build the
    runtime with init_runtime(tp_size=config.model_parallel_size).
    """

    model_dir: str  # a local directory with config.json and *.safetensors (save_pretrained output)
    lr: float = 1e-6  # Adam peak learning rate (reached after warm-up; see lr_schedule)
    lr_schedule: LRSchedule = "constant"  # after warm-up: "constant", or "cosine" to min_lr_ratio
    num_warmup_steps: int = 0  # optimizer steps of linear warm-up (step t: lr * (t + 1) / n)
    num_decay_steps: int | None = None  # cosine: steps (warm-up included) to its lowest lr
    min_lr_ratio: float = 0.0  # cosine: the lowest lr, as a fraction of lr
    betas: tuple[float, float] = (0.9, 0.999)  # Adam betas
    weight_decay: float = 0.0  # decoupled weight decay (not on biases and norm weights)
    grad_clip: float | None = 1.0  # max global grad norm; 0 or None: no clipping (norm logged)
    # Token cap per forward/backward and rank: padded b x T / cp_size (packed: real tokens).
    max_tokens_per_microbatch: int = 8192
    dtype: str = "bfloat16"  # parameter/compute dtype; the optimizer keeps float32 main params
    seed: int = 0  # Megatron's model-parallel RNG seed
    temperature: float = 1.0  # the rollout's sampling temperature; logprobs use logits / it
    is_reference: bool = False  # frozen (no DDP, no optimizer): a KL reference policy
    tp_size: int = 1  # tensor-parallel size (heads, groups and the MLP split over it)
    pp_size: int = 1  # pipeline stages (layers split over them; Megatron's 1F1B schedule)
    virtual_pp_size: int | None = None  # model chunks per stage: the interleaved schedule
    cp_size: int = 1  # context-parallel size (each sequence split over it, 2 x cp chunks)
    sequence_parallel: bool = False  # split activations over TP ranks between TP regions
    # Train and score each micro-batch's rows end to end (THD, no padding computed); the cap
    # max_tokens_per_microbatch then bounds real tokens. Needs attention="sdpa".
    pack_sequences: bool = False
    use_distributed_optimizer: bool = True  # shard fp32 main params and Adam moments over DP
    attention: Attention = (
        "sdpa"  # "sdpa": torch flash/efficient kernels; "megatron": local unfused
    )
    vocab_divisible_by: int = 128  # pad the vocabulary to a multiple of this x tp_size
    # Activation recompute (Megatron-Core's TransformerConfig options), None = off: "full"
    # keeps only each checkpointed unit's input and reruns its layers in the backward;
    # "selective" reruns recompute_modules (None: ["core_attn"]) of every layer.
    recompute_granularity: RecomputeGranularity | None = None
    recompute_method: RecomputeMethod | None = None  # full: "uniform" (default) or "block"
    # full: layers per uniform unit (default 1), or block's layers recomputed per model chunk
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None  # selective: "core_attn" and/or "mlp"
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
        check_optimizer_fields(name, self)
        for field in (
            "max_tokens_per_microbatch",
            "tp_size",
            "pp_size",
            "cp_size",
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
        if self.cp_size > 1 and self.sequence_parallel:
            raise ValueError(
                f"{name}.cp_size={self.cp_size} with sequence_parallel=True is not supported "
                "(context parallelism computes logprobs in the output layer, which sequence "
                "parallelism does not yet); set one of them off"
            )
        if self.cp_size > 1 and self.attention != "sdpa":
            raise ValueError(
                f"{name}.cp_size={self.cp_size} with attention={self.attention!r}: Megatron-Core's "
                "local attention has no context parallelism (its ring attention needs "
                "TransformerEngine); use attention='sdpa' (all-gathered keys and values)"
            )
        if self.pack_sequences:
            for field, value, allowed in (
                ("attention", self.attention, "sdpa"),
                ("sequence_parallel", self.sequence_parallel, False),
                ("cp_size", self.cp_size, 1),
                ("virtual_pp_size", self.virtual_pp_size, None),
            ):
                if value != allowed:
                    raise ValueError(
                        f"{name}.pack_sequences=True with {field}={value!r}: packed sequences "
                        f"need {field}={allowed!r} here (set pack_sequences=False otherwise)"
                    )
        if isinstance(self.recompute_modules, list):  # a YAML list
            object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        self._check_model_split(model_dir)

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica (tp x pp x cp): they share one batch."""
        return self.tp_size * self.pp_size * self.cp_size

    @property
    def recompute_options(self) -> dict[str, Any] | None:
        """The recompute fields as `build_gpt_chunks(recompute=...)` takes them; None: off."""
        options = {
            "granularity": self.recompute_granularity,
            "method": self.recompute_method,
            "num_layers": self.recompute_num_layers,
            "modules": self.recompute_modules,
        }
        return None if all(v is None for v in options.values()) else options

    def _check_model_split(self, model_dir: Path) -> None:
        """The parallel sizes and recompute options against the model's shape, before any
        weight is read."""
        sizes = (self.tp_size, self.pp_size, self.cp_size, self.virtual_pp_size)
        if sizes == (1, 1, 1, None) and self.recompute_options is None:
            return  # nothing to split or recompute
        from transformers import AutoConfig

        from yatt.core.policy.megatron._config import (
            check_parallel_sizes,
            layout_from_hf_config,
            recompute_kwargs,
        )

        layout = layout_from_hf_config(AutoConfig.from_pretrained(model_dir))
        prefix = "MegatronPolicyConfig."
        check_parallel_sizes(
            layout,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            virtual_pp_size=self.virtual_pp_size,
            cp_size=self.cp_size,
            prefix=prefix,
        )
        recompute_kwargs(
            layout,
            pp_size=self.pp_size,
            virtual_pp_size=self.virtual_pp_size,
            prefix=prefix,
            **(self.recompute_options or {}),
        )
