"""ShardedLoader: disjoint shards, deterministic epochs, exact resume, counted skips, flat memory;
over JSONL, Parquet and Hugging Face `datasets` folders (save_to_disk)."""

import json
import logging
import tracemalloc

import pytest

from yatt.core import ROW_INDEX_KEY, ShardedLoader

NUM_GPUS = 0


def _write_jsonl(path, rows, *, blank_lines=False):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
            if blank_lines:
                f.write("   \n")
    return path


def _write_parquet(path, rows, row_group_size):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def _write_hf_dataset(path, rows, *, split=None, num_shards=1):
    """A `datasets` save_to_disk folder (a DatasetDict with `split` when given); its path for
    the loader (the split's folder)."""
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(rows)
    if split is None:
        dataset.save_to_disk(str(path), num_shards=num_shards)
        return path
    other = "test" if split != "test" else "train"
    splits = {split: dataset, other: dataset.select(range(min(3, len(rows))))}
    datasets.DatasetDict(splits).save_to_disk(str(path), num_shards={split: num_shards, other: 1})
    return path / split


def _rows(n):
    return [{"prompt": f"question {i}", "answer": str(i)} for i in range(n)]


@pytest.fixture(params=["jsonl", "parquet", "jsonl-blank-lines", "hf-dataset", "hf-split"])
def dataset(request, tmp_path):
    rows = _rows(23)
    if request.param == "parquet":
        return _write_parquet(tmp_path / "d.parquet", rows, row_group_size=5)
    if request.param == "hf-dataset":
        return _write_hf_dataset(tmp_path / "hf", rows, num_shards=3)
    if request.param == "hf-split":
        return _write_hf_dataset(tmp_path / "hf", rows, split="train")
    return _write_jsonl(tmp_path / "d.jsonl", rows, blank_lines=request.param.endswith("lines"))


def _epoch_indices(path, rank, world_size, seed=0, batch_size=2):
    loader = ShardedLoader(path, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed)
    out = []
    for _ in range(loader.num_local_rows // batch_size):
        out += [row[ROW_INDEX_KEY] for row in loader.next_batch()]
    return out, loader


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shards_are_disjoint_and_cover_the_epoch(dataset, world_size):
    per_rank = [_epoch_indices(dataset, r, world_size, batch_size=1)[0] for r in range(world_size)]
    flat = [i for shard in per_rank for i in shard]
    assert len(flat) == len(set(flat)) == (23 // world_size) * world_size
    assert all(len(shard) == 23 // world_size for shard in per_rank)
    # Rows carry their own content, matched to their index.
    loader = ShardedLoader(dataset, batch_size=3, rank=0, world_size=world_size)
    for row in loader.next_batch():
        assert row["prompt"] == f"question {row[ROW_INDEX_KEY]}"


def test_each_epoch_has_its_own_deterministic_order(dataset):
    loader = ShardedLoader(dataset, batch_size=11, rank=0, world_size=2, seed=3)
    epoch0 = [r[ROW_INDEX_KEY] for r in loader.next_batch()]
    epoch1 = [r[ROW_INDEX_KEY] for r in loader.next_batch()]
    assert loader.epoch == 2 and epoch0 != epoch1
    again = ShardedLoader(dataset, batch_size=11, rank=0, world_size=2, seed=3)
    assert [r[ROW_INDEX_KEY] for r in again.next_batch()] == epoch0
    other_seed = ShardedLoader(dataset, batch_size=11, rank=0, world_size=2, seed=4)
    assert [r[ROW_INDEX_KEY] for r in other_seed.next_batch()] != epoch0
    plain = ShardedLoader(dataset, batch_size=4, rank=1, world_size=2, should_shuffle=False)
    assert [r[ROW_INDEX_KEY] for r in plain.next_batch()] == [1, 3, 5, 7]


def test_resume_is_exact_across_epoch_boundaries(dataset):
    loader = ShardedLoader(dataset, batch_size=4, rank=1, world_size=2, seed=7)
    for _ in range(2):
        loader.next_batch()
    state = loader.state_dict()
    expected = [[r[ROW_INDEX_KEY] for r in loader.next_batch()] for _ in range(5)]
    resumed = ShardedLoader(dataset, batch_size=4, rank=1, world_size=2, seed=0)
    resumed.load_state_dict(state)
    assert resumed.seed == 7
    assert [[r[ROW_INDEX_KEY] for r in resumed.next_batch()] for _ in range(5)] == expected


def test_resume_rejects_a_different_world(dataset):
    state = ShardedLoader(dataset, batch_size=2, world_size=2).state_dict()
    with pytest.raises(ValueError, match="world_size"):
        ShardedLoader(dataset, batch_size=2, world_size=3).load_state_dict(state)


def test_bad_rows_are_counted_and_skipped(tmp_path, caplog):
    rows = [
        {"prompt": "ok 0"},
        "{not json",
        {"question": "no prompt field"},
        {"prompt": ""},
        {"prompt": "x" * 50},
        ["a", "list"],
        {"prompt": "ok 6"},
    ]
    # Row 0 (the first row of rank 0 when not shuffled) is valid: the key check passes.
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    loader = ShardedLoader(
        path, batch_size=7, should_shuffle=False, max_prompt_tokens=10, count_tokens=len
    )
    with caplog.at_level(logging.WARNING, logger="yatt.core"):
        batch = loader.next_batch()
    assert [r["prompt"] for r in batch] == ["ok 0", "ok 6"]
    assert loader.num_skipped == 5
    assert sum(1 for k in loader.skipped if k.startswith("invalid JSON")) == 1
    assert loader.skipped["no 'prompt' field"] == 1
    assert loader.skipped["prompt longer than max_prompt_tokens=10"] == 1
    assert sum("skipping dataset row" in r.message for r in caplog.records) == 5
    # Fixed metric keys: every cause present, so ranks reduce the same keys.
    assert loader.skipped_by_cause() == {
        "unreadable": 2,  # bad JSON and a JSON list
        "no_prompt": 2,  # no field, and an empty one
        "bad_prompt": 0,
        "too_long": 1,
        "no_image": 0,
        "bad_image": 0,
        "image_too_large": 0,
        "no_field": 0,
        "bad_field": 0,
        "too_deep": 0,
    }


def test_missing_image_is_a_skip(tmp_path):
    path = _write_jsonl(
        tmp_path / "img.jsonl", [{"prompt": "a", "image": "xx"}, {"prompt": "b", "image": None}]
    )
    # should_open_images=False: the field passes as stored (a payload the caller decodes).
    loader = ShardedLoader(
        path, batch_size=2, image_key="image", should_shuffle=False, should_open_images=False
    )
    assert [(r["prompt"], r["image"]) for r in loader.next_batch()] == [("a", "xx")]
    assert loader.skipped["no 'image' field"] == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param(
            {"prompt_key": "question"},
            "prompt_key='question' is not a field of the first 16 rows",
            id="wrong-prompt-key",
        ),
        pytest.param({"image_key": "img"}, "image_key='img'", id="wrong-image-key"),
        pytest.param({"batch_size": 0}, "batch_size", id="zero-batch"),
        pytest.param({"rank": 2, "world_size": 2}, "rank", id="rank-out-of-range"),
        pytest.param({"max_prompt_tokens": 5}, "count_tokens", id="length-without-counter"),
        pytest.param({"world_size": 100, "rank": 0}, "fewer than", id="more-ranks-than-rows"),
    ],
)
def test_bad_configuration_fails_at_construction(tmp_path, kwargs, match):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(5))
    kwargs = {"batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        ShardedLoader(path, **kwargs)


def test_missing_or_unknown_dataset_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ShardedLoader(tmp_path / "nope.jsonl", batch_size=1)
    (tmp_path / "d.csv").write_text("prompt\na\n")
    with pytest.raises(ValueError, match=r"\.jsonl or all \.parquet"):
        ShardedLoader(tmp_path / "d.csv", batch_size=1)


def test_directory_of_parquet_shards(tmp_path):
    rows = _rows(12)
    (tmp_path / "ds").mkdir()
    _write_parquet(tmp_path / "ds" / "part-0.parquet", rows[:5], row_group_size=2)
    _write_parquet(tmp_path / "ds" / "part-1.parquet", rows[5:], row_group_size=3)
    loader = ShardedLoader(tmp_path / "ds", batch_size=12, should_shuffle=False, columns=["prompt"])
    got = loader.next_batch()
    assert [r["prompt"] for r in got] == [f"question {i}" for i in range(12)]
    assert "answer" not in got[0]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf"])
def test_rank_memory_stays_flat_as_ranks_grow(tmp_path, fmt):
    """Weak scaling: per-rank batch fixed, dataset and ranks grow together; the payload bytes a
    rank materialises stay the same instead of growing with the world."""
    payload = "x" * 200_000
    peaks = []
    for world_size in (1, 4):
        rows = [{"prompt": f"q{i}", "image": payload} for i in range(8 * world_size)]
        if fmt == "parquet":
            path = _write_parquet(tmp_path / f"{world_size}.parquet", rows, row_group_size=1)
        elif fmt == "hf":
            path = _write_hf_dataset(tmp_path / f"{world_size}-hf", rows, num_shards=world_size)
        else:
            path = _write_jsonl(tmp_path / f"{world_size}.jsonl", rows)
        loader = ShardedLoader(path, batch_size=8, rank=world_size - 1, world_size=world_size)
        tracemalloc.start()
        batch = loader.next_batch()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert len(batch) == 8 and loader.num_rows_parsed == 9  # 8 + the first-row check
    assert peaks[1] < 1.3 * peaks[0], peaks


def test_a_shard_with_no_usable_row_stops_with_the_skip_counts(tmp_path):
    path = tmp_path / "empty_prompts.jsonl"
    _write_jsonl(path, [{"prompt": "", "answer": str(i)} for i in range(12)])
    loader = ShardedLoader(path, batch_size=4, rank=1, world_size=2, seed=0)
    assert loader.next_batch() == []  # 4 of the rank's 6 rows, all unusable: draw again
    assert loader.next_batch() == []  # into the second epoch: a usable row could still come
    with pytest.raises(
        ValueError, match=r"empty_prompts.jsonl.*epoch of its 6 rows.*no_prompt 12 .*no text"
    ):
        loader.next_batch()


def test_a_usable_row_resets_the_unusable_count(tmp_path):
    path = tmp_path / "mostly_empty.jsonl"
    rows = [{"prompt": "" if i % 6 else "ok"} for i in range(12)]  # one usable row in six
    _write_jsonl(path, rows)
    loader = ShardedLoader(path, batch_size=3, seed=0, should_shuffle=False)
    usable = sum(len(loader.next_batch()) for _ in range(20))  # five epochs, never an error
    assert usable == 10 and loader.num_skipped == 50


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_start_up_check_does_not_depend_on_the_seed(tmp_path, seed):
    # One row lacks the prompt: every seed accepts the file (the row is skipped when drawn).
    rows = _rows(6)
    rows[2] = {"answer": "x"}
    path = _write_jsonl(tmp_path / "one_bad_row.jsonl", rows)
    loader = ShardedLoader(path, batch_size=6, seed=seed)
    assert len(loader.next_batch()) == 5 and loader.num_skipped == 1


def test_required_keys_skip_rows_without_a_usable_value(tmp_path):
    rows = [
        {"prompt": "a", "answer": "1"},
        {"prompt": "b", "answer": 7},  # a number is usable (the trainer reads it as text)
        {"prompt": "c"},
        {"prompt": "d", "answer": None},
        {"prompt": "e", "answer": [1, 2]},
        {"prompt": "f", "answer": True},
    ]
    path = _write_jsonl(tmp_path / "answers.jsonl", rows)
    loader = ShardedLoader(path, batch_size=6, should_shuffle=False, required_keys=["answer"])
    assert [r["prompt"] for r in loader.next_batch()] == ["a", "b"]
    assert loader.skipped_by_cause()["no_field"] == 4
    assert loader.skipped["no 'answer' field with a string or number"] == 4


def test_a_required_key_no_row_has_fails_at_construction(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(5))
    with pytest.raises(ValueError, match=r"required_keys='solution' is not a field.*'answer'"):
        ShardedLoader(path, batch_size=2, required_keys=["solution"])


@pytest.mark.parametrize("seed", [0, 7])
def test_first_rows_are_the_files_first_usable_rows_whatever_the_seed(tmp_path, seed):
    rows = _rows(6)
    rows[0] = {"prompt": ""}  # unusable: left out, not counted
    rows[2] = {"prompt": "x" * 50}  # too long
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    loader = ShardedLoader(
        path, batch_size=2, seed=seed, rank=1, world_size=2, max_prompt_tokens=20, count_tokens=len
    )
    first = loader.first_rows(3)
    assert [r["prompt"] for r in first] == ["question 1", "question 3", "question 4"]
    assert [r[ROW_INDEX_KEY] for r in first] == [1, 3, 4]
    assert loader.num_skipped == 0 and loader.state_dict()["position"] == 0


def test_hf_dataset_columns_and_row_values(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": i, "extra": [i, i]} for i in range(6)]
    path = _write_hf_dataset(tmp_path / "hf", rows, split="validation", num_shards=2)
    loader = ShardedLoader(path, batch_size=6, should_shuffle=False, required_keys=["answer"])
    assert [{k: r[k] for k in ("prompt", "answer", "extra")} for r in loader.next_batch()] == rows
    loader = ShardedLoader(path, batch_size=2, should_shuffle=False, columns=["prompt"])
    assert loader.next_batch() == [
        {"prompt": "q0", ROW_INDEX_KEY: 0},
        {"prompt": "q1", ROW_INDEX_KEY: 1},
    ]
    with pytest.raises(ValueError, match=r"\['nope'\] are not columns"):
        ShardedLoader(path, batch_size=1, columns=["prompt", "nope"])


def test_a_dataset_dict_root_names_its_splits(tmp_path):
    split = _write_hf_dataset(tmp_path / "hf", _rows(5), split="train")
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train', 'test'\].*hf/train"):
        ShardedLoader(split.parent, batch_size=1)


def test_hf_dataset_without_the_datasets_package(tmp_path, monkeypatch):
    path = _write_hf_dataset(tmp_path / "hf", _rows(5))
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'yatt-core\[datasets\]'"):
        ShardedLoader(path, batch_size=1)


def test_an_undecodable_hf_row_is_a_counted_skip(tmp_path):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("PIL")
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (2, 2), "red").save(png, format="PNG")
    images = [{"bytes": png.getvalue(), "path": None}] * 4
    images[2] = {"bytes": b"not an image", "path": None}
    rows = {"prompt": [f"q{i}" for i in range(4)], "image": images}
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image()})
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "hf"))
    # Without image_key, datasets decodes the Image column, as `dataset[i]` does.
    loader = ShardedLoader(tmp_path / "hf", batch_size=4, should_shuffle=False)
    got = loader.next_batch()
    assert [r[ROW_INDEX_KEY] for r in got] == [0, 1, 3]
    assert got[0]["image"].size == (2, 2)
    assert loader.skipped_by_cause()["unreadable"] == 1
    # With image_key, the loader opens that column itself: the damaged image is a bad_image.
    loader = ShardedLoader(tmp_path / "hf", batch_size=4, should_shuffle=False, image_key="image")
    assert [r[ROW_INDEX_KEY] for r in loader.next_batch()] == [0, 1, 3]
    assert loader.skipped_by_cause()["bad_image"] == 1
