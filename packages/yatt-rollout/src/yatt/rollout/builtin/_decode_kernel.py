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

Two variants, chosen by `DecodeKernelConfig` (the engine uses `DEFAULT_CONFIG`); both run one
program per (batch row, KV head, split) for all G query heads of the group (each K/V tile read
once, the dots [G_PAD, D] x [D, BLOCK_N]):
- "gqa" (default since issue 28): with one split (batch 256 x 2 KV heads already fills an
  H200) the program normalises and writes the output itself: no merge kernel, no float32
  scratch. With several, each split writes its normalised partial output and one log2-sum-exp
  for the G real heads only (not G_PAD), and the merge rescales them online in one pass. Also:
  exp2 with the scale and log2(e) in one multiply, both tiles' loads issued before the first
  dot, the query read through its strides (no copy), and the split count re-derived from the
  rounded chunk so that no program starts past the span. Launch settings: bench/rollout/
  decode_attention_gpu.py times the candidates of BENCH_CONFIGS.
- "legacy": the kernel as first measured (a merge kernel always, float32 scratch for G_PAD
  rows), kept so that the benchmark times both in one process.

`triton_decode_attention` returns None when Triton is missing (the caller falls back to SDPA).
A copy of this module imported under TRITON_INTERPRET=1 runs `run_decode_attention` on CPU
tensors through Triton's interpreter (the tests do; bf16 dots are wrong in the interpreter of
Triton 3.9, so they use float16 and float32 there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MIN_ROWS = 16  # tl.dot needs at least 16 rows: the G query rows are padded to this
LOG2_E = 1.4426950408889634
DEFAULT_NUM_SMS = 132  # H100/H200; used where no CUDA device says (the interpreter on CPU)


@dataclass(frozen=True, kw_only=True)
class DecodeKernelConfig:
    """Launch settings of the decode kernel (bench/rollout/decode_attention_gpu.py times them)."""

    variant: str = "gqa"  # "gqa" (the tuned kernel) or "legacy" (the kernel before issue 28)
    block_n: int = 64  # cache positions per inner step (a power of two >= 16)
    num_warps: int = 4
    num_stages: int = 3  # software-pipelined K/V tiles in flight per program (Hopper default)
    # Split the span until (batch rows x KV heads x splits) reaches this many programs per SM;
    # batch 256 x 2 KV heads (512 programs) already does on 132 SMs: one split, no merge.
    programs_per_sm: float = 2.0
    max_splits: int = 16

    def __post_init__(self) -> None:
        if self.variant not in ("gqa", "legacy"):
            raise ValueError(f"DecodeKernelConfig.variant={self.variant!r}: use 'gqa' or 'legacy'")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"DecodeKernelConfig.block_n={self.block_n}: use a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DecodeKernelConfig.num_warps={self.num_warps}: use 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"DecodeKernelConfig.num_stages={self.num_stages}: use >= 1")
        if self.programs_per_sm <= 0:
            raise ValueError(f"DecodeKernelConfig.programs_per_sm={self.programs_per_sm}: use > 0")
        if self.max_splits < 1:
            raise ValueError(f"DecodeKernelConfig.max_splits={self.max_splits}: use >= 1")


# The configuration measured before issue 28 (bench/results/rollout_nvidia_h200_throughput.md,
# in git history before session 14).
LEGACY_CONFIG = DecodeKernelConfig(variant="legacy")
DEFAULT_CONFIG = DecodeKernelConfig()

# Candidates that bench/rollout/decode_attention_gpu.py times against each other; the winner's
# settings go into DEFAULT_CONFIG. Why these: at batch 256 one split gives 512 programs for
# 132 SMs, all resident at once only if 4 fit on an SM (shared memory: num_stages x K and V
# tiles of block_n x D bf16, 16 KiB a stage at block_n 64, D 64); fewer stages or smaller
# blocks fit more, more splits (programs_per_sm) give more programs and loads in flight.
BENCH_CONFIGS = {
    "legacy": LEGACY_CONFIG,
    "gqa": DEFAULT_CONFIG,
    "gqa_s2": DecodeKernelConfig(num_stages=2),
    "gqa_s4": DecodeKernelConfig(num_stages=4),
    "gqa_w2": DecodeKernelConfig(num_warps=2),
    "gqa_b32_s3": DecodeKernelConfig(block_n=32),
    "gqa_b128_w8_s2": DecodeKernelConfig(block_n=128, num_warps=8, num_stages=2),
    "gqa_pps4": DecodeKernelConfig(programs_per_sm=4.0),
    "gqa_pps8_s2": DecodeKernelConfig(programs_per_sm=8.0, num_stages=2),
}

# The compiled kernels of the last launch ({"split": ..., "merge": ...}; Triton's handles, None
# in the interpreter): the benchmark reads their shared memory and registers from them.
last_compiled: dict = {}


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

    @triton.jit
    def _split_kernel_gqa(
        Q,  # [B, H_q, 1, D], last dim contiguous; row b, head h at b * stride_qb + h * stride_qh
        K,  # [S, H_kv, L, D], last dim contiguous
        V,
        Pos,  # int64 [B]: the position each batch row writes (sees 0..Pos)
        Slot,  # int64 [B]: the cache slot each batch row reads
        Out,  # [B * H_kv, G, D] contiguous, activations' dtype (written when DIRECT)
        Part,  # float32 [B * H_kv, splits, G, D]: each split's normalised output (not DIRECT)
        Lse,  # float32 [B * H_kv, splits, G]: each split's log2-sum-exp2, -inf when empty
        stride_qb,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_kl,
        stride_vs,
        stride_vh,
        stride_vl,
        span,
        chunk,
        splits,
        qk_scale,  # softmax scale * log2(e): scores in the exp2 domain
        NUM_KV_HEADS: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        DIRECT: tl.constexpr,  # one split: write the output, no merge
        PRECISION: tl.constexpr,
    ):
        row = tl.program_id(0)  # batch row * H_kv + KV head
        split = tl.program_id(1)
        batch_row = row // NUM_KV_HEADS
        head = row % NUM_KV_HEADS
        slot = tl.load(Slot + batch_row)
        visible = tl.minimum(tl.load(Pos + batch_row) + 1, span)
        start = split * chunk
        end = tl.minimum(start + chunk, visible)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        is_head = offs_g < G
        q = tl.load(
            Q + batch_row * stride_qb + (head * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
            mask=is_head[:, None],
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
            v = tl.load(
                v_base + offs_n[:, None] * stride_vl + offs_d[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        has_keys = l_i > 0.0  # an empty split (starts past the row's length) has none
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        if DIRECT:
            tl.store(
                Out + (row * G + offs_g[:, None]) * D + offs_d[None, :],
                out.to(Out.dtype.element_ty),
                mask=is_head[:, None],
            )
        else:
            part = (row * splits + split) * G + offs_g
            tl.store(Part + part[:, None] * D + offs_d[None, :], out, mask=is_head[:, None])
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(Lse + part, lse, mask=is_head)

    @triton.jit
    def _merge_kernel_gqa(
        Part,
        Lse,
        Out,  # [B * H_kv, G, D] in the activations' dtype
        splits,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
    ):
        # One pass with online rescaling. Split 0 always holds position 0, so after it every
        # real head's running maximum is finite; empty splits (lse -inf) then weigh 0.
        row = tl.program_id(0)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        is_head = offs_g < G
        m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        total = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        for split in range(0, splits):
            part = (row * splits + split) * G + offs_g
            lse = tl.load(Lse + part, mask=is_head, other=0.0)  # padded rows: finite, unused
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            a = tl.load(
                Part + part[:, None] * D + offs_d[None, :], mask=is_head[:, None], other=0.0
            )
            total = total * alpha + w
            acc = acc * alpha[:, None] + w[:, None] * a
            m = m_new
        tl.store(
            Out + (row * G + offs_g[:, None]) * D + offs_d[None, :],
            (acc / total[:, None]).to(Out.dtype.element_ty),
            mask=is_head[:, None],
        )


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(
    rows: int, span: int, num_sms: int, config: DecodeKernelConfig
) -> tuple[int, int]:
    """(splits, chunk): enough programs to fill the GPU `programs_per_sm` times, each reading
    >= block_n positions; chunk (positions a split reads) is a multiple of block_n, and splits
    is re-derived from it so that no split starts at or past the span."""
    block = config.block_n
    wanted = math.ceil(config.programs_per_sm * num_sms / rows)
    splits = max(1, min(wanted, math.ceil(span / block), config.max_splits))
    chunk = math.ceil(math.ceil(span / splits) / block) * block
    if config.variant == "gqa":
        splits = math.ceil(span / chunk)
    return splits, chunk


def triton_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos_B: torch.Tensor,
    *,
    span: int,
    scale: float,
    slot_B: torch.Tensor | None = None,
    config: DecodeKernelConfig | None = None,
) -> torch.Tensor | None:
    """query [B, H_q, 1, D]; keys/values [S, H_kv, L, D]; pos_B, slot_B int64 [B] (slot_B None:
    row b reads slot b, B == S); returns [B, 1, H_q, D] (or None when Triton cannot run it).

    Batch row b, query head h attends to positions 0..min(pos_B[b], span - 1) of KV head
    h // (H_q // H_kv) of cache slot slot_B[b]. config None: DEFAULT_CONFIG.
    """
    if not available(query.device):
        return None
    D = query.shape[-1]
    if D & (D - 1) or D < 16 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        return None
    return run_decode_attention(
        query, keys, values, pos_B, span=span, scale=scale, slot_B=slot_B, config=config
    )


def run_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos_B: torch.Tensor,
    *,
    span: int,
    scale: float,
    slot_B: torch.Tensor | None = None,
    config: DecodeKernelConfig | None = None,
) -> torch.Tensor:
    """`triton_decode_attention` without its checks: CUDA tensors, or CPU tensors in a copy of
    this module imported under TRITON_INTERPRET=1 (the tests)."""
    config = DEFAULT_CONFIG if config is None else config
    B, Hq, _, D = query.shape
    if slot_B is None:
        slot_B = torch.arange(B, device=query.device)
    Hkv = keys.shape[1]
    G = Hq // Hkv
    if config.variant == "legacy":
        return _launch_legacy(query, keys, values, pos_B, slot_B, span, scale, config)
    if query.stride(-1) != 1:
        query = query.contiguous()
    G_PAD = max(MIN_ROWS, triton.next_power_of_2(G))
    rows = B * Hkv
    splits, chunk = choose_splits(rows, span, _num_sms(query.device), config)
    out = torch.empty(rows, G, D, device=query.device, dtype=query.dtype)
    direct = splits == 1
    f32 = dict(device=query.device, dtype=torch.float32)
    # With one split the scratch is never touched: the output stands in for both pointers.
    part = out if direct else torch.empty(rows, splits, G, D, **f32)
    lse = out if direct else torch.empty(rows, splits, G, **f32)
    last_compiled.clear()
    last_compiled["split"] = _split_kernel_gqa[(rows, splits)](
        query,
        keys,
        values,
        pos_B,
        slot_B,
        out,
        part,
        lse,
        query.stride(0),
        query.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        span,
        chunk,
        splits,
        scale * LOG2_E,
        NUM_KV_HEADS=Hkv,
        G=G,
        G_PAD=G_PAD,
        D=D,
        BLOCK=config.block_n,
        DIRECT=direct,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not direct:
        last_compiled["merge"] = _merge_kernel_gqa[(rows,)](
            part, lse, out, splits, G=G, G_PAD=G_PAD, D=D
        )
    return out.reshape(B, 1, Hq, D)


def _launch_legacy(query, keys, values, pos_B, slot_B, span, scale, config):
    """The kernel pair as measured before issue 28 (split kernel + merge kernel, always)."""
    S, Hq, _, D = query.shape  # S: batch rows (B)
    Hkv = keys.shape[1]
    G = Hq // Hkv
    G_PAD = max(MIN_ROWS, triton.next_power_of_2(G))
    rows = S * Hkv
    splits, chunk = choose_splits(rows, span, _num_sms(query.device), config)
    q = query.reshape(rows, G, D).contiguous()
    f32 = dict(device=query.device, dtype=torch.float32)
    acc = torch.empty(rows, splits, G_PAD, D, **f32)
    m = torch.empty(rows, splits, G_PAD, **f32)
    lse = torch.empty(rows, splits, G_PAD, **f32)
    out = torch.empty(rows, G, D, device=query.device, dtype=query.dtype)
    last_compiled.clear()
    last_compiled["split"] = _split_kernel[(rows, splits)](
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
        BLOCK=config.block_n,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    last_compiled["merge"] = _merge_kernel[(rows,)](
        acc, m, lse, out, SPLITS=splits, G=G, G_PAD=G_PAD, D=D
    )
    return out.reshape(S, 1, Hq, D)
