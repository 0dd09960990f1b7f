"""Every row's cost is bounded before the costly step, whatever the source and field shape:
a `datasets` column holding a list of images is checked (bytes, then the header's pixels)
before anything decodes it; a Parquet row has a byte cap and its row group is decompressed
once, not per draw; text a tokenizer would raise on, an image path the OS refuses and a row
nested past what a worker can take are counted skips."""

NUM_GPUS = 0

import io
import json
import time

import pytest

from yatt.core import ShardedLoader

MAX_ROW_DEPTH = 64  # yatt.core.data._loader.MAX_ROW_DEPTH


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _png(width, height, *, noise=False) -> bytes:
    import numpy as np
    from PIL import Image

    if noise:  # incompressible: the file is as large as its pixels
        pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
        image = Image.fromarray(pixels)
    else:  # a small file of many pixels
        image = Image.new("L", (width, height))
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=0 if noise else 9)
    return out.getvalue()


@pytest.fixture
def no_datasets_decoding(monkeypatch):
    """datasets' Image decoding made to fail loudly: a test passes only if nothing decodes."""
    datasets = pytest.importorskip("datasets")

    def refuse(self, value, token_per_repo_id=None):
        raise AssertionError("datasets decoded an image before the loader's caps")

    monkeypatch.setattr(datasets.Image, "decode_example", refuse)
    return datasets


def _save_image_lists(datasets, path, images_per_row):
    features = datasets.Features(
        {"prompt": datasets.Value("string"), "images": datasets.List(datasets.Image())}
    )
    rows = {
        "prompt": [f"q{i}" for i in range(len(images_per_row))],
        "images": [[{"bytes": b, "path": None} for b in row] for row in images_per_row],
    }
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(path))
    return path


def test_a_datasets_list_of_big_pixel_images_is_refused_by_the_pixel_cap_undecoded(
    tmp_path, no_datasets_decoding
):
    big = _png(4000, 4000)  # 16 M pixels in a file of a few KB
    assert len(big) < 100_000
    small = _png(8, 8)
    path = _save_image_lists(
        no_datasets_decoding, tmp_path / "hf", [[big, big]] * 3 + [[small, small]]
    )
    loader = ShardedLoader(
        path, batch_size=4, image_key="images", max_image_pixels=1_000_000, should_shuffle=False
    )
    started = time.perf_counter()
    rows = loader.next_batch()
    assert time.perf_counter() - started < 5  # headers only: decoding 6 of them took longer
    assert [r["prompt"] for r in rows] == ["q3"]
    assert [image.size for image in rows[0]["images"]] == [(8, 8), (8, 8)]
    assert loader.skipped_by_cause()["image_too_large"] == 3
    # Nothing was cached beside the dataset (a cast would write a copy of it).
    assert not list(path.glob("cache-*.arrow"))


def test_a_36_mb_image_in_a_datasets_list_is_refused_by_the_byte_cap(
    tmp_path, no_datasets_decoding
):
    huge = _png(3500, 3500, noise=True)
    assert len(huge) > 36_000_000
    path = _save_image_lists(
        no_datasets_decoding, tmp_path / "hf", [[_png(8, 8), huge], [_png(8, 8)]]
    )
    loader = ShardedLoader(path, batch_size=2, image_key="images", should_shuffle=False)
    rows = loader.next_batch()
    assert [r["prompt"] for r in rows] == ["q1"]
    assert loader.skipped_by_cause()["image_too_large"] == 1
    assert "image 1: inline image of" in next(iter(loader.skipped))


def _write_parquet(path, rows, row_group_size=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def test_a_parquet_row_over_the_byte_cap_is_skipped_as_too_long(tmp_path):
    rows = [{"prompt": "a" * 2000, "answer": "1"}] + [
        {"prompt": f"{i}+1=", "answer": "2"} for i in range(3)
    ]
    path = _write_parquet(tmp_path / "rows.parquet", rows)
    loader = ShardedLoader(path, batch_size=4, should_shuffle=False, max_row_bytes=1000)
    assert [r["prompt"] for r in loader.next_batch()] == ["0+1=", "1+1=", "2+1="]
    assert loader.skipped_by_cause()["too_long"] == 1
    assert "a Parquet row of" in next(iter(loader.skipped))


def test_a_parquet_row_group_is_decompressed_once_across_draws(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    rows = [{"prompt": f"{i}+1="} for i in range(40)]
    path = _write_parquet(tmp_path / "rows.parquet", rows, row_group_size=20)
    reads = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile,
        "read_row_group",
        lambda self, i, *a, **k: reads.append(i) or real(self, i, *a, **k),
    )
    loader = ShardedLoader(path, batch_size=5, seed=0)
    for _ in range(8):  # a whole epoch and more, in draws of 5 across both groups
        assert len(loader.next_batch()) == 5
    assert sorted(reads) == [0, 1]


def test_a_lone_surrogate_in_a_required_field_is_a_counted_bad_field(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "\\ud800"}\n{"prompt": "2+2=", "answer": "4"}\n')
    loader = ShardedLoader(path, batch_size=2, should_shuffle=False, required_keys=["answer"])
    assert [r["answer"] for r in loader.next_batch()] == ["4"]
    assert loader.skipped_by_cause()["bad_field"] == 1
    assert [r["answer"] for r in loader.first_rows()] == ["4"]  # start-up checks never see it


def test_an_image_path_with_a_nul_byte_is_a_counted_bad_image(tmp_path):
    _write_jsonl(
        tmp_path / "rows.jsonl",
        [{"prompt": "a", "image": "x\u0000.png"}, {"prompt": "b", "image": "y.png"}],
    )
    (tmp_path / "y.png").write_bytes(_png(4, 4))
    loader = ShardedLoader(
        tmp_path / "rows.jsonl", batch_size=2, image_key="image", should_shuffle=False
    )
    assert [r["prompt"] for r in loader.next_batch()] == ["b"]
    assert loader.skipped_by_cause()["bad_image"] == 1
    assert "NUL byte" in next(iter(loader.skipped))


def test_a_row_nested_900_deep_is_a_counted_skip_at_load(tmp_path):
    deep = "[" * 900 + "]" * 900
    path = tmp_path / "rows.jsonl"
    path.write_text(
        f'{{"prompt": "1+1=", "extra": {deep}}}\n'
        f'{{"prompt": "2+2=", "extra": {"[" * MAX_ROW_DEPTH + "]" * MAX_ROW_DEPTH}}}\n'
    )
    loader = ShardedLoader(path, batch_size=2, should_shuffle=False)
    assert [r["prompt"] for r in loader.next_batch()] == ["2+2="]  # at the cap: kept
    assert loader.skipped_by_cause()["too_deep"] == 1
