"""`MegatronPolicy`: a Megatron-Core GPT (tensor, pipeline, context and data parallel) behind
the policy protocol.

At pp_size = 1 the train step and the logprobs pass are yatt.core.policy._train_step's, shared with
TorchPolicy (the tp x cp ranks of one DP rank hold the same batch); this module gives them
their hooks. At pp_size > 1 Megatron's pipeline schedule runs the micro-batches (see
_schedule.py), with the same hooks around it:

    plan_micro_batches     cut by padded length over all the rows; DP ranks may differ in
                           count (no collective)
    forward_micro_batch    output layer -> vocab-parallel logprobs (see _head_logprobs)
    grad_sync              DDP no_sync: gradients wait for finalize_model_grads
    reduce_and_clip_grads  finalize_model_grads (reduce-scatter over DP), prepare_grads,
                           clip_grad_norm (global norm over DP x TP)
    step_optimizer         step_with_ready_grads, then all-gather params over DP

Megatron's DDP averages gradients over DP x CP, so `dp_size` (the skeleton's loss scale)
is dp x cp here: each CP rank's gradient holds its own tokens' share of the global loss, and
the dp x cp / global-units scale gives the gradient of the mean loss over the global batch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from yatt.balance import pack
from yatt.core.cost._cost_model import estimate_flops_costs, flops_shape
from yatt.core.data._batch import Batch
from yatt.core.data._micro_batches import check_context, plan_micro_batches
from yatt.core.policy._optimization import make_lr_schedule
from yatt.core.policy._policy import DTYPES, LossFn
from yatt.core.policy._train_step import StepCounts, compute_logprobs, run_train_step
from yatt.core.policy.megatron._config import layout_from_hf_config, padded_vocab_size
from yatt.core.policy.megatron._head_logprobs import forward_stage, supports_output_layer_logprobs
from yatt.core.policy.megatron._parallel import (
    _init_megatron_parallel,
    _require_cuda,
    _require_megatron,
)
from yatt.core.policy.megatron._policy_config import MegatronPolicyConfig
from yatt.core.policy.megatron._schedule import pipeline_logprobs, run_pipeline_train_step
from yatt.core.policy.megatron._state import MegatronModelState, MegatronOptimizerState
from yatt.core.policy.megatron._weights import export_hf_weights, export_pipeline_hf_weights
from yatt.core.runtime._metrics import reduce_metrics
from yatt.core.runtime._runtime import Runtime
from yatt.placement import empty_cache, synchronize

logger = logging.getLogger("yatt.core")


class MegatronPolicy:
    """See the module docstring. Also a placement role (memory_tags "weights", "optimizer")."""

    memory_tags: tuple[str, ...] = ("weights", "optimizer")

    def __init__(self, config: MegatronPolicyConfig, runtime: Runtime) -> None:
        _require_cuda(runtime.device)  # first: on CPU the clear error, not megatron's
        _require_megatron()
        from megatron.core import parallel_state
        from megatron.core.transformer.module import Float16Module
        from transformers import AutoConfig

        from yatt.core.policy.megatron._model import build_gpt_chunks, load_hf_weights

        self.config = config
        self.device = runtime.device
        self._hf_config = AutoConfig.from_pretrained(config.model_dir)
        self.layout = layout_from_hf_config(self._hf_config)
        self._cost_shape = flops_shape(
            hidden_size=self.layout.hidden_size,
            num_layers=self.layout.num_layers,
            ffn_hidden_size=self.layout.ffn_hidden_size,
            num_heads=self.layout.num_heads,
            num_kv_heads=self.layout.num_query_groups,
            vocab_size=self.layout.vocab_size,
            is_gated_mlp=True,  # the families the layout accepts all use SwiGLU
        )
        _init_megatron_parallel(runtime, config)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._dp_group = parallel_state.get_data_parallel_group()
        # The runtime's "tp" ranks are the model copy's tp x pp x cp ranks: they share a batch.
        self._batch_group = runtime.tp_group
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_last_rank = parallel_state.get_pipeline_model_parallel_last_rank()
        self.cp_group = parallel_state.get_context_parallel_group()
        # The skeleton's loss scale undoes DDP's gradient averaging, which is over DP x CP.
        self.dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        dtype = DTYPES[config.dtype]
        self.padded_vocab = padded_vocab_size(
            self.layout.vocab_size, tp_size=config.tp_size, divisible_by=config.vocab_divisible_by
        )
        self.chunks = build_gpt_chunks(
            self.layout,
            tp_size=config.tp_size,
            pp_size=config.pp_size,
            virtual_pp_size=config.virtual_pp_size,
            cp_size=config.cp_size,
            dtype=dtype,
            attention=config.attention,
            sequence_parallel=config.sequence_parallel,
            vocab_divisible_by=config.vocab_divisible_by,
            recompute=config.recompute_options,
        )
        for chunk in self.chunks:
            chunk.model.to(self.device)
            load_hf_weights(
                chunk.model,
                config.model_dir,
                self.layout,
                padded_vocab=self.padded_vocab,
                tp_rank=self.tp_rank,
                tp_size=config.tp_size,
                layer_offset=chunk.layer_offset,
            )
        self.is_last_stage = self.chunks[-1].model.post_process
        self._is_head_logprobs = supports_output_layer_logprobs(self.chunks[-1].model)
        self._vocab_start = self.tp_rank * (self.padded_vocab // config.tp_size)
        models: list[torch.nn.Module] = [
            Float16Module(chunk.model.config, chunk.model)
            if dtype != torch.float32
            else chunk.model
            for chunk in self.chunks
        ]
        self.optimizer: Any = None
        if config.is_reference:
            for chunk in self.chunks:
                chunk.model.requires_grad_(False)
        else:
            models, self.optimizer = self._wrap_for_training(models, self.chunks[0].model.config)
        self.models = models  # one per chunk, in the schedule's order
        # Megatron's schedule at pp > 1; the shared skeleton (TorchPolicy's loop) otherwise.
        self.uses_schedule = config.pp_size > 1
        self._counts = StepCounts()  # also the lr schedule's position: in state()
        self._lr_at = make_lr_schedule(config)
        self._asleep: set[str] = set()
        self._padding_tokens = 0  # the last plan's padding (see plan_micro_batches)

    def _wrap_for_training(self, models: list[torch.nn.Module], tf_config: Any) -> tuple[Any, Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.config.use_distributed_optimizer,
        )
        ddps = [
            DistributedDataParallel(
                config=tf_config,
                ddp_config=ddp_config,
                module=model,
                # Megatron-LM's rule: only the first chunk's buckets are not overlapped.
                disable_bucketing=i > 0,
            )
            for i, model in enumerate(models)
        ]
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=self.config.lr,
            # Unused (yatt sets each step's lr, see step_optimizer); kept consistent.
            min_lr=self.config.lr * self.config.min_lr_ratio,
            weight_decay=self.config.weight_decay,
            adam_beta1=self.config.betas[0],
            adam_beta2=self.config.betas[1],
            bf16=self.config.dtype == "bfloat16",
            fp16=self.config.dtype == "float16",
            params_dtype=DTYPES[self.config.dtype],
            use_distributed_optimizer=self.config.use_distributed_optimizer,
            # Clipping is done here (clip_grad_norm) so a non-finite norm can skip the step.
            clip_grad=0.0,
        )
        optimizer = get_megatron_optimizer(opt_config, ddps)
        return ddps, optimizer

    @property
    def _inner_optimizer(self) -> Any:
        """The one Megatron optimizer (Distributed/Float16) inside get_megatron_optimizer's chain."""
        chain = getattr(self.optimizer, "chained_optimizers", None)
        if chain is None:
            return self.optimizer
        assert len(chain) == 1, "dense GPT models get exactly one optimizer"
        return chain[0]

    @property
    def model_config(self) -> Any:
        """The Hugging Face config of the trained model (for costs, use estimate_costs)."""
        return self._hf_config

    def estimate_costs(self, lengths: Sequence[int]) -> list[float]:
        """Relative compute of each sample of these lengths on one rank (forward FLOPs of this
        model's shape: yatt.balance.flops_cost, over cp_size with context parallelism), as
        TorchPolicy estimates it for the same model at cp_size 1. Packed sequences are packed by
        it; pass it to `Batch.rebalance(costs=...)`."""
        return estimate_flops_costs(lengths, self._cost_shape, cp_size=self.config.cp_size)

    def estimate_batch_costs(self, batch: Batch) -> list[float]:
        """`estimate_costs` of this batch's samples (a GPT model: its tokens are its cost)."""
        return self.estimate_costs(batch.lengths.tolist())

    @property
    def max_context_tokens(self) -> int:
        return self.layout.max_position_embeddings

    # -- the train-step skeleton's hooks (yatt.core.policy._train_step.StepBackend) -----------

    @property
    def dp_group(self) -> Any:
        return self._dp_group

    def plan_micro_batches(self, batch: Batch) -> list[list[int]]:
        """Bins of sample indices (padded [b, T] micro-batches bounded by b x T).

        Megatron's DDP reduces gradients in finalize_model_grads, after the loop, so DP ranks
        may run different numbers of micro-batches; TP peers run the same (same batch).
        """
        lengths = batch.lengths.tolist()
        check_context(lengths, self.max_context_tokens)
        self._check_tp_batch(batch)
        # The cap bounds one rank's tokens: a CP rank holds 1/cp of every row.
        cap = self.config.max_tokens_per_microbatch * self.config.cp_size
        if self.config.pack_sequences:
            # Packed rows cost their real tokens: the cap bounds the sum of lengths.
            costs = self.estimate_costs(lengths)
            bins = pack(costs, max_tokens=cap, lengths=lengths, allow_oversize=True)
        else:
            bins = plan_micro_batches(lengths, max_tokens=cap)
        # What the padded layout of these bins would compute beyond the real tokens.
        self._padding_tokens = sum(
            len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in bins if b
        )
        return bins

    def _check_tp_batch(self, batch: Batch) -> None:
        """The tp x pp x cp ranks of a model copy must run the same micro-batches, or their
        collectives pair up wrongly and hang."""
        if self.config.model_parallel_size == 1:
            return
        local = torch.tensor([batch.num_tokens, len(batch)], dtype=torch.int64, device=self.device)
        high, low = local.clone(), -local
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self._batch_group)
        dist.all_reduce(low, op=dist.ReduceOp.MAX, group=self._batch_group)
        if not torch.equal(high, -low):  # host sync: a hang is worse
            raise ValueError(
                "the tp x pp x cp ranks of one model copy got different batches; give each of "
                "them its DP rank's batch"
            )

    def forward_micro_batch(
        self, mb: Batch, *, needs_entropy: bool, is_training: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        del is_training  # the same wrapped model either way: DDP syncs in finalize only
        (model,), (chunk,) = self.models, self.chunks  # pp = 1 here
        out_BTW = self.stage_forward(model, chunk, mb, needs_entropy=needs_entropy)
        return out_BTW[..., 0], out_BTW[..., 1] if needs_entropy else None

    def stage_forward(
        self, model: torch.nn.Module, chunk: Any, mb: Batch, *, needs_entropy: bool
    ) -> torch.Tensor:
        """One chunk's forward: hidden states, or [B, T, W] logprob (entropy) on the last stage."""
        return forward_stage(
            model,
            chunk.model if self._is_head_logprobs else None,
            mb["input_ids"],
            is_last_stage=chunk.model.post_process,
            pad_to=self.config.tp_size if self.config.sequence_parallel else 1,
            needs_entropy=needs_entropy,
            vocab_start=self._vocab_start,
            vocab_size=self.layout.vocab_size,
            temperature=self.config.temperature,
            tp_group=self._tp_group,
            lengths_B=mb["attention_mask"].sum(1) if self.config.pack_sequences else None,
            cp_group=self.cp_group if self.config.cp_size > 1 else None,
        )

    @property
    def grad_average_size(self) -> int:
        """The ranks Megatron's DDP averages gradients over (dp x cp)."""
        return self.dp_size

    def grad_sync(self, *, is_last: bool) -> contextlib.AbstractContextManager:
        # With overlap_grad_reduce off, no_sync only defers the reduce to finalize_model_grads.
        if is_last:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for model in self.models:
            stack.enter_context(model.no_sync())
        return stack

    def zero_grad(self) -> None:
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def reduce_and_clip_grads(self, max_norm: float | None) -> tuple[float, bool]:
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        # Reduce-scatter the gradients over DP x CP; with pp > 1 also the tied embedding's
        # gradient between the first and last stages.
        finalize_model_grads(self.models)
        inner = self._inner_optimizer
        found_inf = bool(inner.prepare_grads())
        # clip_grad_norm(0.0) would zero the gradients on megatron-core 0.16 (it clips
        # unconditionally), so the unclipped case only measures the norm.
        if max_norm is None:
            return float(inner.get_grad_norm()), found_inf  # host sync
        return float(inner.clip_grad_norm(max_norm)), found_inf  # host sync

    def step_optimizer(self, lr: float) -> None:
        # What Megatron's OptimizerParamScheduler.step sets, with yatt's schedule: wd_mult is 0
        # on biases and norm weights (get_megatron_optimizer's groups), 1 elsewhere.
        inner = self._inner_optimizer
        for group in inner.param_groups:
            group["lr"] = lr
            group["weight_decay"] = self.config.weight_decay * group.get("wd_mult", 1.0)
        inner.step_with_ready_grads()  # then all-gathers the updated params over DP

    # -- the protocol --------------------------------------------------------------------------

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """[B, T] float32 logprobs of every input token (0 at t = 0), on the batch's device."""
        self._check_awake("logprobs", ("weights",))
        for model in self.models:
            model.eval()
        if self.uses_schedule:
            return pipeline_logprobs(self, batch)
        return compute_logprobs(self, batch)

    def train_step(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step (yatt.core.policy._train_step); TorchPolicy's metrics. Collective."""
        if self.optimizer is None:
            raise RuntimeError("train_step on a reference policy (is_reference=True)")
        self._check_awake("train_step", self.memory_tags)
        for model in self.models:
            model.train()
        step = run_pipeline_train_step if self.uses_schedule else run_train_step
        metrics = step(
            self,
            batch,
            loss_fn,
            counts=self._counts,
            lr_at=self._lr_at,
            max_grad_norm=self.config.grad_clip,
        )
        if self.config.pack_sequences:
            # Summed over DP ranks (the TP, CP and PP peers of one DP rank share its batch).
            saved = reduce_metrics(
                {"padding": float(self._padding_tokens)}, group=self._dp_group, default_op="sum"
            )
            metrics["num_padding_tokens_saved"] = saved["padding"]
        return metrics

    @property
    def num_steps(self) -> int:
        return self._counts.num_steps

    @property
    def num_skipped_steps(self) -> int:
        return self._counts.num_skipped_steps

    def named_weights(
        self, *, bucket_bytes: int | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs of the whole model on every rank: TP shards gathered
        bucket by bucket, then each pipeline stage's tensors broadcast to the other stages.
        Collective over TP and PP."""
        self._check_awake("named_weights", ("weights",))
        size = bucket_bytes if bucket_bytes is not None else self.config.weight_sync_bucket_bytes
        group = self._tp_group if self.config.tp_size > 1 else None

        def local() -> Iterator[tuple[str, torch.Tensor]]:
            for chunk in self.chunks:
                yield from export_hf_weights(
                    chunk.model.named_parameters(),
                    self.layout,
                    bucket_bytes=size,
                    tp_group=group,
                    layer_offset=chunk.layer_offset,
                )

        if self.config.pp_size == 1:
            yield from local()
            return
        yield from export_pipeline_hf_weights(
            local(),
            self._local_hf_shapes(),
            bucket_bytes=size,
            pp_group=self.pp_group,
            device=self.device,
        )

    def _local_hf_shapes(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(HF name, full shape, dtype) of every tensor this stage exports, in no set order."""
        from yatt.core.policy.megatron._weights import (
            global_layer_name,
            megatron_shapes,
            to_hf_params,
        )

        full = megatron_shapes(self.layout, padded_vocab=self.padded_vocab)
        out = []
        for chunk in self.chunks:
            for local_name, param in chunk.model.named_parameters():
                name = global_layer_name(local_name, chunk.layer_offset)
                if name == "output_layer.weight" and self.layout.is_tied:
                    continue
                meta = torch.empty(full[name], device="meta")
                for hf_name, tensor in to_hf_params(name, meta, self.layout):
                    out.append((hf_name, tuple(tensor.shape), param.dtype))
        return out

    def state(self) -> dict[str, Any]:
        """Stateful objects for yatt.ckpt: this rank's shards, keyed by (tp, dp) rank.

        Resume is exact at the same layout. The model state alone loads at another pp_size,
        cp_size or dp_size; the optimizer state does not reshard: at another layout the load
        fails on every rank before any tensor is read (its layout marker, `_state.py`).
        """
        from megatron.core import parallel_state

        out: dict[str, Any] = {"model": MegatronModelState(self.chunks, tp_rank=self.tp_rank)}
        if self.optimizer is not None:
            out["optimizer"] = MegatronOptimizerState(
                self._inner_optimizer,
                tp_rank=self.tp_rank,
                pp_rank=self.pp_rank,
                cp_rank=parallel_state.get_context_parallel_rank(),
                dp_rank=parallel_state.get_data_parallel_rank(),
                layout={
                    "tp_size": self.config.tp_size,
                    "pp_size": self.config.pp_size,
                    "virtual_pp_size": self.config.virtual_pp_size or 1,
                    "cp_size": self.config.cp_size,
                    "dp_size": parallel_state.get_data_parallel_world_size(),
                },
            )
            out["schedule"] = self._counts  # the same on every rank
        return out

    # -- placement role ------------------------------------------------------------------------

    def _buffers(self) -> list[Any]:
        return [
            buffer
            for model in self.models
            for buffer in list(getattr(model, "buffers", []))
            + list(getattr(model, "expert_parallel_buffers", []))
        ]

    def sleep(self) -> None:
        """Free the GPU: parameters (pinned host copy), gradient buffers (dropped: they are
        zeroed every step anyway) and optimizer state (fp32 main params, Adam moments).

        Megatron's parameters are views into DDP's contiguous buffers; the buffers are resized
        in place (storage().resize_), which keeps every view valid, where swapping `.data` as
        yatt.placement.offload does would detach the parameters from the buffers.
        """
        synchronize()  # yatt.placement's: never inside an engine's CUDA-graph capture
        # Optimizer first: with float32 parameters its params are views into DDP's parameter
        # buffer, which must still hold the data when they are copied out.
        if self.optimizer is not None and "optimizer" not in self._asleep:
            self._inner_optimizer.offload_to_cpu()
            self._asleep.add("optimizer")
        if "weights" not in self._asleep:
            if self.optimizer is None:
                from yatt.placement import offload

                for model in self.models:
                    offload(model, should_empty_cache=False)
            else:
                for buffer in self._buffers():
                    buffer.offload_to_cpu(move_params=True, move_grads=True)
                if not self.config.use_distributed_optimizer:
                    logger.warning(
                        "MegatronPolicy.sleep(): use_distributed_optimizer=False keeps the "
                        "parameters on the GPU (no parameter buffer to offload); only gradients "
                        "and optimizer state leave it"
                    )
            self._asleep.add("weights")
        synchronize()
        empty_cache()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Onload "weights" and/or "optimizer" (default both)."""
        tags = tuple(self.memory_tags if tags is None else tags)
        unknown = [t for t in tags if t not in self.memory_tags]
        if isinstance(tags, str) or unknown:
            raise ValueError(
                f"MegatronPolicy.wake_up(tags={tags!r}): use a subset of {self.memory_tags}"
            )
        if "weights" in tags and "weights" in self._asleep:
            if self.optimizer is None:
                from yatt.placement import onload

                for model in self.models:
                    onload(model)
            else:
                for buffer in self._buffers():
                    buffer.reload_from_cpu(move_params=True, move_grads=True)
            self._asleep.discard("weights")
        if "optimizer" in tags and "optimizer" in self._asleep:
            self._inner_optimizer.restore_from_cpu()
            self._asleep.discard("optimizer")
        synchronize()

    def resident_bytes(self) -> int:
        # Counted from the storages, not from _asleep: without the distributed optimizer DDP has
        # no parameter buffer, and sleep() leaves the parameters on the GPU (a known gap).
        # Parameters are views into a few shared buffers: count each storage once.
        storages = {
            p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
            for chunk in self.chunks
            for p in chunk.model.parameters()
        }
        return sum(storages.values())

    def _check_awake(self, what: str, tags: Sequence[str]) -> None:
        asleep = [t for t in tags if t in self._asleep]
        if asleep:
            raise RuntimeError(
                f"MegatronPolicy.{what}: {asleep} are offloaded; call wake_up() first"
            )
