"""Build a Megatron-Core GPTModel for an HF model and load its safetensors into this rank's shard.

Needs megatron-core (imported here, so import this module lazily) and an initialised
`megatron.core.parallel_state`. The layer spec is Megatron's local one (no TransformerEngine);
optionally its core attention is swapped for `SDPAttention`, which calls PyTorch's
scaled_dot_product_attention (flash/efficient kernels) instead of materialising [b, h, s, s]
scores as Megatron's local DotProductAttention does.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from yatt.core.policy._attention import training_attention
from yatt.core.policy.megatron._config import (
    GPTLayout,
    gpt_model_kwargs,
    transformer_config_kwargs,
)
from yatt.core.policy.megatron._context_parallel import cp_attention, gather_keys_values
from yatt.core.policy.megatron._weights import (
    global_layer_name,
    megatron_names,
    to_megatron_param,
    tp_split,
)

Attention = Literal["sdpa", "megatron"]
ATTENTIONS: tuple[str, ...] = ("sdpa", "megatron")


class SDPAttention(torch.nn.Module):
    """Causal core attention through torch's scaled_dot_product_attention.

    A drop-in for Megatron's DotProductAttention (same constructor and forward signatures):
    q [sq, b, np, hn], k/v [sk, b, ng, hn] -> context [sq, b, np * hn]. The mask argument is
    ignored: batches are right-padded, so causal attention alone keeps every valid position
    exact (padding comes after all valid tokens and never reaches them).

    Packed sequences (PackedSeqParams, qkv_format "thd": q [t, np, hn] for the t tokens of
    several sequences end to end, cu_seqlens their boundaries) run causal attention within each
    sequence, one kernel call per sequence: no padding is computed (Megatron's local attention
    refuses packed input; its varlen path needs TransformerEngine).

    Context parallelism (cp > 1): keys and values are all-gathered over the CP group and each
    rank attends its two load-balanced query chunks (see _context_parallel).
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.cp_size = getattr(config, "context_parallel_size", 1)
        self.cp_group = None
        if self.cp_size > 1:
            from megatron.core import parallel_state

            cp_group = getattr(pg_collection, "cp", None)
            self.cp_group = cp_group or parallel_state.get_context_parallel_group()
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention bias")
        with training_attention():  # no cuDNN: it builds a graph per new shape
            return self._attend(query, key, value, packed_seq_params)

    def _attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed_seq_params: Any
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        if self.cp_size > 1:
            # This rank's two query chunks over the whole sequence's keys (_context_parallel).
            return cp_attention(
                query,
                gather_keys_values(key, self.cp_group),
                gather_keys_values(value, self.cp_group),
                cp_size=self.cp_size,
                cp_rank=torch.distributed.get_rank(self.cp_group),
                scale=self.softmax_scale,
            )
        sq, b, heads, head_dim = query.shape
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != heads
        )
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any
    ) -> torch.Tensor:
        if params.qkv_format != "thd":
            raise ValueError(f"SDPAttention packs qkv_format 'thd' only, got {params.qkv_format!r}")
        total, heads, head_dim = query.shape
        bounds = params.cu_seqlens_q.tolist()  # host sync: the loop needs the boundaries
        parts = []
        for start, end in itertools.pairwise(bounds):
            # [s, h, d] -> [1, h, s, d]
            q, k, v = (t[start:end].permute(1, 0, 2)[None] for t in (query, key, value))
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != heads
            )
            parts.append(context[0].permute(1, 0, 2))
        if bounds[-1] < total:  # tokens past the last sequence (none from yatt's packing)
            parts.append(query.new_zeros(total - bounds[-1], heads, head_dim))
        return torch.cat(parts).reshape(total, heads * head_dim)


def build_layer_spec(layout: GPTLayout, *, attention: Attention = "sdpa") -> Any:
    """Megatron's local GPT layer spec for `layout` (RMSNorm, optional qk-norm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTIONS}")
    spec = get_gpt_layer_local_spec(qk_layernorm=layout.has_qk_norm, normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_gpt_model(
    layout: GPTLayout,
    *,
    tp_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    attention: Attention = "sdpa",
    sequence_parallel: bool = False,
    vocab_divisible_by: int = 128,
    use_cpu_initialization: bool = False,
    config_overrides: dict[str, Any] | None = None,
    recompute: dict[str, Any] | None = None,
) -> Any:
    """An uninitialised-weights GPTModel (pp=1) for this rank of the tensor-parallel group."""
    (chunk,) = build_gpt_chunks(
        layout,
        tp_size=tp_size,
        dtype=dtype,
        attention=attention,
        sequence_parallel=sequence_parallel,
        vocab_divisible_by=vocab_divisible_by,
        use_cpu_initialization=use_cpu_initialization,
        config_overrides=config_overrides,
        recompute=recompute,
    )
    return chunk.model


@dataclass(frozen=True)
class ModelChunk:
    """One GPTModel of this rank: its pipeline stage's layers (or one virtual stage's)."""

    model: Any  # the bare GPTModel
    layer_offset: int  # global index of its first decoder layer
    vp_stage: int | None  # the virtual stage (interleaved schedule), None without


def build_gpt_chunks(
    layout: GPTLayout,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    virtual_pp_size: int | None = None,
    cp_size: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    attention: Attention = "sdpa",
    sequence_parallel: bool = False,
    vocab_divisible_by: int = 128,
    use_cpu_initialization: bool = False,
    config_overrides: dict[str, Any] | None = None,
    recompute: dict[str, Any] | None = None,
) -> list[ModelChunk]:
    """This rank's GPTModel chunks (one per virtual stage; one without interleaving), built
    after megatron's parallel_state: the first stage has the embedding, the last the head.
    recompute: activation recompute (`_config.recompute_kwargs`' granularity, method,
    num_layers, modules); None: none."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    kwargs = transformer_config_kwargs(
        layout,
        tp_size=tp_size,
        pp_size=pp_size,
        virtual_pp_size=virtual_pp_size,
        cp_size=cp_size,
        dtype=dtype,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=use_cpu_initialization,
        # The HF weights overwrite every parameter; random init would only cost time.
        perform_initialization=False,
        recompute=recompute,
    )
    kwargs.update(config_overrides or {})
    config = TransformerConfig(**kwargs)
    spec = build_layer_spec(layout, attention=attention)
    chunks = []
    for vp_stage in range(virtual_pp_size or 1) if virtual_pp_size else [None]:
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            vp_stage=vp_stage,
            **gpt_model_kwargs(layout, tp_size=tp_size, vocab_divisible_by=vocab_divisible_by),
        )
        mark_tensor_parallel_weights(model)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage) if pp_size > 1 else 0
        chunks.append(ModelChunk(model=model, layer_offset=offset, vp_stage=vp_stage))
    return chunks


def mark_tensor_parallel_weights(model: Any) -> None:
    """Tag every tensor-parallel weight of `model` as sharded, as Megatron's own random
    initialisation does.

    megatron-core before 0.19 sets a parallel layer's weight attributes (tensor_model_parallel,
    partition_dim, partition_stride) only inside that initialisation, which
    perform_initialization=False skips. Untagged, a sharded weight counts as a duplicate of TP
    rank 0's: the gradient norm, and so the clipping, sees rank 0's shard only."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    is_gated = bool(getattr(model.config, "gated_linear_unit", False))
    for name, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        # A gated MLP's fc1 holds [gate, up] interleaved per rank (Megatron's stride 2).
        stride = 2 if is_gated and name.endswith("mlp.linear_fc1") else 1
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=stride)


class SafetensorsReader:
    """Lazy access to an HF checkpoint directory's tensors by name (single or sharded)."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: model_dir / file for name, file in weight_map.items()}
        elif (model_dir / "model.safetensors").is_file():
            from safetensors import safe_open

            path = model_dir / "model.safetensors"
            with safe_open(str(path), framework="pt") as f:
                self._files = dict.fromkeys(f.keys(), path)
        else:
            raise ValueError(
                f"model_dir={str(model_dir)!r} has neither model.safetensors nor "
                "model.safetensors.index.json; save the model with save_pretrained(safe_serialization=True)"
            )
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self._files.get(name)
        if path is None:
            raise KeyError(f"{name!r} is not in the checkpoint")
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module,
    model_dir: str | Path,
    layout: GPTLayout,
    *,
    padded_vocab: int,
    tp_rank: int,
    tp_size: int,
    layer_offset: int = 0,
) -> int:
    """Copy this rank's shard of every parameter from the HF safetensors; returns the count.

    Each rank reads the full HF tensors it needs one parameter at a time, so the peak host
    memory is one layer's worth, never the model.
    """
    reader = SafetensorsReader(model_dir)
    expected = set(megatron_names(layout))
    loaded = 0
    for local_name, param in model.named_parameters():
        name = global_layer_name(local_name, layer_offset)
        if name == "output_layer.weight" and layout.is_tied:
            # A pipeline's last stage holds its own copy of the tied embedding (Megatron keeps
            # the two equal by all-reducing their gradients over the embedding group).
            name = "embedding.word_embeddings.weight"
        if name not in expected:
            raise ValueError(
                f"the Megatron model has {local_name!r}, which the HF mapping does not know"
            )
        full = to_megatron_param(name, reader.__getitem__, layout, padded_vocab=padded_vocab)
        shard = tp_split(name, full, tp_size)[tp_rank]
        if shard.shape != param.shape:
            raise ValueError(
                f"{name}: HF gives shard {tuple(shard.shape)}, the model has {tuple(param.shape)}"
            )
        param.copy_(shard.to(param.dtype))
        loaded += 1
    return loaded
