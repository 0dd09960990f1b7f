"""A split-K ("flash-decoding") Triton kernel: one new token per slot against the static KV cache.

Why not SDPA: for a one-token query SDPA on CUDA runs a flash *prefill* kernel whose query tiles
(64-128 rows) hold only G = H_q / H_kv rows (7 for Qwen2.5), about 5x off the KV-read roofline
(1.1 ms of a 4.8 ms step at batch 256). Here one program reads one (slot, KV head) stretch of
the cache once for all G query heads of that KV head, with an online softmax in float32; the
stretch [0, span) is split so that small batches still fill the GPU, and a second kernel merges
the splits. Visibility is the engine's rule: slot s sees cache positions 0..pos_S[s] (and < span).

Batch rows and cache slots are decoupled: row b of the query reads the cache row of slot
`slot_B[b]` (the engine decodes a bucket of its active slots, not every slot), at its position
`pos_B[b]`.

`triton_decode_attention` returns None when Triton is missing (the caller falls back to SDPA).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_N = 64  # cache positions per inner step
MIN_ROWS = 16  # tl.dot needs at least 16 rows: the G query rows are padded to this
PROGRAMS_PER_SM = 2  # split the span until (slots x KV heads x splits) fills the GPU this often
NUM_WARPS = 4
NUM_STAGES = 3  # Triton's default on Hopper (the measured configuration)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _split_kernel(
        Q,  # [B * H_kv, G, D] contiguous
        K,  # [S, H_kv, L, D], last dim contiguous
        V,
        Pos,  # int64 [B]: the position each batch row writes (sees 0..Pos)
        Slot,  # int64 [B]: the cache slot each batch row reads
        Acc,  # float32 [B * H_kv, SPLITS, G_PAD, D]
        M,  # float32 [B * H_kv, SPLITS, G_PAD]
        Lse,  # float32 [B * H_kv, SPLITS, G_PAD] (sum of exp)
        stride_ks,
        stride_kh,
        stride_kl,
        stride_vs,
        stride_vh,
        stride_vl,
        span,
        chunk,
        scale,
        NUM_KV_HEADS: tl.constexpr,
        SPLITS: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,  # "ieee" for float32 caches (no TF32), else "tf32" (unused)
    ):
        row = tl.program_id(0)  # batch row * H_kv + head
        split = tl.program_id(1)
        batch_row = row // NUM_KV_HEADS
        head = row % NUM_KV_HEADS
        slot = tl.load(Slot + batch_row)
        visible = tl.minimum(tl.load(Pos + batch_row) + 1, span)
        start = split * chunk
        end = tl.minimum(start + chunk, visible)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        q = tl.load(
            Q + row * G * D + offs_g[:, None] * D + offs_d[None, :],
            mask=offs_g[:, None] < G,
            other=0.0,
        )
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        k_base = K + slot * stride_ks + head * stride_kh
        v_base = V + slot * stride_vs + head * stride_vh
        for n0 in range(start, end, BLOCK):
            offs_n = n0 + tl.arange(0, BLOCK)
            valid = offs_n < end
            k = tl.load(
                k_base + offs_n[:, None] * stride_kl + offs_d[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + offs_n[:, None] * stride_vl + offs_d[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = (row * SPLITS + split) * G_PAD
        tl.store(Acc + (out + offs_g[:, None]) * D + offs_d[None, :], acc)
        tl.store(M + out + offs_g, m_i)
        tl.store(Lse + out + offs_g, l_i)

    @triton.jit
    def _merge_kernel(
        Acc,
        M,
        Lse,
        Out,  # [S * H_kv, G, D] in the activations' dtype
        SPLITS: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        m_max = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        for split in range(SPLITS):
            m_max = tl.maximum(m_max, tl.load(M + (row * SPLITS + split) * G_PAD + offs_g))
        total = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        for split in range(SPLITS):
            base = (row * SPLITS + split) * G_PAD
            m = tl.load(M + base + offs_g)
            # An empty split (past the slot's length) has m = -inf: weight 0. Split 0 always
            # holds position 0, so m_max is finite.
            w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
            total += w * tl.load(Lse + base + offs_g)
            a = tl.load(Acc + (base + offs_g[:, None]) * D + offs_d[None, :])
            acc += w[:, None] * a
        out = acc / total[:, None]
        tl.store(
            Out + row * G * D + offs_g[:, None] * D + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=offs_g[:, None] < G,
        )


def _num_splits(rows: int, span: int, device: torch.device) -> int:
    """Enough programs to fill the GPU PROGRAMS_PER_SM times, each reading >= BLOCK_N positions."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(math.ceil(PROGRAMS_PER_SM * sms / rows), math.ceil(span / BLOCK_N), 16))


def triton_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos_B: torch.Tensor,
    *,
    span: int,
    scale: float,
    slot_B: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """query [B, H_q, 1, D]; keys/values [S, H_kv, L, D]; pos_B, slot_B int64 [B] (slot_B None:
    row b reads slot b, B == S); returns [B, 1, H_q, D] (or None when Triton cannot run it)."""
    if not available(query.device):
        return None
    S, Hq, _, D = query.shape  # S: batch rows (B)
    if slot_B is None:
        slot_B = torch.arange(S, device=query.device)
    Hkv = keys.shape[1]
    G = Hq // Hkv
    if D & (D - 1) or D < 16 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        return None
    G_PAD = max(MIN_ROWS, triton.next_power_of_2(G))
    rows = S * Hkv
    splits = _num_splits(rows, span, query.device)
    chunk = math.ceil(math.ceil(span / splits) / BLOCK_N) * BLOCK_N
    q = query.reshape(rows, G, D).contiguous()
    f32 = dict(device=query.device, dtype=torch.float32)
    acc = torch.empty(rows, splits, G_PAD, D, **f32)
    m = torch.empty(rows, splits, G_PAD, **f32)
    lse = torch.empty(rows, splits, G_PAD, **f32)
    out = torch.empty(rows, G, D, device=query.device, dtype=query.dtype)
    _split_kernel[(rows, splits)](
        q,
        keys,
        values,
        pos_B,
        slot_B,
        acc,
        m,
        lse,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        span,
        chunk,
        scale,
        NUM_KV_HEADS=Hkv,
        SPLITS=splits,
        G=G,
        G_PAD=G_PAD,
        D=D,
        BLOCK=BLOCK_N,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    _merge_kernel[(rows,)](acc, m, lse, out, SPLITS=splits, G=G, G_PAD=G_PAD, D=D)
    return out.reshape(S, 1, Hq, D)
