NUM_GPUS = 0

import pytest
import torch

from yatt.placement import offload, offloaded_named_parameters, onload
from yatt.rollout import iter_buckets, map_names
from yatt.rollout._weights import copy_bucket, named_targets


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


def _offloaded_as_on_cuda(model: torch.nn.Module) -> None:
    """offload() as it goes on CUDA, on the CPU: each parameter keeps an empty placeholder and
    its values wait in offload's host copy (on CPU, offload would swap the copy in instead)."""
    offload(model)
    for param in model.parameters():
        param.data = torch.empty(0, dtype=param.dtype)


def _trainer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.ModuleDict(
        {"embed_tokens": torch.nn.Embedding(16, 4), "norm": torch.nn.LayerNorm(4)}
    )


def test_an_offloaded_placeholder_is_refused_with_the_fix():
    trainer = _trainer()
    _offloaded_as_on_cuda(trainer)
    with pytest.raises(
        ValueError,
        match=r"'embed_tokens.weight' with shape \(0,\).*Onload.*offloaded_named_parameters",
    ):
        list(iter_buckets(trainer.named_parameters(), bucket_bytes=1 << 20))
    onload(trainer)


def test_an_offloaded_trainer_syncs_from_its_host_copies():
    trainer = _trainer()
    want = {name: p.detach().clone() for name, p in trainer.named_parameters()}
    _offloaded_as_on_cuda(trainer)
    served = _trainer(seed=1)  # the engine's model, with other weights
    targets = named_targets(served)
    buckets = list(iter_buckets(offloaded_named_parameters(trainer), bucket_bytes=64))
    assert len(buckets) > 1  # streamed in parts: one bucket of references at a time
    for bucket in buckets:
        copy_bucket(targets, bucket)
    for name, value in served.named_parameters():
        assert torch.equal(value, want[name]), name
    onload(trainer)


def test_a_tensor_that_is_empty_for_real_is_synced():
    pairs = [("model.norm.weight", torch.ones(4)), ("model.prefix", torch.empty(0))]
    buckets = list(iter_buckets(iter(pairs), bucket_bytes=1 << 20))
    assert [n for b in buckets for n, _ in b] == ["model.norm.weight", "model.prefix"]


@pytest.mark.parametrize("bucket_bytes", [0, -1, 1.5, True])
def test_a_bucket_size_that_holds_nothing_is_refused(bucket_bytes):
    with pytest.raises(ValueError, match=r"bucket_bytes=.*must be a positive int"):
        list(iter_buckets(iter([("w", torch.zeros(2))]), bucket_bytes=bucket_bytes))
