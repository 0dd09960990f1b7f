"""Hugging Face <-> Megatron-Core GPT weights (local layer spec), and tensor-parallel shards.

Names, for layer i (global index; a pipeline stage's local index plus its offset):

    HF                                            Megatron (tp=1 layout)
    model.embed_tokens.weight      [V, H]         embedding.word_embeddings.weight  [Vp, H]
    model.layers.i.input_layernorm.weight         decoder.layers.i.input_layernorm.weight
    self_attn.{q,k,v}_proj.weight  [n*d, H] x3    decoder.layers.i.self_attention.linear_qkv.weight
    self_attn.{q,k,v}_proj.bias    (Qwen2)        ...linear_qkv.bias
    self_attn.{q,k}_norm.weight    (Qwen3) [d]    ...self_attention.{q,k}_layernorm.weight
    self_attn.o_proj.weight        [H, nq*d]      ...self_attention.linear_proj.weight
    post_attention_layernorm.weight               decoder.layers.i.pre_mlp_layernorm.weight
    mlp.{gate,up}_proj.weight      [F, H] x2      decoder.layers.i.mlp.linear_fc1.weight  [2F, H]
    mlp.down_proj.weight           [H, F]         decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                             decoder.final_layernorm.weight
    lm_head.weight                 [V, H]         output_layer.weight  [Vp, H]  (absent if tied)

Fused QKV rows are grouped per query group g (nq/ng query heads, then one key, one value head):
    [ q(g=0) heads | k(g=0) | v(g=0) | q(g=1) heads | k(g=1) | v(g=1) | ... ],  each head d rows
so a contiguous split over tensor-parallel ranks gives each rank whole groups.
fc1 is [gate; up] on every rank: rank r holds [gate_r; up_r], NOT a slice of the tp=1 tensor,
because Megatron's MLP chunks its local output in two. Embedding and output rows are padded
from V to Vp (see _config.padded_vocab_size) with zeros; the policy masks those logits.

Tensor parallelism per parameter: column-parallel (split dim 0): linear_qkv, linear_fc1,
word_embeddings, output_layer; row-parallel (split dim 1): linear_proj, linear_fc2; the norms
are replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from yatt.core.policy.megatron._config import GPTLayout

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix -> HF per-layer suffixes (one entry: a plain rename).
_LAYER_NAMES: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_qkv.bias": (
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
    ),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
_GLOBAL_NAMES: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_COLUMN_PARALLEL = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "word_embeddings.weight",
    "output_layer.weight",
)
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def megatron_names(layout: GPTLayout) -> list[str]:
    """Every Megatron parameter name of the whole model (tp=1, pp=1), in model order."""
    layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight"]
    if layout.has_qkv_bias:
        layer.append("self_attention.linear_qkv.bias")
    if layout.has_qk_norm:
        layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    layer += ["self_attention.linear_proj.weight", "pre_mlp_layernorm.weight"]
    layer += ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    names = ["embedding.word_embeddings.weight"]
    names += [f"decoder.layers.{i}.{s}" for i in range(layout.num_layers) for s in layer]
    names.append("decoder.final_layernorm.weight")
    if not layout.is_tied:
        names.append("output_layer.weight")
    return names


def hf_names_of(name: str) -> tuple[str, ...]:
    """The HF parameter names one Megatron parameter is built from (global layer index)."""
    if name in _GLOBAL_NAMES:
        return (_GLOBAL_NAMES[name],)
    match = _LAYER_RE.match(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise KeyError(f"{name!r} is not a Megatron GPT parameter this mapping knows")
    index, suffix = match.groups()
    return tuple(f"model.layers.{index}.{s}" for s in _LAYER_NAMES[suffix])


def tp_partition_dim(name: str) -> int | None:
    """The dimension Megatron splits `name` along across tensor-parallel ranks, or None."""
    if name.endswith(_COLUMN_PARALLEL):
        return 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    return None


def megatron_shapes(
    layout: GPTLayout, *, tp_size: int = 1, padded_vocab: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape on one tensor-parallel rank (what GPTModel allocates)."""
    vocab = padded_vocab if padded_vocab is not None else layout.vocab_size
    hidden, d = layout.hidden_size, layout.head_dim
    qkv_rows = (layout.num_heads + 2 * layout.num_query_groups) * d
    full = {
        "input_layernorm.weight": (hidden,),
        "self_attention.linear_qkv.weight": (qkv_rows, hidden),
        "self_attention.linear_qkv.bias": (qkv_rows,),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (hidden, layout.num_heads * d),
        "pre_mlp_layernorm.weight": (hidden,),
        "mlp.linear_fc1.weight": (2 * layout.ffn_hidden_size, hidden),
        "mlp.linear_fc2.weight": (hidden, layout.ffn_hidden_size),
    }
    shapes = {}
    for name in megatron_names(layout):
        match = _LAYER_RE.match(name)
        if match:
            shape = list(full[match.group(2)])
        elif name in _VOCAB_PARAMS:
            shape = [vocab, hidden]
        else:
            shape = [hidden]
        dim = tp_partition_dim(name)
        if dim is not None:
            assert shape[dim] % tp_size == 0, (name, shape, tp_size)
            shape[dim] //= tp_size
        shapes[name] = tuple(shape)
    return shapes


# -- one parameter, HF <-> Megatron (tp=1 layout) ------------------------------------------------


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: GPTLayout) -> torch.Tensor:
    groups, d = layout.num_query_groups, layout.head_dim
    rest = q.shape[1:]  # (H,) for weights, () for biases
    q = q.reshape(groups, (layout.num_heads // groups) * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, layout: GPTLayout) -> tuple[torch.Tensor, ...]:
    groups, d = layout.num_query_groups, layout.head_dim
    per_group = (layout.num_heads // groups) * d
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, per_group + 2 * d, *rest).split([per_group, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def to_megatron_param(
    name: str, get_hf: Callable[[str], torch.Tensor], layout: GPTLayout, *, padded_vocab: int
) -> torch.Tensor:
    """The tp=1 Megatron tensor `name`, built from HF tensors fetched with `get_hf(hf_name)`
    (a dict's __getitem__, or a lazy safetensors reader: only the needed tensors are read)."""
    hf = hf_names_of(name)
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return _fuse_qkv(*(get_hf(n) for n in hf), layout)
    if name.endswith("linear_fc1.weight"):
        return torch.cat([get_hf(hf[0]), get_hf(hf[1])], dim=0)
    if name in _VOCAB_PARAMS:
        # A tied model has no lm_head in its safetensors; Megatron then has no output_layer.
        weight = get_hf(hf[0])
        if weight.shape[0] > padded_vocab:
            raise ValueError(
                f"{hf[0]} has {weight.shape[0]} rows, over padded_vocab={padded_vocab}"
            )
        pad = weight.new_zeros(padded_vocab - weight.shape[0], *weight.shape[1:])
        return torch.cat([weight, pad], dim=0)
    return get_hf(hf[0])


def to_hf_params(
    name: str, tensor: torch.Tensor, layout: GPTLayout
) -> list[tuple[str, torch.Tensor]]:
    """The HF (name, tensor) pairs of one tp=1 Megatron tensor; padding rows dropped."""
    hf = hf_names_of(name)
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return list(zip(hf, _split_qkv(tensor, layout), strict=True))
    if name.endswith("linear_fc1.weight"):
        return list(zip(hf, tensor.chunk(2, dim=0), strict=True))
    if name in _VOCAB_PARAMS:
        return [(hf[0], tensor[: layout.vocab_size])]
    return [(hf[0], tensor)]


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor], layout: GPTLayout, *, padded_vocab: int | None = None
) -> dict[str, torch.Tensor]:
    """A whole HF state dict as a tp=1 Megatron state dict."""
    padded = padded_vocab if padded_vocab is not None else layout.vocab_size
    names = megatron_names(layout)
    needed = {hf for name in names for hf in hf_names_of(name)}
    missing = sorted(needed - set(hf_state))
    if missing:
        raise ValueError(f"the HF state dict lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return {
        name: to_megatron_param(name, hf_state.__getitem__, layout, padded_vocab=padded)
        for name in names
    }


def megatron_to_hf(
    mg_state: Mapping[str, torch.Tensor], layout: GPTLayout
) -> dict[str, torch.Tensor]:
    """A whole tp=1 Megatron state dict as an HF state dict (lm_head omitted when tied)."""
    return {
        hf: t
        for name in megatron_names(layout)
        for hf, t in to_hf_params(name, mg_state[name], layout)
    }


# -- tensor-parallel shards -----------------------------------------------------------------------


def tp_split(name: str, tensor: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """The tp=1 tensor `name` as tp_size shards, rank order (contiguous copies)."""
    dim = tp_partition_dim(name)
    if dim is None or tp_size == 1:
        return [tensor.contiguous() for _ in range(tp_size)]
    if tensor.shape[dim] % tp_size:
        raise ValueError(
            f"{name}: dim {dim} of {tuple(tensor.shape)} does not split {tp_size} ways"
        )
    if name.endswith("linear_fc1.weight"):
        gate, up = tensor.chunk(2, dim=0)
        return [
            torch.cat([g, u]) for g, u in zip(gate.chunk(tp_size), up.chunk(tp_size), strict=True)
        ]
    return [shard.contiguous() for shard in tensor.chunk(tp_size, dim=dim)]


def tp_gather(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of tp_split: the tp=1 tensor from every rank's shard, rank order."""
    dim = tp_partition_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def global_layer_name(name: str, layer_offset: int) -> str:
    """A pipeline stage's local `decoder.layers.<i>` name with the stage's layer offset added."""
    match = _LAYER_RE.match(name)
    if match is None or layer_offset == 0:
        return name
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}"


def hf_layer_index(name: str) -> int | None:
    """The layer index of an HF per-layer name, None for global tensors."""
    match = _HF_LAYER_RE.match(name)
    return int(match.group(1)) if match else None


# -- bucketed export ------------------------------------------------------------------------------


def export_hf_weights(
    named_shards: Iterable[tuple[str, torch.Tensor]],
    layout: GPTLayout,
    *,
    bucket_bytes: int,
    tp_group: object | None = None,
    layer_offset: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, full tensor) pairs from this rank's Megatron shards, gathered bucket by bucket.

    Collective over `tp_group` (every TP rank must consume the iterator in step). Shards are
    grouped until their gathered size would pass `bucket_bytes`; each bucket is one all-gather
    of one flat buffer, then split, re-assembled (tp_gather) and renamed (to_hf_params). At most
    one gathered bucket is alive while the consumer holds only the current bucket's tensors.
    Replicated tensors (norms) are not gathered. The tied output layer is skipped.
    """
    import torch.distributed as dist

    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: must be a positive int (e.g. 256 << 20)")
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    pending: list[tuple[str, torch.Tensor]] = []
    pending_bytes = 0
    for local_name, shard in named_shards:
        name = global_layer_name(local_name, layer_offset)
        if name == "output_layer.weight" and layout.is_tied:
            continue
        shard = shard.detach()
        if tp_partition_dim(name) is None or tp_size == 1:
            yield from to_hf_params(name, shard, layout)
            continue
        nbytes = shard.numel() * shard.element_size() * tp_size
        if pending and (
            pending_bytes + nbytes > bucket_bytes or pending[0][1].dtype != shard.dtype
        ):
            yield from _gather_bucket(pending, layout, tp_size, tp_group)
            pending, pending_bytes = [], 0
        pending.append((name, shard))
        pending_bytes += nbytes
    if pending:
        yield from _gather_bucket(pending, layout, tp_size, tp_group)


def _gather_bucket(
    bucket: list[tuple[str, torch.Tensor]], layout: GPTLayout, tp_size: int, tp_group: object
) -> Iterator[tuple[str, torch.Tensor]]:
    import torch.distributed as dist

    flat = torch.cat([shard.reshape(-1) for _, shard in bucket])
    gathered = [torch.empty_like(flat) for _ in range(tp_size)]
    # One collective per bucket instead of one per tensor: latency, not bandwidth, dominates
    # for the many small shards of a layer.
    dist.all_gather(gathered, flat, group=tp_group)
    sizes = [shard.numel() for _, shard in bucket]
    per_rank = [g.split(sizes) for g in gathered]
    for i, (name, shard) in enumerate(bucket):
        shards = [per_rank[r][i].view(shard.shape) for r in range(tp_size)]
        yield from to_hf_params(name, tp_gather(name, shards), layout)


# -- across pipeline stages -----------------------------------------------------------------------

HFShape = tuple[str, tuple[int, ...], torch.dtype]  # (HF name, full shape, dtype)


def plan_buckets(shapes: list[HFShape], bucket_bytes: int) -> list[list[HFShape]]:
    """Consecutive runs of one dtype, each at most `bucket_bytes` (a larger tensor alone)."""
    buckets: list[list[HFShape]] = []
    size = 0
    for item in shapes:
        _, shape, dtype = item
        nbytes = math.prod(shape) * dtype.itemsize
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][0][2] != dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += nbytes
    return buckets


def export_pipeline_hf_weights(
    local: Iterable[tuple[str, torch.Tensor]],
    local_shapes: list[HFShape],
    *,
    bucket_bytes: int,
    pp_group: object,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's HF (name, full tensor) pairs on every rank of `pp_group`, stage by stage.

    local: this stage's pairs (already gathered over TP: export_hf_weights); local_shapes: what
    it will yield, in parameter order. Each stage's list is shared first (one small
    all_gather_object), so every rank cuts the same buckets; then the owning stage broadcasts
    each bucket as one flat buffer. `local` may yield a little out of order (its own TP
    buckets hold column-parallel tensors back while norms pass): a bucket is sent once all its
    tensors have come. Collective over `pp_group` (and over TP, through `local`).
    """
    import torch.distributed as dist

    pp_size = dist.get_world_size(pp_group)
    my_stage = dist.get_rank(pp_group)
    ranks = dist.get_process_group_ranks(pp_group)
    stage_shapes: list[Any] = [None] * pp_size
    dist.all_gather_object(stage_shapes, local_shapes, group=pp_group)
    local_in_order = _InOrder(local)
    for stage, shapes in enumerate(stage_shapes):
        for bucket in plan_buckets(shapes, bucket_bytes):
            names = [name for name, _, _ in bucket]
            if stage == my_stage:
                tensors = local_in_order.take(names)
                flat = torch.cat([t.reshape(-1).to(device) for t in tensors])
            else:
                numel = sum(math.prod(shape) for _, shape, _ in bucket)
                flat = torch.empty(numel, dtype=bucket[0][2], device=device)
            dist.broadcast(flat, src=ranks[stage], group=pp_group)
            parts = flat.split([math.prod(shape) for _, shape, _ in bucket])
            for (name, shape, _), part in zip(bucket, parts, strict=True):
                yield name, part.view(shape)
    leftover = local_in_order.leftover()
    if leftover is not None:
        raise RuntimeError(f"{leftover} was exported but not announced to the other stages")


class _InOrder:
    """Takes named tensors from an iterator by name, keeping any that come early."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._iter = iter(pairs)
        self._ready: dict[str, torch.Tensor] = {}

    def take(self, names: list[str]) -> list[torch.Tensor]:
        while any(name not in self._ready for name in names):
            try:
                name, tensor = next(self._iter)
            except StopIteration:
                missing = [n for n in names if n not in self._ready]
                raise RuntimeError(f"this stage did not export {missing[:3]}") from None
            self._ready[name] = tensor
        return [self._ready.pop(name) for name in names]

    def leftover(self) -> str | None:
        extra = next(self._iter, None)
        if extra is not None:
            return extra[0]
        return next(iter(self._ready), None)
