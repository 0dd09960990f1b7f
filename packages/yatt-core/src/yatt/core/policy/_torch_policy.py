"""`TorchPolicy`: a Hugging Face causal LM under DDP or FSDP2, as a policy backend.

The train step and the logprobs pass are yatt.core.policy._train_step's, shared with MegatronPolicy;
this module gives them their hooks:

    plan_micro_batches     cut by padded length over all the rank's rows (same count on
                           every DP rank, one all-reduce: FSDP2 all-gathers in every forward)
    forward_micro_batch    logits -> logprobs(/ temperature), in the head chunk by chunk
                           (see _head_logprobs); through DDP when training
    grad_sync              DDP no_sync / FSDP2 requires_gradient_sync: reduce in the last only
    reduce_and_clip_grads  clip_grad_norm_ (global under DDP and FSDP2)
    step_optimizer         AdamW at the step's learning rate

A vision-language model (Qwen2-VL family, see _vision_forward) trains the same way: each sample
carries its images as meta[VISION_INPUTS_KEY] (yatt.core.VisionInputs, None without images),
its patches count toward micro-batch memory and estimate_costs, and the forward concatenates
the micro-batch's images in sample order. Its vision tower is frozen unless
TorchPolicyConfig.should_train_vision.

With TorchPolicyConfig.lora (yatt.core.policy._lora) PEFT's LoRA layers go into the model in
place before DDP or FSDP2 wrap it: AdamW holds the adapter only, state() saves the adapter,
named_adapter_weights() syncs it, reference_logprobs() is the base with the adapter off.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from yatt.core.cost._cost_model import (
    estimate_flops_costs,
    flops_shape_from_hf_config,
    has_gated_mlp,
    warn_without_shape,
)
from yatt.core.cost._policy_memory import (
    DEFAULT_MAX_TOKENS,
    choose_policy_max_tokens,
    describe_memory_settings,
    estimate_activation_peak_bytes,
    estimate_autocast_copy_bytes,
    with_optimizer_on_host,
)
from yatt.core.data._batch import Batch
from yatt.core.data._micro_batches import check_context, plan_micro_batches
from yatt.core.policy._attention import training_attention
from yatt.core.policy._head_logprobs import (
    compiled_chunk_logprobs,
    logprobs_in_head,
    supports_head_logprobs,
)
from yatt.core.policy._logits import compute_entropy, compute_token_logprobs
from yatt.core.policy._lora import (
    AdapterOptimizer,
    AdapterWeights,
    BaseFingerprint,
    attach_lora,
    cast_frozen_linears,
    compute_base_fingerprint,
    iter_adapter_weights,
    lora_layers,
    merge_lora_weights,
)
from yatt.core.policy._optimization import make_lr_schedule
from yatt.core.policy._policy import DTYPES, LossFn, TorchPolicyConfig
from yatt.core.policy._train_step import StepCounts, compute_logprobs, run_train_step
from yatt.core.runtime._runtime import Runtime
from yatt.core.vision._vision_cost import estimate_vision_costs, vision_flops_shape
from yatt.core.vision._vision_forward import VisionLanguage, is_vision_language_config
from yatt.core.vision._vision_inputs import VISION_INPUTS_KEY
from yatt.placement import (
    HostNeed,
    MemoryNeed,
    TrainerRole,
    empty_cache,
    is_offloaded,
    may_sync,
    offload,
    onload,
    read_cuda_free_bytes,
)

logger = logging.getLogger("yatt.core")


class TorchPolicy:
    """See the module docstring. Also a placement role: sleep() offloads weights and optimizer."""

    memory_tags: tuple[str, ...] = ("weights", "optimizer")

    def __init__(self, config: TorchPolicyConfig, runtime: Runtime | None = None) -> None:
        self.config = config
        if runtime is None and config.parallel != "none":
            raise ValueError(
                f"TorchPolicyConfig.parallel={config.parallel!r} needs a runtime "
                "(yatt.core.init_runtime()); pass parallel='none' for a plain single-process model"
            )
        self.device = (
            runtime.device
            if runtime
            else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        self._dp_group = runtime.dp_group if runtime else None
        self.dp_size = runtime.dp_size if runtime else 1
        if config.parallel == "none" and self.dp_size > 1:
            raise ValueError(
                f"TorchPolicyConfig.parallel='none' with {self.dp_size} data-parallel ranks would "
                "train diverging copies; use 'ddp' or 'fsdp2'"
            )
        self._compute_dtype = DTYPES[config.dtype]
        torch.manual_seed(config.seed)
        # Parameters and optimizer state in float32; compute runs in config.dtype.
        model = _load_model(config.model_dir, config.attn_implementation)
        model.config.use_cache = False
        # The vision side of a vision-language model (None for a text-only one).
        self._vision = VisionLanguage.of(model)
        self._vision_cost_shape = None
        if self._vision is not None:
            tower = model.model.visual
            if not config.should_train_vision:
                tower.requires_grad_(False)
            self._vision_cost_shape = vision_flops_shape(
                model.config.vision_config, is_gated_mlp=has_gated_mlp(tower)
            )
        # LoRA: PEFT injects its layers into `model` in place (module names unchanged) and
        # freezes the rest; the fingerprint is of the base as loaded, for a resume's check.
        self._peft: Any = None
        self._base_fingerprint: torch.Tensor | None = None
        if config.lora is not None:
            self._base_fingerprint = compute_base_fingerprint(config.model_dir, model)
            self._peft = attach_lora(model, config.lora)
            if self._compute_dtype != torch.float32:
                cast_frozen_linears(model, self._compute_dtype)  # same forward, half the bytes
        if config.gradient_checkpointing:
            # transformers >= 5 renamed it; the older name still works there, with a warning.
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        if config.is_reference:
            model.requires_grad_(False)
        model.to(self.device)
        self.module = model  # the Hugging Face module (FSDP2 shards it in place)
        # Logprobs from the head chunk by chunk: no [tokens, vocab] logits kept for backward.
        self._is_head_logprobs = supports_head_logprobs(model)
        self._should_compile_head = self._is_head_logprobs and (
            config.compile_head_logprobs
            if config.compile_head_logprobs is not None
            else self.device.type == "cuda"
        )
        if self._should_compile_head:
            compiled_chunk_logprobs()  # no torch.compile here: the error now, not at step 1
        elif config.compile_head_logprobs:
            logger.warning(
                "TorchPolicyConfig.compile_head_logprobs: %s computes logprobs from its full "
                "logits (not a head-logprobs model), nothing to compile",
                type(model).__name__,
            )
        self._model_config = model.config
        self._cost_shape = flops_shape_from_hf_config(
            model.config, is_gated_mlp=has_gated_mlp(model)
        )
        if self._cost_shape is None:
            warn_without_shape("TorchPolicy")
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        # One rank has nothing to all-reduce; DDP would still keep gradient buckets as large as
        # the gradients on the device (28 GB at 7B), asleep or not.
        if config.parallel == "ddp" and not config.is_reference and self.dp_size > 1:
            self._ddp = torch.nn.parallel.DistributedDataParallel(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                process_group=self._dp_group,
            )
        elif config.parallel == "fsdp2":
            assert runtime is not None
            self._shard(model, runtime)
        self.optimizer: torch.optim.Optimizer | None = None
        if not config.is_reference:
            # Fused (CUDA): the step makes no parameter-sized temporaries, which a 7B policy
            # with its state brought in for the step has no room for.
            is_fused = config.should_offload_optimizer and self.device.type == "cuda"
            self.optimizer = torch.optim.AdamW(
                _weight_decay_groups(model, config.weight_decay),
                lr=config.lr,
                betas=tuple(config.betas),
                **({"fused": True} if is_fused else {}),
            )
        self._max_tokens = config.max_tokens_per_microbatch  # None: chosen at the first step
        # Counted now: an offloaded parameter is an empty placeholder. Autocast keeps a cast
        # copy of every float32 weight a matmul reads, frozen or not (a LoRA base's linear
        # weights are held in the compute dtype: none for them).
        self._num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._num_cast = (
            self._num_trainable
            if config.lora is None
            else sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)
        )
        self._role = TrainerRole(
            model,
            self.optimizer,
            activation_bytes=self._activation_peak_bytes,
            settings=self._memory_settings(),
        )
        self._counts = StepCounts()  # also the lr schedule's position: in state()
        self._lr_at = make_lr_schedule(config)

    def _shard(self, model: torch.nn.Module, runtime: Runtime) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = None
        if self._compute_dtype != torch.float32:
            mp = MixedPrecisionPolicy(param_dtype=self._compute_dtype, reduce_dtype=torch.float32)
        kwargs: dict[str, Any] = {"mesh": runtime.dp_mesh}
        if mp is not None:
            kwargs["mp_policy"] = mp
        # One FSDP unit per decoder layer (the classes HF marks as not to be split), then the
        # root for embeddings and head: all-gathers overlap with the previous layer's compute.
        layer_names = set(getattr(model, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in layer_names]
        if not layers:
            logger.warning(
                "fsdp2: no decoder layers found (_no_split_modules); sharding the root only"
            )
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)

    # -- properties ----------------------------------------------------------------------------

    @property
    def model_config(self) -> Any:
        """The Hugging Face config of the trained model (for costs, use estimate_costs)."""
        return self._model_config

    def estimate_costs(
        self, lengths: Sequence[int], *, image_patches: Sequence[Sequence[int]] | None = None
    ) -> list[float]:
        """Relative compute of each sample of these lengths (forward FLOPs of this model's
        shape: yatt.balance.flops_cost). Pass it to `Batch.rebalance(costs=...)` so that
        balancing across ranks weighs samples alike (micro-batches are cut by padded length).

        image_patches: a vision-language model's samples, the patch count of each of sample
        i's images (`image_patches_of(batch)`); adds the vision tower's FLOPs over them (the
        image tokens are in the lengths already)."""
        costs = estimate_flops_costs(lengths, self._cost_shape)
        if image_patches is None or self._vision is None:
            return costs
        if len(image_patches) != len(costs):
            raise ValueError(
                f"image_patches has {len(image_patches)} entries for {len(costs)} lengths"
            )
        vision = estimate_vision_costs(image_patches, self._vision_cost_shape)
        return [text + image for text, image in zip(costs, vision, strict=True)]

    def estimate_batch_costs(self, batch: Batch) -> list[float]:
        """`estimate_costs` of this batch's samples, their images included for a
        vision-language model (read from meta[VISION_INPUTS_KEY]), so `Batch.rebalance(costs=...)` and `split_mini_batches(costs=...)` weigh
        alike without the caller knowing whether the model takes images."""
        lengths = batch.lengths.tolist()
        if self._vision is None:
            return self.estimate_costs(lengths)
        return self.estimate_costs(lengths, image_patches=image_patches_of(batch))

    @property
    def is_vision_language(self) -> bool:
        """Whether the model takes images (samples' meta[VISION_INPUTS_KEY])."""
        return self._vision is not None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens a response must end before (a vision-language model's image and vision
        tokens; none for a text model), from the model's own config (yatt.core.VisionModel)."""
        return () if self._vision is None else self._vision.stop_token_ids

    @property
    def max_context_tokens(self) -> int | None:
        """The model's context length (max_position_embeddings), if it declares one."""
        return getattr(self._model_config, "max_position_embeddings", None)

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP2 casts through its MixedPrecisionPolicy; the others use autocast.
        if self._compute_dtype == torch.float32 or self.config.parallel == "fsdp2":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._compute_dtype)

    # -- the train-step skeleton's hooks (yatt.core.policy._train_step.StepBackend) -----------

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._dp_group

    def plan_micro_batches(self, batch: Batch) -> list[list[int]]:
        """Bins of sample indices, the same number on every data-parallel rank (collective).

        FSDP2 all-gathers in every forward, so a rank with fewer micro-batches would leave the
        others waiting; empty bins become zero-loss dummy micro-batches instead.
        """
        lengths = batch.lengths.tolist()
        check_context(lengths, self.max_context_tokens)
        extra_tokens = None if self._vision is None else [sum(p) for p in image_patches_of(batch)]
        return plan_micro_batches(
            lengths,
            max_tokens=self.max_tokens_per_microbatch,
            count_group=self._dp_group if self.dp_size > 1 else None,
            device=self.device,
            extra_tokens=extra_tokens,
        )

    def forward_micro_batch(
        self, mb: Batch, *, needs_entropy: bool, is_training: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Training runs through the DDP wrapper (its backward reduces gradients).
        model = self._ddp if is_training and self._ddp is not None else self.module
        temperature = self.config.temperature
        # Rows are right-padded (Batch), so under causal attention no real token attends to
        # padding: without a padding mask SDPA runs its causal flash kernel, where a mask
        # forces the memory-efficient one (1.19 vs 0.84 s a long-tail step of the 0.5B shape
        # on an H200, bench/results/train_step_profile_nvidia_h200.md). Padding positions'
        # outputs are never read (losses and logprobs are masked). A vision-language model
        # derives its rope positions from the mask: it keeps it.
        mask = mb["attention_mask"] if self._vision is not None else None
        inputs = dict(input_ids=mb["input_ids"], attention_mask=mask)
        images = self._images_of(mb)
        if self._is_head_logprobs:
            head = logprobs_in_head(
                self.module,
                mb["input_ids"],
                temperature=temperature,
                needs_entropy=needs_entropy,
                should_compile=self._should_compile_head,
            )
            with self._autocast(), head, images:
                out_BTW = model(**inputs, use_cache=False).logits
            return out_BTW[..., 0], out_BTW[..., 1] if needs_entropy else None
        with self._autocast(), images:
            logits_BTV = model(**inputs, use_cache=False).logits
        logprobs_BT = compute_token_logprobs(logits_BTV, mb["input_ids"], temperature=temperature)
        entropy_BT = compute_entropy(logits_BTV, temperature=temperature) if needs_entropy else None
        return logprobs_BT, entropy_BT

    def _images_of(self, mb: Batch) -> contextlib.AbstractContextManager:
        """A vision-language model's forward with the micro-batch's images (none: a text-only
        model). Images move to the device here, per micro-batch."""
        if self._vision is None:
            return contextlib.nullcontext()
        samples = mb[VISION_INPUTS_KEY] if VISION_INPUTS_KEY in mb else [None] * len(mb)
        pixels, grid = self._vision.concat(samples)
        if pixels is not None:
            assert grid is not None
            pixels = pixels.to(self.device, non_blocking=True)
            grid = grid.to(self.device, non_blocking=True)
        return self._vision.forward_with_images(self.module, pixels, grid)

    def check_images(self, batch: Batch) -> None:
        """Raise ValueError naming the first sample whose images do not fit its tokens or this
        model (images for a text-only model, more images than image tokens, wrong shapes)."""
        if VISION_INPUTS_KEY not in batch:
            return
        samples = batch[VISION_INPUTS_KEY]
        if self._vision is None:
            first = next((i for i, v in enumerate(samples) if v is not None), None)
            if first is not None:
                raise ValueError(
                    f"sample {first} carries images (meta[{VISION_INPUTS_KEY!r}]) but "
                    f"{type(self.module).__name__} is a text-only model; drop the images or "
                    "train a vision-language model"
                )
            return
        ids, lengths = batch["input_ids"], batch.lengths.tolist()
        for i, vision in enumerate(samples):
            problem = self._vision.check_sample(ids[i, : lengths[i]], vision)
            if problem is not None:
                raise ValueError(f"sample {i} ({VISION_INPUTS_KEY}): {problem}")

    def grad_sync(self, *, is_last: bool) -> contextlib.AbstractContextManager:
        # Gradients are reduced across ranks once, in the last micro-batch's backward.
        if self._ddp is not None and not is_last:
            return self._ddp.no_sync()
        if self.config.parallel == "fsdp2":
            self.module.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)  # frees the gradients until the next step

    def reduce_and_clip_grads(self, max_norm: float | None) -> tuple[float, bool]:
        # DDP and FSDP2 reduced the gradients in the last backward; this clips them.
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, math.inf if max_norm is None else max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()  # FSDP2: a sharded norm; this completes the reduction
        return float(norm), False  # host sync: the skip decision needs it

    def step_optimizer(self, lr: float) -> None:
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        is_away = self.config.should_offload_optimizer and is_offloaded(self.optimizer)
        if is_away:  # in for the step only (the activations are freed by now)
            if self.device.type == "cuda":
                # The state comes back into a private pool (yatt.placement's onload), which
                # cannot reuse the freed activations cached in torch's default pool: hand those
                # back first (at 7B, ~60 GiB of them next to 57 GiB of AdamW state).
                empty_cache()  # never inside an engine's CUDA-graph capture (placement)
            onload(self.optimizer)
        self.optimizer.step()
        if self.config.should_offload_optimizer:
            offload(self.optimizer)

    # -- the protocol --------------------------------------------------------------------------

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] float32 logprobs of every input token (0 at t = 0), on the batch's device.

        Collective under DDP and FSDP2 (every rank must call it, even with an empty batch).
        """
        self._check_awake("logprobs")
        self.check_images(batch)
        self.module.eval()
        # may_sync: the compiled head's first calls autotune (device synchronisations) while an
        # engine may be capturing in another thread (yatt.placement's capture guard).
        with may_sync(), training_attention():  # no cuDNN: it builds a graph per new shape
            return compute_logprobs(self, batch)

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this rank's batch (yatt.core.policy._train_step); collective.

        Returns globally reduced metrics: "loss" (mean over units), each loss metric averaged
        over loss tokens, "grad_norm", "lr", "num_micro_batches", "num_loss_tokens",
        "is_skipped".
        """
        if self.optimizer is None:
            raise RuntimeError("train_step on a reference policy (is_reference=True)")
        self._check_awake("train_step")
        self.check_images(batch)
        self.module.train()
        # No cuDNN (a graph per new shape), around the backward too: activation checkpointing
        # recomputes the forward there. may_sync: as in logprobs.
        with may_sync(), training_attention():
            return run_train_step(
                self,
                batch,
                loss_fn,
                counts=self._counts,
                lr_at=self._lr_at,
                max_grad_norm=self.config.grad_clip,
            )

    @property
    def num_steps(self) -> int:
        return self._counts.num_steps

    @property
    def num_skipped_steps(self) -> int:
        return self._counts.num_skipped_steps

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) per parameter, one at a time; with LoRA, the base
        with the adapter merged in (W + scaling B A, under the base's names): a full sync.

        Under FSDP2 each parameter is all-gathered on its own (never the whole model at once):
        every rank must consume the iterator to the end, in step.
        """
        self._check_awake("named_weights")
        pairs = ((name, _full_tensor(p)) for name, p in self.module.named_parameters())
        if self.config.lora is None:
            yield from pairs
        else:
            yield from merge_lora_weights(pairs, self.lora_scalings)

    @property
    def peft_config(self) -> Any:
        """PEFT's LoraConfig of the adapter, target_modules resolved (None without LoRA)."""
        return None if self._peft is None else self._peft.peft_config["default"]

    @property
    def lora_scalings(self) -> dict[str, float]:
        """Each LoRA target module's scaling (alpha / rank) by name; empty without LoRA."""
        return {name: float(layer.scaling["default"]) for name, layer in lora_layers(self.module)}

    def named_adapter_weights(self, *, live: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapter alone, for a weight sync: per target module "<name>.lora_A"
        [rank, in], "<name>.lora_B" [out, rank] and "<name>.lora_scaling" (a 0-d float32),
        where <name> is the module's Hugging Face name; an engine adds scaling B A to
        "<name>.weight" (yatt-rollout's built-in engine takes them in update_weights). Then,
        per parameter <p> of a module to save (policy.lora.modules_to_save, e.g. the LM head),
        "<p>.lora_saved": its trained value whole, which the engine serves instead of the
        base's (and puts the base's back while the adapter is off).

        Collective under FSDP2, like named_weights. ValueError without policy.lora.

        live=True: A, B and the saved parameters are the trained nn.Parameters themselves, not
        detached copies' views, for yatt-rollout's BuiltinEngine.bind_adapter (bound once, its
        refresh() re-reads them after each optimizer step). ValueError under FSDP2 (shards).
        """
        if self.config.lora is None:
            raise ValueError(
                "named_adapter_weights: TorchPolicyConfig.lora is None (full fine-tuning); "
                "sync named_weights() instead, or set policy.lora"
            )
        self._check_awake("named_adapter_weights")
        yield from iter_adapter_weights(self.module, live=live)

    def reference_logprobs(self, batch: Batch) -> torch.Tensor:
        """The KL reference's logprobs of `batch`: with LoRA, this policy's base with the
        adapter off (PEFT's disable_adapter), so no frozen second copy is kept. Like
        `logprobs` (collective). ValueError without policy.lora: build a reference policy."""
        if self._peft is None:
            raise ValueError(
                "reference_logprobs: TorchPolicyConfig.lora is None, so this policy has no "
                "base to fall back to; build a reference policy (is_reference=True)"
            )
        with self._peft.disable_adapter():
            logprobs = self.logprobs(batch)
            if hasattr(self.module, "reshard"):  # FSDP2
                # The root's parameters stay unsharded after a forward. PEFT turns a module to
                # save's requires_grad back on as the context exits: on the registered
                # parameter, which must be the sharded one FSDP2 keeps (else it stays frozen).
                self.module.reshard()
        return logprobs

    def state(self) -> dict[str, Any]:
        """{"model", "optimizer", "schedule"} for yatt.ckpt (torch.distributed.checkpoint):
        the module, AdamW, and the step counts the learning-rate schedule continues from.
        A reference policy has only "model". With LoRA: "lora_base" (the base model's
        fingerprint: a resume on another base is a ValueError naming policy.model_dir),
        "model" the adapter's tensors only and "optimizer" their AdamW state; the base is
        read from model_dir."""
        out: dict[str, Any] = {"model": self.module}
        if self.config.lora is not None:
            assert self._base_fingerprint is not None and self.optimizer is not None
            out = {
                "lora_base": BaseFingerprint(
                    self._base_fingerprint, self.config.model_dir, "policy.model_dir"
                ),
                "model": AdapterWeights(self.module),
            }
        if (
            self.optimizer is not None
            and self.config.should_offload_optimizer
            and is_offloaded(self.optimizer)
            and not is_offloaded(self.module)
        ):
            # A checkpoint reads the state on the device (offloaded, it is placeholders there);
            # the next optimizer step or sleep moves it out again.
            onload(self.optimizer)
        if self.optimizer is not None:
            is_lora = self.config.lora is not None
            out["optimizer"] = (
                AdapterOptimizer(self.module, self.optimizer) if is_lora else self.optimizer
            )
            out["schedule"] = self._counts
        return out

    def sleep(self) -> None:
        """Offload parameters, gradients and optimizer state to host memory (yatt.placement).

        Under DDP the gradient buckets stay on the device (DDP owns them). Under FSDP2 the
        module moves with `.to()`, which also moves FSDP2's own shard storage.
        """
        self._role.sleep()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Onload "weights" and/or "optimizer" (default both); with
        should_offload_optimizer the state stays on the host until the optimizer step."""
        if self.config.should_offload_optimizer:
            tags = [tag for tag in (tags or self.memory_tags) if tag != "optimizer"]
        self._role.wake_up(tags)

    def resident_bytes(self) -> int:
        return self._role.resident_bytes()

    # -- memory --------------------------------------------------------------------------------

    @property
    def max_tokens_per_microbatch(self) -> int:
        """The micro-batch token cap: the config's, or (config None) chosen from the device's
        free memory the first time it is needed (see `choose_max_tokens`), then kept."""
        if self._max_tokens is None:
            self._max_tokens = self._choose_max_tokens()
        return self._max_tokens

    def _choose_max_tokens(self) -> int:
        if self.device.type != "cuda" or self._cost_shape is None:
            return DEFAULT_MAX_TOKENS
        with torch.cuda.device(self.device):
            free = read_cuda_free_bytes()
            total = torch.cuda.mem_get_info()[1]
        # What the forward and backward hold besides activations: gradients, autocast's 16-bit
        # weight copies, and the optimizer's state the first step makes (unless it waits on
        # the host until the step, when the activations are gone).
        need = self._role.memory_need()
        assert need is not None
        to_come = need.peak.get("gradients", 0) + self._autocast_copy_bytes()
        if (
            self.optimizer is not None
            and not self.optimizer.state
            and not self.config.should_offload_optimizer
        ):
            to_come += need.resident.get("optimizer", 0)
        cap, margin = choose_policy_max_tokens(
            free,
            total,
            to_come,
            self._cost_shape,
            is_checkpointed=self.config.gradient_checkpointing,
            is_head_logprobs=self._is_head_logprobs,
        )
        logger.info(
            "TorchPolicy: max_tokens_per_microbatch=%d, chosen from %.1f GiB free "
            "(gradients and optimizer state to come: %.1f GiB, margin %.1f GiB)",
            cap,
            free / 2**30,
            to_come / 2**30,
            margin / 2**30,
        )
        return cap

    def _activation_peak_bytes(self) -> int:
        """The train step's activations at the micro-batch cap, plus autocast's copies (the
        cost family's estimate_activation_peak_bytes)."""
        return estimate_activation_peak_bytes(
            self._max_tokens,
            self._cost_shape,
            is_checkpointed=self.config.gradient_checkpointing,
            is_head_logprobs=self._is_head_logprobs,
            autocast_copy_bytes=self._autocast_copy_bytes(),
        )

    def _autocast_copy_bytes(self) -> int:
        return estimate_autocast_copy_bytes(
            self._num_cast,
            is_float32=self._compute_dtype == torch.float32,
            is_fsdp2=self.config.parallel == "fsdp2",
        )

    def _memory_settings(self) -> dict[str, str]:
        return describe_memory_settings(
            self.config.max_tokens_per_microbatch,
            is_checkpointed=self.config.gradient_checkpointing,
        )

    def memory_need(self) -> MemoryNeed | None:
        """What this policy needs on its device, for a placement plan (yatt.placement.MemoryNeed):
        weights and optimizer state resident; gradients and activations (estimated from the
        model's shape, the micro-batch cap and activation checkpointing) at the train step's
        peak. With should_offload_optimizer the state is not resident: it is part of the peak,
        in place of the activations when larger. None when the model's shape is unknown."""
        if self._cost_shape is None:
            return None
        need = self._role.memory_need()
        assert need is not None
        if not self.config.should_offload_optimizer:
            return need
        return with_optimizer_on_host(need)

    def host_need(self) -> HostNeed:
        """What this policy holds in host memory asleep, for a placement plan's host check
        (yatt.placement.HostNeed): the float32 weights and the AdamW state as offload packs them
        (pinned on CUDA; kept cached from the first sleep on). With should_offload_optimizer the
        state lives there between steps as well; the total is the same. Gradients are freed at
        the end of each train step, so they are not offloaded."""
        return self._role.host_need()

    def _check_awake(self, what: str) -> None:
        if is_offloaded(self.module):
            raise RuntimeError(
                f"TorchPolicy.{what}: the weights are offloaded; call wake_up() first"
            )
        if (
            what == "train_step"
            and self.optimizer is not None
            and is_offloaded(self.optimizer)
            and not self.config.should_offload_optimizer
        ):
            raise RuntimeError(
                "TorchPolicy.train_step: the optimizer is offloaded; call wake_up() first"
            )


def image_patches_of(batch: Batch) -> list[list[int]]:
    """Per sample, the patch count of each of its images (empty without images), from
    meta[VISION_INPUTS_KEY]: what `TorchPolicy.estimate_costs(image_patches=...)` takes."""
    if VISION_INPUTS_KEY not in batch:
        return [[] for _ in range(len(batch))]
    return [[] if v is None else v.patches_per_image() for v in batch[VISION_INPUTS_KEY]]


def _load_model(model_dir: str, attn_implementation: str) -> torch.nn.Module:
    """The Hugging Face model of `model_dir` in float32: a causal LM, or the image-text-to-text
    class of a config with a vision tower (transformers maps Qwen2-VL there only)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    hf_config = AutoConfig.from_pretrained(model_dir)
    auto = (
        AutoModelForImageTextToText
        if is_vision_language_config(hf_config)
        else AutoModelForCausalLM
    )
    return auto.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    )


def _full_tensor(param: torch.Tensor) -> torch.Tensor:
    tensor = param.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: decay on matrices, none on biases and norm weights (1-D), as
    Megatron-Core and Hugging Face's Trainer do. Frozen parameters (a frozen vision tower)
    are left out."""
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]
