"""The split-K decode attention kernel (builtin/_decode_kernel.py), every variant, against
attention written out from its definition.

On CPU the kernels run in Triton's interpreter (in a child pytest with TRITON_INTERPRET=1;
needs the `triton` package, else skipped), in float32 and float16: the interpreter of Triton
3.9 computes bf16 dots wrongly. On CUDA the same cases run compiled in
bf16 at the engine's shapes.

Reference (float64): batch row b, query head h attends to positions 0..min(pos[b], span - 1)
of KV head h // (H_q / H_kv) in cache slot slot[b]; out = softmax(q k^T / sqrt(D)) v.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from yatt.rollout.builtin import _decode_kernel
from yatt.rollout.builtin._decode_kernel import (
    BENCH_CONFIGS,
    DEFAULT_CONFIG,
    LEGACY_CONFIG,
    DecodeKernelConfig,
    choose_splits,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Variants the tests run: every benchmark candidate, plus settings that force the paths a
# small case would not take (many splits with empty ones, a 16-position block).
CONFIGS = {
    **BENCH_CONFIGS,
    "gqa_many_splits": DecodeKernelConfig(block_n=16, programs_per_sm=64.0),
    "legacy_many_splits": DecodeKernelConfig(variant="legacy", block_n=16, programs_per_sm=64.0),
}


def reference_attention(q, k, v, pos, slot, span):
    """q [B, Hq, 1, D], k/v [S, Hkv, L, D] -> [B, 1, Hq, D] in float64, one (row, head) at a time."""
    B, Hq, _, D = q.shape
    group = Hq // k.shape[1]
    out = torch.empty(B, 1, Hq, D, dtype=torch.float64)
    for b in range(B):
        n = min(int(pos[b]) + 1, span)
        for h in range(Hq):
            keys = k[int(slot[b]), h // group, :n].double()
            values = v[int(slot[b]), h // group, :n].double()
            scores = keys @ q[b, h, 0].double() / math.sqrt(D)
            out[b, 0, h] = torch.softmax(scores, 0) @ values
    return out


def make_case(*, batch, num_slots, Hq, Hkv, D, span, L, dtype, device, seed):
    """Random q/k/v; positions past each row's visible length hold large values, so reading
    them (a length ignored, the span ignored) moves the output far outside the tolerance."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, Hq, 1, D, generator=g)
    k = torch.randn(num_slots, Hkv, L, D, generator=g)
    v = torch.randn(num_slots, Hkv, L, D, generator=g)
    slot = torch.randperm(num_slots, generator=g)[:batch]
    # Lengths: 1, the full span, past the span (an idle slot: clamped), and random in between.
    pos = torch.randint(0, span, (batch,), generator=g)
    # (A single row sees the whole span: with one position its output would not depend on q.)
    specials = [0, span - 1, L - 1] if batch > 1 else [span - 1]
    for b, p in enumerate(specials[:batch]):
        pos[b] = p
    for b in range(batch):
        n = min(int(pos[b]) + 1, span)
        k[slot[b], :, n:] = 30.0
        v[slot[b], :, n:] = 1e3
    to = dict(device=device)
    return (
        q.to(dtype).to(**to),
        k.to(dtype).to(**to),
        v.to(dtype).to(**to),
        pos.to(**to),
        slot.to(**to),
    )


# (batch, cache slots, Hq, Hkv, D, span, L): 0.5B heads (G 7), 1.5B heads (G 6, D 128),
# no grouping (G 1), one row, and a batch with more slots than rows.
INTERPRETER_SHAPES = [
    (1, 1, 14, 2, 64, 40, 48),
    (6, 9, 14, 2, 64, 96, 100),
    (4, 4, 12, 2, 128, 70, 80),
    (3, 5, 4, 4, 32, 33, 40),
]


# Triton decides when it is imported whether kernels (its own helpers too) are interpreted, so
# the interpreter cases run in a child pytest started with TRITON_INTERPRET=1; in this process
# they are skipped.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRETING, reason="runs in test_interpreter_cases_pass (a child with TRITON_INTERPRET=1)"
)


@pytest.mark.skipif(
    INTERPRETING or not HAS_TRITON,
    reason="needs the `triton` package (pip install triton) for its CPU interpreter",
)
# On a GPU the compiled kernels run the same cases in bf16 (below); the interpreter of the
# GPU machine's older Triton (torch 2.11's) cannot index a loop by a loaded scalar, which the
# compiler and Triton 3.9's interpreter can.
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the compiled kernels are tested")
def test_interpreter_cases_pass():
    env = dict(os.environ, TRITON_INTERPRET="1")
    args = [sys.executable, "-m", "pytest", __file__, "-x", "-q", "-k", "interpreted"]
    child = subprocess.run(
        [*args, "-p", "no:cacheprovider"], env=env, capture_output=True, text=True, timeout=900
    )
    report = child.stdout[-6000:] + child.stderr[-3000:]
    assert child.returncode == 0, report
    assert " passed" in child.stdout and " skipped" not in child.stdout, report


@interpreter_only
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", INTERPRETER_SHAPES, ids=str)
def test_interpreted_kernel_matches_attention_over_visible_positions(name, dtype, shape):
    batch, num_slots, Hq, Hkv, D, span, L = shape
    q, k, v, pos, slot = make_case(
        batch=batch, num_slots=num_slots, Hq=Hq, Hkv=Hkv, D=D, span=span, L=L, dtype=dtype,
        device="cpu", seed=batch * 7 + D,
    )  # fmt: skip
    config = CONFIGS[name]
    out = _decode_kernel.run_decode_attention(
        q, k, v, pos, span=span, scale=D**-0.5, slot_B=slot, config=config
    )
    assert out.shape == (batch, 1, Hq, D) and out.dtype == dtype
    atol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(
        out.double(), reference_attention(q, k, v, pos, slot, span), atol=atol, rtol=0
    )


@interpreter_only
def test_interpreted_kernel_reads_slot_b_without_slot_indices():
    # slot_B None: row b reads slot b.
    q, k, v, pos, slot = make_case(
        batch=4, num_slots=4, Hq=14, Hkv=2, D=64, span=64, L=64, dtype=torch.float32,
        device="cpu", seed=3,
    )  # fmt: skip
    k, v = k[slot], v[slot]  # cache slot b is the one make_case gave row b
    out = _decode_kernel.run_decode_attention(q, k, v, pos, span=64, scale=0.125)
    ref = reference_attention(q, k, v, pos, torch.arange(4), 64)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_choose_splits_on_hand_cases():
    # batch 256 x 2 KV heads = 512 programs >= 2 x 132 SMs: one split over the whole span.
    assert choose_splits(512, 640, 132, DEFAULT_CONFIG) == (1, 640)
    # batch 64 x 2 = 128 rows: ceil(264 / 128) = 3 splits; ceil(640 / 3) = 214 -> chunk 256
    # (a multiple of 64); 640 / 256 -> 3 splits of 256, 256, 128 positions.
    assert choose_splits(128, 640, 132, DEFAULT_CONFIG) == (3, 256)
    # 7 splits wanted over 640: chunk ceil(92 / 64) * 64 = 128, so 5 splits cover the span;
    # legacy kept the 7 (two empty programs), gqa launches 5.
    config = DecodeKernelConfig(programs_per_sm=7 * 128 / 132)
    assert choose_splits(128, 640, 132, config) == (5, 128)
    legacy = DecodeKernelConfig(variant="legacy", programs_per_sm=7 * 128 / 132)
    assert choose_splits(128, 640, 132, legacy) == (7, 128)
    # Never more than max_splits, never a split shorter than a block.
    assert choose_splits(1, 640, 132, DEFAULT_CONFIG) == (10, 64)
    assert choose_splits(1, 40, 132, DEFAULT_CONFIG) == (1, 64)
    assert choose_splits(1, 4096, 132, DEFAULT_CONFIG) == (16, 256)


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 128, 512, 4096])
@pytest.mark.parametrize("span", [1, 63, 64, 65, 200, 640, 4096])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_choose_splits_covers_the_span_without_empty_splits(rows, span, name):
    config = CONFIGS[name]
    splits, chunk = choose_splits(rows, span, 132, config)
    assert chunk % config.block_n == 0 and 1 <= splits <= config.max_splits
    assert splits * chunk >= span  # every visible position belongs to a split
    if config.variant == "gqa":
        assert (splits - 1) * chunk < span  # the last split starts inside the span


@pytest.mark.parametrize(
    ("field", "value"),
    [("variant", "fast"), ("block_n", 48), ("block_n", 8), ("num_warps", 3), ("num_stages", 0),
     ("programs_per_sm", 0.0), ("max_splits", 0)],
)  # fmt: skip
def test_bad_config_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"DecodeKernelConfig.{field}"):
        DecodeKernelConfig(**{field: value})


def test_engine_default_is_the_gqa_kernel():
    assert DEFAULT_CONFIG.variant == "gqa" and LEGACY_CONFIG.variant == "legacy"
    assert BENCH_CONFIGS["gqa"] == DEFAULT_CONFIG and BENCH_CONFIGS["legacy"] == LEGACY_CONFIG


# (batch, cache slots, Hq, Hkv, D, span, L): the engine's shapes, 0.5B and 1.5B heads.
CUDA_SHAPES = [
    (1, 1, 14, 2, 64, 640, 640),
    (64, 64, 14, 2, 64, 640, 640),
    (64, 256, 14, 2, 64, 512, 640),  # a bucket of 64 rows over a 256-slot cache
    (256, 256, 14, 2, 64, 640, 640),
    (64, 64, 12, 2, 128, 640, 640),
]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(INTERPRETING, reason="the compiled kernels, not the interpreter")
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
def test_cuda_kernel_matches_attention_in_bf16(name, shape):
    batch, num_slots, Hq, Hkv, D, span, L = shape
    q, k, v, pos, slot = make_case(
        batch=batch, num_slots=num_slots, Hq=Hq, Hkv=Hkv, D=D, span=span, L=L,
        dtype=torch.bfloat16, device="cuda", seed=batch + D,
    )  # fmt: skip
    out = _decode_kernel.triton_decode_attention(
        q, k, v, pos, span=span, scale=D**-0.5, slot_B=slot, config=CONFIGS[name]
    )
    assert out is not None and out.shape == (batch, 1, Hq, D) and out.dtype == torch.bfloat16
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), pos.cpu(), slot.cpu(), span)
    torch.testing.assert_close(out.double().cpu(), ref, atol=3e-2, rtol=0)
