"""`TorchPolicy`: a Hugging Face causal LM under DDP or FSDP2, as a policy backend.

One train_step, on every data-parallel rank:

    units = all_reduce(loss units of this rank)            scalars only cross ranks
    bins  = pack(lengths, max_tokens) with the same count on every rank
    for bin in bins:                                       grad sync on the last one only
        logits -> logprobs(/ temperature) -> loss_fn -> (loss_sum * dp / units).backward()
        (the head computes the logprobs chunk by chunk: see _head_logprobs)
    norm = clip_grad_norm()                                global: same on every rank
    optimizer.step() unless norm or loss is not finite     then every rank skips together

Dividing each micro-batch's loss sum by the global unit count (and multiplying by the dp size,
which DDP and FSDP average away) makes the step's gradient equal to the gradient of the mean
loss over the concatenated global batch, whatever the split.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from yatt.balance import flops_cost, pack
from yatt.core._batch import Batch
from yatt.core._head_logprobs import logprobs_in_head, supports_head_logprobs
from yatt.core._logits import compute_entropy, compute_token_logprobs
from yatt.core._metrics import reduce_metrics
from yatt.core._micro_batches import split_padded
from yatt.core._policy import DTYPES, LossFn, TorchPolicyConfig
from yatt.core._runtime import Runtime
from yatt.placement import TrainerRole, is_offloaded

logger = logging.getLogger("yatt.core")


class TorchPolicy:
    """See the module docstring. Also a placement role: sleep() offloads weights and optimizer."""

    memory_tags: tuple[str, ...] = ("weights", "optimizer")

    def __init__(self, config: TorchPolicyConfig, runtime: Runtime | None = None) -> None:
        from transformers import AutoModelForCausalLM

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
        model = AutoModelForCausalLM.from_pretrained(
            config.model_dir, dtype=torch.float32, attn_implementation=config.attn_implementation
        )
        model.config.use_cache = False
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
        self._model_config = model.config
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        if config.parallel == "ddp" and not config.is_reference:
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
            self.optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=config.lr,
                betas=tuple(config.betas),
                weight_decay=config.weight_decay,
            )
        self._role = TrainerRole(model, self.optimizer)
        self.num_steps = 0
        self.num_skipped_steps = 0

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
        """The Hugging Face config of the trained model (its shape, for cost models)."""
        return self._model_config

    @property
    def max_context_tokens(self) -> int | None:
        """The model's context length (max_position_embeddings), if it declares one."""
        return getattr(self._model_config, "max_position_embeddings", None)

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP2 casts through its MixedPrecisionPolicy; the others use autocast.
        if self._compute_dtype == torch.float32 or self.config.parallel == "fsdp2":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._compute_dtype)

    # -- micro-batches -------------------------------------------------------------------------

    def _costs(self, lengths: list[int]) -> Any:
        c = self._model_config
        try:
            return flops_cost(
                lengths,
                hidden_size=c.hidden_size,
                num_layers=c.num_hidden_layers,
                ffn_hidden_size=c.intermediate_size,
                num_heads=c.num_attention_heads,
                num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                vocab_size=c.vocab_size,
                is_gated_mlp=True,
            )
        except (AttributeError, ValueError):
            return lengths

    def _plan_micro_batches(self, batch: Batch) -> list[list[int]]:
        """Bins of sample indices, the same number on every data-parallel rank.

        FSDP2 all-gathers in every forward, so a rank with fewer micro-batches would leave the
        others waiting; empty bins become zero-loss dummy micro-batches instead.
        """
        lengths = batch.lengths.tolist()
        too_long = self.max_context_tokens
        if too_long is not None and lengths and max(lengths) > too_long:
            raise ValueError(
                f"a sample has {max(lengths)} tokens, over the model's context of {too_long}; "
                "lower the rollout's max_new_tokens or the loader's max_prompt_tokens"
            )
        costs = self._costs(lengths)
        cap = self.config.max_tokens_per_microbatch
        bins = pack(costs, max_tokens=cap, lengths=lengths, allow_oversize=True)
        bins = split_padded(bins, lengths, cap)
        for _ in range(8):
            # Both reductions run on every rank every round (they are collectives).
            target = self._all_reduce_max(len(bins))
            smallest = -self._all_reduce_max(-len(bins))
            if smallest == target:
                return bins
            bins = pack(
                costs, max_tokens=cap, lengths=lengths, min_bins=target, allow_oversize=True
            )
            bins = split_padded(bins, lengths, cap)
        # Splits can overshoot the agreed count: the short ranks run zero-loss dummies.
        target = self._all_reduce_max(len(bins))
        return bins + [[] for _ in range(target - len(bins))]

    def _all_reduce_max(self, value: int) -> int:
        if self.dp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._dp_group)
        return int(t.item())  # host sync: the count decides the loop

    def _collective_device(self) -> torch.device:
        backend = dist.get_backend(self._dp_group) if dist.is_initialized() else "gloo"
        return self.device if backend == "nccl" else torch.device("cpu")

    def _micro_batch(self, batch: Batch, index: list[int]) -> tuple[Batch, bool]:
        if index:
            return batch.select(index).to(self.device, non_blocking=True), False
        return _dummy_like(batch).to(self.device), True

    def _forward(
        self, mb: Batch, *, needs_entropy: bool, model: torch.nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        temperature = self.config.temperature
        inputs = dict(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"])
        if self._is_head_logprobs:
            head = logprobs_in_head(
                self.module, mb["input_ids"], temperature=temperature, needs_entropy=needs_entropy
            )
            with self._autocast(), head:
                out_BTW = model(**inputs, use_cache=False).logits
            return out_BTW[..., 0], out_BTW[..., 1] if needs_entropy else None
        with self._autocast():
            logits_BTV = model(**inputs, use_cache=False).logits
        logprobs_BT = compute_token_logprobs(logits_BTV, mb["input_ids"], temperature=temperature)
        entropy_BT = compute_entropy(logits_BTV, temperature=temperature) if needs_entropy else None
        return logprobs_BT, entropy_BT

    # -- the protocol --------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] float32 logprobs of every input token (0 at t = 0), on the batch's device.

        Collective under FSDP2 (every rank must call it, even with an empty batch).
        """
        self._check_awake("logprobs")
        self.module.eval()
        out_BT = torch.zeros(
            batch["input_ids"].shape, dtype=torch.float32, device=batch["input_ids"].device
        )
        for index in self._plan_micro_batches(batch):
            mb, is_dummy = self._micro_batch(batch, index)
            logprobs_BT, _ = self._forward(mb, needs_entropy=False, model=self.module)
            if not is_dummy:
                width = logprobs_BT.shape[1]
                mask_BT = mb["attention_mask"].to(logprobs_BT.dtype)
                out_BT[index, :width] = (logprobs_BT * mask_BT).to(out_BT.device)
        return out_BT

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this rank's batch; see the module docstring. Collective.

        Returns globally reduced metrics: "loss" (mean over units), each loss metric averaged
        over loss tokens, "grad_norm", "lr", "num_micro_batches", "is_skipped".
        """
        if self.optimizer is None:
            raise RuntimeError("train_step on a reference policy (is_reference=True)")
        self._check_awake("train_step")
        self.module.train()
        model = self._ddp if self._ddp is not None else self.module
        needs_entropy = bool(getattr(loss_fn, "needs_entropy", False))
        local_units = float(loss_fn.count_units(batch))
        local_tokens = float(batch["loss_mask"].sum()) if "loss_mask" in batch else 0.0
        totals = reduce_metrics(
            {"units": local_units, "tokens": local_tokens}, group=self._dp_group, default_op="sum"
        )
        if totals["units"] == 0:
            # Legit in DAPO: every group solved (zero reward variance) was dropped on every rank.
            logger.warning("train_step: the global batch has no response tokens; step skipped")
            self.num_skipped_steps += 1
            lr = float(self.optimizer.param_groups[0]["lr"])
            return {"loss": 0.0, "grad_norm": 0.0, "lr": lr, "num_micro_batches": 0.0} | {
                "num_loss_tokens": 0.0,
                "is_skipped": 1.0,
            }
        scale = self.dp_size / totals["units"]
        bins = self._plan_micro_batches(batch)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        metric_sums: dict[str, torch.Tensor] = {}
        for i, index in enumerate(bins):
            mb, is_dummy = self._micro_batch(batch, index)
            with self._grad_sync(is_last=i == len(bins) - 1):
                logprobs_BT, entropy_BT = self._forward(
                    mb, needs_entropy=needs_entropy, model=model
                )
                mb_loss, mb_metrics = loss_fn(mb, logprobs_BT, entropy_BT)
                if is_dummy:
                    # Keeps this rank in the collectives without touching the gradient.
                    mb_loss = mb_loss * 0.0
                (mb_loss * scale).backward()
            loss_sum += mb_loss.detach().to(torch.float64)
            for key, value in mb_metrics.items():
                # Dummies add 0 but still add the key: every rank must report the same keys.
                value = value.detach().to(torch.float64) * (0.0 if is_dummy else 1.0)
                metric_sums[key] = metric_sums.get(key, 0.0) + value
        grad_norm = self._clip_grad_norm()
        local = {"loss": loss_sum, **metric_sums}
        sums = reduce_metrics(local, group=self._dp_group, default_op="sum")
        loss = sums.pop("loss") / totals["units"]
        is_finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if is_finite:
            self.optimizer.step()
        else:
            # Every rank sees the same global loss and norm, so every rank skips together.
            self.num_skipped_steps += 1
            logger.warning(
                "train_step: skipped the optimizer step (loss=%s, grad_norm=%s)", loss, grad_norm
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.num_steps += 1
        metrics = {key: value / max(totals["tokens"], 1.0) for key, value in sums.items()}
        metrics.update(
            loss=loss,
            grad_norm=grad_norm,
            lr=float(self.optimizer.param_groups[0]["lr"]),
            num_micro_batches=float(len(bins)),
            num_loss_tokens=totals["tokens"],
            is_skipped=float(not is_finite),
        )
        return metrics

    def _grad_sync(self, *, is_last: bool) -> contextlib.AbstractContextManager:
        # Gradients are reduced across ranks once, in the last micro-batch's backward.
        if self._ddp is not None and not is_last:
            return self._ddp.no_sync()
        if self.config.parallel == "fsdp2":
            self.module.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()  # FSDP2: a sharded norm; this completes the reduction
        return float(norm)  # host sync: the skip decision needs it

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) per parameter, one at a time.

        Under FSDP2 each parameter is all-gathered on its own (never the whole model at once):
        every rank must consume the iterator to the end, in step.
        """
        self._check_awake("named_weights")
        for name, param in self.module.named_parameters():
            tensor = param.detach()
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            yield name, tensor

    def state(self) -> dict[str, Any]:
        """{"model", "optimizer"} for torch.distributed.checkpoint.state_dict.get_state_dict."""
        out: dict[str, Any] = {"model": self.module}
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer
        return out

    def sleep(self) -> None:
        """Offload parameters, gradients and optimizer state to host memory (yatt.placement).

        Under DDP the gradient buckets stay on the device (DDP owns them). Under FSDP2 the
        module moves with `.to()`, which also moves FSDP2's own shard storage.
        """
        self._role.sleep()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Onload "weights" and/or "optimizer" (default both)."""
        self._role.wake_up(tags)

    def resident_bytes(self) -> int:
        return self._role.resident_bytes()

    def _check_awake(self, what: str) -> None:
        if is_offloaded(self.module):
            raise RuntimeError(
                f"TorchPolicy.{what}: the weights are offloaded; call wake_up() first"
            )
        if what == "train_step" and self.optimizer is not None and is_offloaded(self.optimizer):
            raise RuntimeError(
                "TorchPolicy.train_step: the optimizer is offloaded; call wake_up() first"
            )


def _dummy_like(batch: Batch) -> Batch:
    """One sample of one token, zeros everywhere (so zero loss mask), shaped like `batch`."""
    tokens = {k: v.new_zeros((1, 1, *v.shape[2:])) for k, v in batch.tokens.items()}
    tokens["attention_mask"] = torch.ones_like(tokens["attention_mask"])
    samples = {k: v.new_zeros((1, *v.shape[1:])) for k, v in batch.samples.items()}
    meta = {k: [None] for k in batch.meta}
    return Batch(tokens=tokens, samples=samples, meta=meta)
