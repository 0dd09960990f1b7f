"""A preallocated KV cache with one row per slot, plugged into Hugging Face attention modules.

The engine runs the model's own modules (any HF decoder that goes through `AttentionInterface`)
with `attn_implementation="yatt_static_kv"`. The attention function below writes the new keys and
values into this cache and attends with the 4D mask that the engine passes as `attention_mask`
(HF returns a 4D mask unchanged). Outside an engine step it is plain SDPA, so the same model
object still works for ordinary forward passes.

Layout, per layer: k and v are [S, H_kv, L, D] (S slots, L = max_seq_len). Slot s holds the
sequence in positions 0..len-1; positions past the length hold stale values that the mask hides.

A decode step runs a batch of B rows (a bucket of the active slots, B <= S): row b is cache slot
`slot_B[b]`, writes its new key/value at `pos_B[b]` and reads that slot's row. The full bucket
(B == S) is always the identity (row s = slot s), so the SDPA/matmul fallbacks read the cache
as it lies there and gather the B slots' rows only for a smaller bucket; the Triton kernel
reads through the index either way.

Decode attention reads only the first `span` positions of every row (the engine picks the
smallest bucket that covers the longest active sequence) and never expands the grouped KV
heads: the H_q query heads of a slot are regrouped as [H_kv, G, D], i.e. G "query rows" per KV
head, which is one SDPA call over the cache as it lies. HF's generic path instead repeats
k/v G times over the whole cache on every layer and step (7x the cache in copies for Qwen2.5).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from yatt.rollout.builtin._decode_kernel import triton_decode_attention
from yatt.rollout.builtin._device import to_device
from yatt.rollout.builtin._layer_compile import layer_caches

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "yatt_static_kv"


class StaticKVCache:
    """Per-layer key/value buffers of fixed shape, allocated once (inside a placement region)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_slots, num_kv_heads, max_seq_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.num_kv_heads, self.max_seq_len, self.head_dim = shape
        self.row_base_SH = torch.zeros(num_slots, num_kv_heads, dtype=torch.long, device=device)
        self.reset()

    def reset(self) -> None:
        """Zero the buffers and rebuild the index table (memory is garbage after a wake-up)."""
        for buffer in (*self.keys, *self.values):
            buffer.zero_()
        # Row (s, h) of a layer viewed as [S * H_kv * L, D] starts at (s * H_kv + h) * L.
        heads = torch.arange(self.num_kv_heads)
        slots = torch.arange(self.num_slots)
        row_base = (slots[:, None] * self.num_kv_heads + heads[None, :]) * self.max_seq_len
        self.row_base_SH.copy_(row_base)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


@dataclass(kw_only=True)
class DecodeWrite:
    """Decode step: each batch row writes one token into its slot `slot_B` at its position
    `pos_B`, then attends to cache positions [0, span) under the additive mask the engine
    passes ([B, 1, 1, span])."""

    cache: StaticKVCache
    pos_B: torch.Tensor  # int64 [B], clamped into [0, L) by the engine
    slot_B: torch.Tensor  # int64 [B], distinct slots; arange(S) when B == S
    span: int  # cache positions attended; > every active slot's position
    # "sdpa": one SDPA call over the grouped query; "matmul": q K^T, masked float32 softmax,
    # P V; "triton": the split-K kernel of _decode_kernel.py (CUDA; else SDPA).
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        # Row of each (batch row's slot, head) in a layer viewed as [S * H_kv * L, D]: the same
        # for every layer, so computed once per step.
        base_BH = self.cache.row_base_SH.index_select(0, self.slot_B)
        self.rows_BH = (base_BH + self.pos_B[:, None]).reshape(-1)

    def write(self, caches, key: torch.Tensor, value: torch.Tensor):
        key_cache, value_cache = caches
        _write_rows(key_cache, self.rows_BH, key)
        _write_rows(value_cache, self.rows_BH, value)
        return key_cache, value_cache

    def write_and_attend(self, caches, query, key, value, mask, scaling) -> torch.Tensor:
        """The layer's KV write and decode attention as one custom op: opaque to torch.compile,
        which would otherwise functionalize the write into a copy of the whole layer cache."""
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        key_cache, value_cache = caches  # the layer's (layer_caches)
        return torch.ops.yatt_rollout.decode_kv_attention(
            query,
            key,
            value,
            key_cache,
            value_cache,
            self.rows_BH,
            self.pos_B,
            self.slot_B,
            mask,
            float(scale),
            self.attention,
        )


def _write_rows(buffer: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> None:
    # new: [B, H_kv, 1, D] -> one row per (row's slot, head) of the buffer viewed [S*H_kv*L, D].
    flat_shape = (-1, buffer.shape[-1])
    buffer.view(flat_shape).index_copy_(0, rows, new.reshape(flat_shape))


@torch.library.custom_op(
    "yatt_rollout::decode_kv_attention", mutates_args=("key_cache", "value_cache")
)
def decode_kv_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rows_BH: torch.Tensor,
    pos_B: torch.Tensor,
    slot_B: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    kernel: str,
) -> torch.Tensor:
    """Write a decode step's keys/values at rows_BH, then attend to positions [0, mask's span).

    query [B, H_q, 1, D]; key/value [B, H_kv, 1, D]; caches [S, H_kv, L, D]; batch row b is
    slot slot_B[b] (B == S: the identity); mask [B, 1, 1, span] additive (what the engine
    builds from pos_B: position p visible iff p <= pos_B[b]). Returns [B, 1, H_q, D].
    """
    _write_rows(key_cache, rows_BH, key)
    _write_rows(value_cache, rows_BH, value)
    span = mask.shape[-1]
    if kernel == "triton":
        out = triton_decode_attention(
            query, key_cache, value_cache, pos_B, span=span, scale=scale, slot_B=slot_B
        )
        if out is not None:
            return out
        _log_triton_fallback()
        kernel = "sdpa"
    if query.shape[0] != key_cache.shape[0]:
        # A smaller bucket: its slots' rows, up to the span (a copy the Triton kernel avoids).
        key_cache = key_cache[:, :, :span].index_select(0, slot_B)
        value_cache = value_cache[:, :, :span].index_select(0, slot_B)
    attend = decode_attention_matmul if kernel == "matmul" else decode_attention
    return attend(query, key_cache, value_cache, mask, span=span, scaling=scale)


@decode_kv_attention.register_fake
def _(query, key, value, key_cache, value_cache, rows_BH, pos_B, slot_B, mask, scale, kernel):
    B, Hq, _, D = query.shape
    return query.new_empty((B, 1, Hq, D))


_TRITON_FALLBACK_LOGGED = []


def _log_triton_fallback() -> None:
    if not _TRITON_FALLBACK_LOGGED:
        _TRITON_FALLBACK_LOGGED.append(True)
        logger.warning(
            "decode attention 'triton' is unavailable here (no Triton, not CUDA, or an "
            "unsupported head size); using SDPA"
        )


@dataclass(kw_only=True)
class PrefillWrite:
    """Prefill of left-padded prompts [B, T]; slot j receives row `row_J[j]`.

    Keys are gathered so that position p of the slot gets the token at column p + pad of its
    row (columns past the row's end repeat its last token and are hidden by the mask later).
    Attention itself runs over the new tokens only, since a prefill starts at position 0.
    """

    cache: StaticKVCache
    slot_J: torch.Tensor  # int64 [J] destination slots
    row_J: torch.Tensor  # int64 [J] source row of each slot
    source_col_BT: torch.Tensor  # int64 [B, T] column of the padded input for each position
    # Right-padded rows that all start at column 0 (source_col_BT is the identity): causal
    # attention alone is exact, and the write and attention run as one opaque op
    # (write_and_attend), which never reads the forward's mask (a placeholder: SDPA under a
    # real mask left flash).
    is_causal_from_start: bool = False
    # Row j fills slot slot_J[j] (one sample per prompt, as a judge's prompts are): the causal
    # op writes the new keys/values without first gathering them by row_J.
    is_one_sample_per_row: bool = False

    def write(self, caches, key: torch.Tensor, value: torch.Tensor):
        num_tokens = key.shape[2]
        cols = self.source_col_BT[self.row_J][:, None, :, None]
        cols = cols.expand(-1, key.shape[1], -1, key.shape[3])
        for buffer, new in zip(caches, (key, value), strict=True):
            buffer[self.slot_J, :, :num_tokens] = new[self.row_J].gather(2, cols)
        return key, value

    def write_and_attend(self, caches, query, key, value, scaling) -> torch.Tensor:
        """is_causal_from_start: the layer's KV write and causal attention as one custom op,
        opaque to torch.compile (which would otherwise functionalize the write into a copy of
        the layer's cache, and run SDPA under HF's mask). Returns [B, T, H_q, D]."""
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        key_cache, value_cache = caches  # the layer's (layer_caches)
        return torch.ops.yatt_rollout.prefill_kv_attention(
            query,
            key,
            value,
            key_cache,
            value_cache,
            self.slot_J,
            None if self.is_one_sample_per_row else self.row_J,
            float(scale),
        )


@dataclass(kw_only=True)
class ContinueWrite:
    """Continuation prefill: new tokens appended to sequences whose KV the cache already holds
    (a multi-turn conversation kept between turns).

    Rows are left-padded [B, T]: row b's n_b new tokens sit in columns [T - n_b, T) and go to
    slot slot_B[b] at positions start_B[b] .. start_B[b] + n_b - 1. Row b's new tokens attend to
    its slot's cache positions [0, start_B[b] + n_b) under a lower-right causal mask (column
    T - n_b + t sees positions <= start_B[b] + t). The attention mask the engine passes is not
    read; only the last column's logits are read, so padding columns' outputs do not matter.

    One attention call per layer for all B rows, never one per row: a per-row loop launched
    about 48 small ops per row and layer (74k for 64 rows x 24 layers), host-bound on a GPU,
    and the boolean-mask gathers of the KV write synchronised with the host twice per layer
    (bench/results/multiturn_kv_nvidia_h200.md: a kept turn cost 3x a prefill's time per
    token). Two kernels, chosen once per forward:
      "varlen": CUDA, fp16/bf16 -- flash attention over packed sequences: each row's new
        queries, and its slot's cache positions [0, start + n) gathered into one packed K/V
        (one index_select per layer), causal aligned bottom-right (flash's rule for
        seqlen_q < seqlen_k), grouped KV heads as they are;
      "dense": anywhere else (CPU, float32) -- SDPA over the rows' slots [B, H_kv, span, D]
        under a boolean [B, 1, T, span] mask, rows grouped so no group's scores exceed
        DENSE_SCORES_BUDGET elements (one group in the usual case).
    The write and the attention are one opaque op (continue_kv_attention), so the forward
    compiles as a prefill's does (EngineConfig.compile_prefill); the host loop admits
    continuations in chunks of at most max_prefill_tokens padded tokens, as it does prompts.
    """

    cache: StaticKVCache
    slots: list[int]  # per row: its slot (distinct)
    starts: list[int]  # per row: positions the slot's cache already holds
    lengths: list[int]  # per row: new tokens
    span: int  # positions attended: > every row's last position
    kernel: str | None = None  # "varlen" or "dense"; None: varlen where it runs, else dense

    def __post_init__(self) -> None:
        # Index tensors every layer shares, built on the host from the host lists and copied
        # once (no host sync in the forward). A (slot, head, position) triple is row
        # (slot * H_kv + head) * L + position of a layer viewed as [S * H_kv * L, D].
        cache, device = self.cache, self.cache.keys[0].device
        T, H, L = max(self.lengths), cache.num_kv_heads, cache.max_seq_len
        lengths_B, starts_B = torch.tensor(self.lengths), torch.tensor(self.starts)
        slots_B = torch.tensor(self.slots)
        pad_B = T - lengths_B
        heads_H = torch.arange(H)
        self.slot_B = to_device(slots_B, device)
        # The real (row, column) pairs as flat indices into [B * T], row by row, and their
        # (slot, head) rows at their positions.
        real_N = torch.cat([b * T + torch.arange(pad, T) for b, pad in enumerate(pad_B.tolist())])
        position_N = torch.cat(
            [torch.arange(s, s + n) for s, n in zip(self.starts, self.lengths, strict=True)]
        )
        slot_N = torch.repeat_interleave(slots_B, lengths_B)
        rows_NH = ((slot_N[:, None] * H + heads_H[None, :]) * L) + position_N[:, None]
        self.real_N = to_device(real_N, device)
        self.rows_NH = to_device(rows_NH.reshape(-1), device)
        spans_B = starts_B + lengths_B
        # max new tokens and max span, as a host tensor: an op argument torch.compile keeps
        # dynamic (a Python int would be specialised into the graph, one compile per value).
        self.max_q_k = torch.tensor([T, int(spans_B.max())])
        self.rows_KH = self.cu_q = self.cu_k = self.visible_B1TP = None
        if self.kernel is None:
            self.kernel = "varlen" if _can_use_varlen(cache) else "dense"
        if self.kernel == "varlen":
            # Packed keys: row b's positions [0, span_b) of its slot, rows of [S * H_kv * L, D].
            slot_K = torch.repeat_interleave(slots_B, spans_B)
            position_K = torch.cat([torch.arange(n) for n in spans_B.tolist()])
            rows_KH = ((slot_K[:, None] * H + heads_H[None, :]) * L) + position_K[:, None]
            self.rows_KH = to_device(rows_KH.reshape(-1), device)
            zero = torch.zeros(1, dtype=torch.int32)
            self.cu_q = to_device(torch.cat([zero, lengths_B.cumsum(0)]), device, torch.int32)
            self.cu_k = to_device(torch.cat([zero, spans_B.cumsum(0)]), device, torch.int32)
        elif self.kernel == "dense":
            # Column T - n_b + t of row b sees positions <= start_b + t; a padding column
            # (t < 0) sees positions <= max(start_b + t, 0): kept keys, so no softmax row is
            # empty (NaN); its output is never read.
            col_T, pos_P = torch.arange(T), torch.arange(self.span)
            last_BT = starts_B[:, None] + col_T[None, :] - pad_B[:, None]
            visible = pos_P[None, None, :] <= last_BT.clamp(min=0)[:, :, None]
            self.visible_B1TP = to_device(visible[:, None], device, torch.bool)
        else:
            raise ValueError(f"ContinueWrite.kernel={self.kernel!r}: 'varlen' or 'dense'")

    def write_and_attend(self, caches, query, key, value, mask, scaling) -> torch.Tensor:
        """query [B, H_q, T, D]; key/value [B, H_kv, T, D]. Returns [B, T, H_q, D]. One opaque
        op, so torch.compile neither copies the layer's cache to functionalize the write nor
        traces the attention."""
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        key_cache, value_cache = caches  # the layer's (layer_caches)
        return torch.ops.yatt_rollout.continue_kv_attention(
            query,
            key,
            value,
            key_cache,
            value_cache,
            self.real_N,
            self.rows_NH,
            self.slot_B,
            self.max_q_k,
            self.rows_KH,
            self.cu_q,
            self.cu_k,
            self.visible_B1TP,
            float(scale),
            self.kernel,
        )


@torch.library.custom_op(
    "yatt_rollout::continue_kv_attention", mutates_args=("key_cache", "value_cache")
)
def continue_kv_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    real_N: torch.Tensor,
    rows_NH: torch.Tensor,
    slot_B: torch.Tensor,
    max_q_k: torch.Tensor,
    rows_KH: torch.Tensor | None,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    visible_B1TP: torch.Tensor | None,
    scale: float,
    kernel: str,
) -> torch.Tensor:
    """ContinueWrite's layer step: write the real tokens' keys/values (flat indices real_N of
    [B * T]) at cache rows rows_NH, then attend ("varlen" or "dense", see ContinueWrite).
    query [B, H_q, T, D]; key/value [B, H_kv, T, D]; caches [S, H_kv, L, D]. Returns
    [B, T, H_q, D]."""
    B, _, T, D = query.shape
    for cache, new in ((key_cache, key), (value_cache, value)):
        # [B, H, T, D] -> [B * T, H, D] -> the real tokens [N, H, D] -> rows [N * H, D].
        real = new.transpose(1, 2).reshape(B * T, -1, D).index_select(0, real_N)
        cache.view(-1, D).index_copy_(0, rows_NH, real.reshape(-1, D))
    if kernel == "varlen":
        return _attend_varlen(
            query, key_cache, value_cache, real_N, rows_KH, cu_q, cu_k, max_q_k, scale
        )
    return _attend_dense(query, key_cache, value_cache, slot_B, visible_B1TP, scale)


@continue_kv_attention.register_fake
def _(
    query,
    key,
    value,
    key_cache,
    value_cache,
    real_N,
    rows_NH,
    slot_B,
    max_q_k,
    rows_KH,
    cu_q,
    cu_k,
    visible_B1TP,
    scale,
    kernel,
):
    B, Hq, T, D = query.shape
    return query.new_empty((B, T, Hq, D))


def _attend_varlen(query, keys, values, real_N, rows_KH, cu_q, cu_k, max_q_k, scale):
    B, H_q, T, D = query.shape
    H_kv = keys.shape[1]
    max_q, max_k = max_q_k.tolist()  # a host tensor: no device sync
    q_NHD = query.transpose(1, 2).reshape(B * T, H_q, D).index_select(0, real_N)
    k_KHD = keys.view(-1, D).index_select(0, rows_KH).view(-1, H_kv, D)
    v_KHD = values.view(-1, D).index_select(0, rows_KH).view(-1, H_kv, D)
    try:
        out_NHD = torch.ops.aten._flash_attention_forward(
            q_NHD,
            k_KHD,
            v_KHD,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            True,  # causal: aligned bottom-right when a sequence has fewer queries than keys
            False,
            scale=scale,
        )[0]
    except RuntimeError as exc:  # a GPU or build without it: per sequence from now on
        _log_varlen_fallback(exc)
        out_NHD = _attend_packed_per_sequence(q_NHD, k_KHD, v_KHD, cu_q, cu_k, scale)
    out = query.new_zeros(B * T, H_q, D)  # padding columns: 0
    out.index_copy_(0, real_N, out_NHD)
    return out.view(B, T, H_q, D)


def _attend_packed_per_sequence(q_NHD, k_KHD, v_KHD, cu_q, cu_k, scale) -> torch.Tensor:
    """What the varlen kernel computes, one SDPA call per sequence (the fallback)."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    outs = []
    for b in range(len(bounds_q) - 1):
        q = q_NHD[bounds_q[b] : bounds_q[b + 1]].transpose(0, 1)[None]
        k = k_KHD[bounds_k[b] : bounds_k[b + 1]].transpose(0, 1)[None]
        v = v_KHD[bounds_k[b] : bounds_k[b + 1]].transpose(0, 1)[None]
        outs.append(
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                scale=scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )[0].transpose(0, 1)
        )
    return torch.cat(outs)


_VARLEN_BROKEN: list[str] = []  # the first failure's message: ContinueWrite then picks dense


def _log_varlen_fallback(exc: Exception) -> None:
    if not _VARLEN_BROKEN:
        _VARLEN_BROKEN.append(str(exc))
        logger.warning(
            "flash attention over packed sequences failed (%s); kept-KV continuations attend "
            "per sequence, then with one masked SDPA call, from now on",
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )


def _attend_dense(query, keys, values, slot_B, visible_B1TP, scale):
    B, _, T, _ = query.shape
    span = visible_B1TP.shape[-1]
    rows_per_group = max(1, DENSE_SCORES_BUDGET // (T * span * keys.shape[1]))
    outs = []
    for first in range(0, B, rows_per_group):
        last = min(first + rows_per_group, B)
        slots = slot_B[first:last]
        outs.append(
            F.scaled_dot_product_attention(
                query[first:last],
                keys[:, :, :span].index_select(0, slots),
                values[:, :, :span].index_select(0, slots),
                attn_mask=visible_B1TP[first:last],
                scale=scale,
                enable_gqa=query.shape[1] != keys.shape[1],
            )
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.transpose(1, 2).contiguous()


# Scores (rows x H_kv x T x span) one dense continuation attention call may materialise: the
# CPU/float32 fallback's math kernel holds them in float32 with the query heads on top.
DENSE_SCORES_BUDGET = 1 << 23


def _can_use_varlen(cache: StaticKVCache) -> bool:
    """Flash attention over packed sequences: CUDA, half precision, a head size flash takes."""
    keys = cache.keys[0]
    return (
        keys.is_cuda
        and not _VARLEN_BROKEN
        and torch.cuda.get_device_capability(keys.device)[0] >= 8
        and keys.dtype in (torch.float16, torch.bfloat16)
        and cache.head_dim % 8 == 0
        and cache.head_dim <= 256
        and torch.backends.cuda.flash_sdp_enabled()
    )


_ACTIVE_WRITE: ContextVar[DecodeWrite | PrefillWrite | ContinueWrite | None] = ContextVar(
    "yatt_static_kv_write", default=None
)


@contextmanager
def writing_kv(write: DecodeWrite | PrefillWrite | ContinueWrite) -> Iterator[None]:
    """Route the attention layers' new keys/values into the cache during one forward pass."""
    token = _ACTIVE_WRITE.set(write)
    try:
        yield
    finally:
        _ACTIVE_WRITE.reset(token)


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    span: int,
    scaling: float | None,
) -> torch.Tensor:
    """One new token per slot against the cache, without expanding grouped KV heads.

    query [S, H_q, 1, D]; keys/values [S, H_kv, L, D]; mask [S, 1, 1, span] (additive, or bool
    with True = visible), the same for every head. Returns [S, 1, H_q, D], the layout HF's
    attention functions return.
    """
    num_slots, num_heads, _, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    # Query head h uses KV head h // G (HF's repeat_kv order), so [H_q] -> [H_kv, G] is a view.
    grouped = query.reshape(num_slots, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, keys[:, :, :span], values[:, :, :span], attn_mask=mask, scale=scaling
    )
    return out.reshape(num_slots, 1, num_heads, head_dim)


def decode_attention_matmul(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    span: int,
    scaling: float | None,
) -> torch.Tensor:
    """`decode_attention` as q K^T, masked float32 softmax, P V (HF's eager attention's order).

    Why: for a one-token query SDPA on CUDA picks a flash *prefill* kernel whose 64-128-row
    query tiles hold G = H_q / H_kv rows (7 for Qwen2.5), about 5x off the KV-read roofline.
    Two batched GEMMs read K and V once each (cuBLAS, memory-bound at M = G), and under
    torch.compile the scale, mask, softmax and cast between them fuse into one kernel. The
    scores are rounded to the activations' dtype before the softmax (as HF's eager path does).
    Same arguments and result layout as `decode_attention`.
    """
    num_slots, num_heads, _, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    rows = num_slots * num_kv_heads
    # [S, H_kv, :span, D] -> [S * H_kv, span, D] is a view: the slot stride is H_kv rows.
    keys_RPD = keys[:, :, :span].reshape(rows, span, head_dim)
    values_RPD = values[:, :, :span].reshape(rows, span, head_dim)
    query_RGD = query.reshape(rows, group, head_dim)
    scale = scaling if scaling is not None else head_dim**-0.5
    scores = torch.matmul(query_RGD, keys_RPD.transpose(1, 2)).view(
        num_slots, num_kv_heads, group, span
    )
    if mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, float("-inf"))
    scores = scores.float() * scale + mask.float()
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(rows, group, span)
    out = torch.matmul(probs, values_RPD)
    return out.reshape(num_slots, 1, num_heads, head_dim)


# Keyword argument of the model's forward that carries the KV write to the attention layers
# (HF passes the forward's extra kwargs down to them): unlike the ContextVar of `writing_kv`,
# torch.compile traces through it, and it is as thread-safe (a call's own argument).
KV_WRITE_KWARG = "yatt_kv_write"


# Prefill and plain forwards: prompt batches change shape from call to call (a judge's prompts
# hold the responses), and cuDNN's attention builds an execution graph for each new shape
# (hundreds of ms; bench/results/train_step_profile_nvidia_h200.md measured it in training).
# Flash and memory-efficient attention build nothing per shape.
PREFILL_SDPA_BACKENDS = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


def _prefill_attention(module, query, key, value, attention_mask, **kwargs):
    with sdpa_kernel(list(PREFILL_SDPA_BACKENDS)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@torch.library.custom_op(
    "yatt_rollout::prefill_kv_attention", mutates_args=("key_cache", "value_cache")
)
def prefill_kv_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_J: torch.Tensor,
    row_J: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """A prefill from position 0: write row row_J[j]'s keys/values into cache slot slot_J[j]
    (positions [0, T); row_J None: row j), then causal SDPA over the new tokens on
    PREFILL_SDPA_BACKENDS.

    query [B, H_q, T, D]; key/value [B, H_kv, T, D] (grouped-query attention when H_kv < H_q);
    caches [S, H_kv, L, D]. Returns [B, T, H_q, D], the layout HF's attention functions return.
    What a right-padded text prefill runs, eager or compiled (PrefillWrite.is_causal_from_start).
    Opaque, so inductor neither copies the whole cache to functionalize the write nor runs SDPA
    under the causal mask a traced HF forward passes, which moved it from flash to the
    memory-efficient kernel (16.6 vs 3.6 ms a chunk of 16 x 1,024 tokens on an H200,
    bench/results/prefill_profile_nvidia_h200.md)."""
    num_tokens = key.shape[2]
    for cache, new in ((key_cache, key), (value_cache, value)):
        cache[:, :, :num_tokens].index_copy_(0, slot_J, new if row_J is None else new[row_J])
    with sdpa_kernel(list(PREFILL_SDPA_BACKENDS)):
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            is_causal=True,
            scale=scale,
            enable_gqa=query.shape[1] != key.shape[1],
        )
    return out.transpose(1, 2).contiguous()


@prefill_kv_attention.register_fake
def _(query, key, value, key_cache, value_cache, slot_J, row_J, scale):
    B, Hq, T, _ = query.shape
    return query.new_empty((B, T, Hq, value.shape[-1]))


def _static_kv_attention(module, query, key, value, attention_mask, **kwargs):
    write = kwargs.pop(KV_WRITE_KWARG, None)
    if write is None:
        write = _ACTIVE_WRITE.get()
    if write is None:
        return _prefill_attention(module, query, key, value, attention_mask, **kwargs)
    for name in ("sliding_window", "softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{type(module).__name__} passes {name} to its attention, which the built-in "
                "engine does not implement; use the vLLM or SGLang engine"
            )
    caches = layer_caches(module, write.cache)
    if isinstance(write, ContinueWrite):
        return write.write_and_attend(
            caches, query, key, value, attention_mask, kwargs.get("scaling")
        ), None
    if isinstance(write, DecodeWrite):
        out = write.write_and_attend(
            caches, query, key, value, attention_mask, kwargs.get("scaling")
        )
        return out, None
    if write.is_causal_from_start:
        if not kwargs.get("dropout"):
            return write.write_and_attend(caches, query, key, value, kwargs.get("scaling")), None
        # Causal from column 0 (SDPA's is_causal); the engine's mask is a placeholder
        # (SlotRunner._prefill_logits), never read.
        attention_mask = None
    key, value = write.write(caches, key, value)
    return _prefill_attention(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> None:
    """Make `attn_implementation="yatt_static_kv"` known to transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, _static_kv_attention)
    # Plain forward passes (no engine step) let HF build the mask it would build for SDPA.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
