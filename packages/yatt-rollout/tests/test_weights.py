NUM_GPUS = 0

import pytest
import torch

from yatt.rollout import iter_buckets, map_names


def test_buckets_respect_the_byte_limit_and_keep_order():
    pairs = [
        (f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 20, 5, 40, 1])
    ]
    buckets = list(iter_buckets(iter(pairs), bucket_bytes=100))  # 25 floats per bucket
    assert [[n for n, _ in b] for b in buckets] == [["t0"], ["t1", "t2"], ["t3"], ["t4"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in pairs]


def test_buckets_consume_the_source_lazily():
    pulled = []

    def source():
        for i in range(6):
            pulled.append(i)
            yield f"t{i}", torch.zeros(4)

    buckets = iter_buckets(source(), bucket_bytes=32)  # two 16-byte tensors per bucket
    first = next(buckets)
    assert [n for n, _ in first] == ["t0", "t1"]
    assert len(pulled) <= 3, pulled  # the third pair closes the first bucket; no more is read


def test_map_names_can_split_rename_and_drop():
    def mapper(name, tensor):
        if name == "drop":
            return []
        if name == "fused":
            a, b = tensor.split(1)
            return [("a", a), ("b", b)]
        return [("x." + name, tensor)]

    out = list(
        map_names(
            [("fused", torch.arange(2.0)), ("drop", torch.zeros(1)), ("w", torch.ones(1))], mapper
        )
    )
    assert [n for n, _ in out] == ["a", "b", "x.w"]
    assert out[1][1].item() == 1.0


def test_an_offloaded_placeholder_is_refused_with_the_fix():
    pairs = [("model.norm.weight", torch.ones(4)), ("model.embed_tokens.weight", torch.empty(0))]
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' with shape \(0,\).*onload"):
        list(iter_buckets(iter(pairs), bucket_bytes=1 << 20))
