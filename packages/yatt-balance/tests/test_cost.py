"""cost/flops_cost against closed forms counted independently."""

NUM_GPUS = 0

import numpy as np
import pytest

from yatt.balance import cost, flops_cost


def test_cost_closed_form():
    lengths = [0, 1, 10, 1000]
    np.testing.assert_array_equal(cost(lengths), [0, 1, 10, 1000])
    np.testing.assert_allclose(cost(lengths, linear=2.0, quadratic=0.5), [0, 2.5, 70, 502000])


def brute_force_flops(length, h, layers, ffn, heads, kv_heads, vocab, gated):
    """Counts matmul shapes one by one and causal (query, key) pairs by looping."""
    kv = h // heads * kv_heads
    mats = [(h, h), (h, kv), (h, kv), (h, h)] + [(h, ffn)] * (3 if gated else 2)
    per_layer = sum(2 * length * a * b for a, b in mats)
    pairs = sum(q + 1 for q in range(length))  # query q attends keys 0..q
    per_layer += pairs * 2 * h * 2  # scores q.k and the weighted sum of v, h each
    return layers * per_layer + 2 * length * h * vocab


@pytest.mark.parametrize("gated", [False, True], ids=["mlp", "swiglu"])
def test_flops_cost_matches_brute_force(gated):
    lengths = [0, 1, 3, 17]
    got = flops_cost(
        lengths,
        hidden_size=8,
        num_layers=3,
        ffn_hidden_size=12,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=11,
        is_gated_mlp=gated,
    )
    want = [brute_force_flops(n, 8, 3, 12, 4, 2, 11, gated) for n in lengths]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_flops_defaults_are_a_4h_mlp_and_full_kv():
    np.testing.assert_allclose(
        flops_cost([5], hidden_size=8, num_layers=2),
        [brute_force_flops(5, 8, 2, 32, 1, 1, 0, False)],
    )


def test_quadratic_share_depends_on_model_size():
    # Relative weight of a 32k sequence against a 1k one: attention matters more for a small
    # model, which a single hard-coded ratio would miss.
    def ratio(**shape):
        c = flops_cost([1024, 32768], **shape)
        return c[1] / c[0]

    small = ratio(
        hidden_size=896, num_layers=24, ffn_hidden_size=4864, num_heads=14, num_kv_heads=2
    )
    large = ratio(
        hidden_size=8192, num_layers=80, ffn_hidden_size=29568, num_heads=64, num_kv_heads=8
    )
    assert small > 1.5 * large > 32 * 1.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 0, "num_layers": 1}, "hidden_size must be >= 1"),
        (
            {"hidden_size": 8, "num_layers": 1, "num_heads": 3},
            "num_heads=3 must divide hidden_size=8",
        ),
        ({"hidden_size": 8, "num_layers": 1, "num_kv_heads": 2}, "num_kv_heads needs num_heads"),
        (
            {"hidden_size": 8, "num_layers": 1, "num_heads": 4, "num_kv_heads": 3},
            "must divide num_heads",
        ),
        ({"hidden_size": 8.0, "num_layers": 1}, "hidden_size must be an int"),
    ],
    ids=["hidden", "heads", "kv-alone", "kv-divide", "float"],
)
def test_flops_bad_shape(kwargs, match):
    with pytest.raises(ValueError, match=match):
        flops_cost([1], **kwargs)


def test_cost_bad_input():
    with pytest.raises(ValueError, match=r"lengths\[1\] is -1"):
        cost([1, -1])
    with pytest.raises(ValueError, match="quadratic must be a finite number >= 0"):
        cost([1], quadratic=-1.0)
