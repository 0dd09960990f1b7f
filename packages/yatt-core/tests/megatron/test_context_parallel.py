NUM_GPUS = 0

"""The context-parallel split and attention (yatt.core.policy.megatron._context_parallel) in one
process: the load-balanced chunks against Megatron's published rule, their inverse, and each
rank's attention against full causal attention. Plain torch (no megatron-core)."""

import pytest
import torch

from yatt.core.policy.megatron._context_parallel import (
    cp_attention,
    cp_chunks,
    split_for_cp,
    unsplit_from_cp,
)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_chunks_pair_an_early_with_a_late_chunk(cp_size):
    # Megatron's rule (get_batch_on_this_cp_rank): 2 x cp chunks, rank r holds r and 2cp-1-r.
    held = [cp_chunks(cp_size, r) for r in range(cp_size)]
    assert sorted(i for pair in held for i in pair) == list(range(2 * cp_size))
    assert held[0] == (0, 2 * cp_size - 1)
    # Causal work of chunk i is ~ (i + 1): every rank gets the same total, 2 cp + 1.
    assert {a + b + 2 for a, b in held} == {2 * cp_size + 1}


def test_split_gives_the_hand_built_chunks_and_unsplit_restores_the_sequence():
    x = torch.arange(16).view(2, 8)  # 2 rows, 8 positions, cp=2: chunks of 2
    assert split_for_cp(x, 2, 0).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert split_for_cp(x, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    parts = [split_for_cp(x, 2, r) for r in range(2)]
    assert torch.equal(unsplit_from_cp(parts), x)
    with pytest.raises(ValueError, match="not a multiple of 2 x cp_size = 4"):
        split_for_cp(torch.zeros(1, 6), 2, 0)


@pytest.mark.parametrize(("cp_size", "num_kv_heads"), [(2, 4), (3, 2)])
def test_each_rank_attention_equals_its_rows_of_full_causal_attention(cp_size, num_kv_heads):
    gen = torch.Generator().manual_seed(0)
    length, batch, heads, dim = 4 * cp_size, 2, 4, 8
    q, k, v = (
        torch.randn(length, batch, h, dim, generator=gen)
        for h in (heads, num_kv_heads, num_kv_heads)
    )
    # Full causal attention, [s, b, h, d] -> [b, h, s, d] and back.
    full = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)),
        is_causal=True,
        enable_gqa=num_kv_heads != heads,
    )
    full = full.permute(2, 0, 1, 3).reshape(length, batch, heads * dim)
    for rank in range(cp_size):
        got = cp_attention(
            split_for_cp(q, cp_size, rank, dim=0),
            k,
            v,
            cp_size=cp_size,
            cp_rank=rank,
            scale=dim**-0.5,
        )
        want = split_for_cp(full, cp_size, rank, dim=0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
