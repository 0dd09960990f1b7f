"""Batch: padding, unpadding, select, concat, device moves and validation."""

import numpy as np
import pytest
import torch

from yatt.core import Batch

NUM_GPUS = 0


def _rows():
    return [
        {
            "input_ids": [5, 6, 7],
            "loss_mask": [0, 1, 1],
            "reward": 1.0,
            "group_id": 0,
            "image": np.full((2, 2), 1, np.uint8),
            "prompt": "a",
        },
        {
            "input_ids": torch.tensor([8, 9]),
            "loss_mask": [0, 1],
            "reward": 0.0,
            "group_id": 0,
            "image": np.full((2, 2), 2, np.uint8),
            "prompt": "b",
        },
        {
            "input_ids": [1, 2, 3, 4, 5],
            "loss_mask": [0, 0, 1, 1, 1],
            "reward": 0.5,
            "group_id": 1,
            "image": np.full((2, 2), 3, np.uint8),
            "prompt": "c",
        },
    ]


def test_from_samples_pads_right_and_classifies_fields():
    batch = Batch.from_samples(_rows(), token_keys=["input_ids", "loss_mask"])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [1, 2, 3, 4, 5]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1] * 5]
    assert batch.lengths.tolist() == [3, 2, 5] and batch.num_tokens == 10
    assert batch.samples["reward"].dtype == torch.float32
    assert batch.samples["group_id"].dtype == torch.int64
    assert set(batch.meta) == {"image", "prompt"} and batch["prompt"] == ["a", "b", "c"]


def test_ragged_tensors_stay_metadata_and_same_shape_tensors_stack():
    rows = _rows()
    for i, row in enumerate(rows):
        row["pixels"] = torch.zeros(3, 2 + i)  # images of different sizes
        row["embedding"] = torch.full((4,), float(i))
    batch = Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])
    assert batch.meta["pixels"][2].shape == (3, 4) and batch.meta["pixels"][0] is rows[0]["pixels"]
    assert batch.samples["embedding"].shape == (3, 4)


def test_to_samples_round_trips():
    batch = Batch.from_samples(_rows(), token_keys=["input_ids", "loss_mask"])
    rows = batch.to_samples()
    assert [r["input_ids"].tolist() for r in rows] == [[5, 6, 7], [8, 9], [1, 2, 3, 4, 5]]
    again = Batch.from_samples(rows, token_keys=batch.token_keys)
    for key in batch.tokens:
        assert torch.equal(again[key], batch[key])
    for key in batch.samples:
        assert torch.equal(again[key], batch[key])
    assert again["prompt"] == batch["prompt"]


def test_select_trims_width_and_accepts_masks():
    batch = Batch.from_samples(_rows(), token_keys=["input_ids", "loss_mask"])
    picked = batch.select([1, 0])
    assert picked["input_ids"].tolist() == [[8, 9, 0], [5, 6, 7]]
    assert picked["prompt"] == ["b", "a"] and picked["reward"].tolist() == [0.0, 1.0]
    masked = batch.select(torch.tensor([False, False, True]))
    assert masked["prompt"] == ["c"] and masked["input_ids"].shape == (1, 5)
    empty = batch.select([])
    assert len(empty) == 0 and set(empty.keys()) == set(batch.keys())


def test_concat_pads_to_longest():
    batch = Batch.from_samples(_rows(), token_keys=["input_ids", "loss_mask"])
    joined = Batch.concat([batch.select([1]), batch.select([2, 0])])
    assert joined["input_ids"].tolist() == [[8, 9, 0, 0, 0], [1, 2, 3, 4, 5], [5, 6, 7, 0, 0]]
    assert joined["prompt"] == ["b", "c", "a"]
    with pytest.raises(ValueError, match="fields"):
        other = batch.select([0])
        other.samples["extra"] = torch.zeros(1)
        Batch.concat([batch, other])


def test_unpad_and_with_packed_are_inverse():
    batch = Batch.from_samples(_rows(), token_keys=["input_ids", "loss_mask"])
    packed, cu = batch.unpad()
    assert cu.tolist() == [0, 3, 5, 10]
    assert packed["input_ids"].tolist() == [5, 6, 7, 8, 9, 1, 2, 3, 4, 5]
    packed["input_ids"] = packed["input_ids"] * 10
    restored = batch.with_packed(packed, cu)
    assert restored["input_ids"].tolist() == [
        [50, 60, 70, 0, 0],
        [80, 90, 0, 0, 0],
        [10, 20, 30, 40, 50],
    ]


def test_to_moves_tensors_and_shares_meta():
    batch = Batch.from_samples(_rows(), token_keys=["input_ids", "loss_mask"])
    moved = batch.to("meta")
    assert moved["input_ids"].device.type == "meta" and moved["reward"].device.type == "meta"
    assert all(a is b for a, b in zip(moved["image"], batch["image"], strict=True))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        pytest.param(
            lambda r: r[1].update(loss_mask=[1, 1, 1]), "one entry per input id", id="token-length"
        ),
        pytest.param(lambda r: r[0].pop("prompt"), "keys", id="ragged-keys"),
        pytest.param(lambda r: r[0].update(input_ids=[]), "non-empty", id="empty-ids"),
        pytest.param(
            lambda r: [x.update(attention_mask=[1]) for x in r], "attention_mask", id="given-mask"
        ),
    ],
)
def test_from_samples_rejects_bad_rows(edit, match):
    rows = _rows()
    edit(rows)
    with pytest.raises(ValueError, match=match):
        Batch.from_samples(rows, token_keys=["input_ids", "loss_mask"])


def test_validate_catches_direct_edits():
    batch = Batch.from_samples(_rows(), token_keys=["input_ids"])
    batch.tokens["old_logprobs"] = torch.zeros(3, 4)  # wrong width
    with pytest.raises(ValueError, match="old_logprobs"):
        batch.validate()
    batch = Batch.from_samples(_rows(), token_keys=["input_ids"])
    batch.samples["prompt"] = torch.zeros(3)
    with pytest.raises(ValueError, match="more than one"):
        batch.select([0])
    with pytest.raises(KeyError, match="fields"):
        _ = batch["nope"]
    with pytest.raises(ValueError, match="like="):
        Batch.from_samples([])
