"""ShardedLoader with image_key: paths (relative or absolute), bytes, datasets' {"bytes", "path"}
dicts and PIL images open into PIL images on the rank that reads the row; a missing, damaged or
oversized image is a counted skip with its cause, never an error in the middle of a run."""

import io
import json
import os
import tracemalloc

import pytest

from yatt.core import ShardedLoader
from yatt.core.data._loader import OTHER_REASONS, SKIP_CAUSES

Image = pytest.importorskip("PIL.Image")
ImageColor = pytest.importorskip("PIL.ImageColor")

NUM_GPUS = 0


def _png(size=(4, 3), color="red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _load_all(path, **kwargs):
    loader = ShardedLoader(path, batch_size=1, image_key="image", should_shuffle=False, **kwargs)
    loader.batch_size = loader.num_local_rows
    return loader, loader.next_batch()


def test_paths_relative_and_absolute_open_as_pil_images(tmp_path):
    (tmp_path / "data" / "images").mkdir(parents=True)
    (tmp_path / "data" / "images" / "a.png").write_bytes(_png((4, 3), "red"))
    absolute = tmp_path / "elsewhere.png"
    absolute.write_bytes(_png((5, 2), "blue"))
    rows = [
        {"prompt": "relative", "image": "images/a.png"},
        {"prompt": "absolute", "image": str(absolute)},
        {"prompt": "two", "image": ["images/a.png", str(absolute)]},
    ]
    loader, got = _load_all(_write_jsonl(tmp_path / "data" / "d.jsonl", rows))
    assert [r["prompt"] for r in got] == ["relative", "absolute", "two"]
    assert isinstance(got[0]["image"], Image.Image)
    assert got[0]["image"].size == (4, 3) and got[0]["image"].getpixel((0, 0)) == (255, 0, 0)
    assert got[1]["image"].size == (5, 2) and got[1]["image"].getpixel((0, 0)) == (0, 0, 255)
    assert [im.size for im in got[2]["image"]] == [(4, 3), (5, 2)]  # a list stays a list
    assert loader.num_skipped == 0


def test_relative_paths_in_a_folder_of_shards_are_relative_to_that_folder(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "img.png").write_bytes(_png())
    _write_jsonl(tmp_path / "ds" / "part-0.jsonl", [{"prompt": "q", "image": "img.png"}])
    _, got = _load_all(tmp_path / "ds")
    assert got[0]["image"].size == (4, 3)


def test_bytes_dicts_and_pil_images_from_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "b.png").write_bytes(_png((6, 6), "green"))
    rows = [
        {"prompt": "bytes", "image": {"bytes": _png((3, 3)), "path": None}},
        {"prompt": "path", "image": {"bytes": None, "path": "b.png"}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    _, got = _load_all(tmp_path / "d.parquet")
    assert [r["image"].size for r in got] == [(3, 3), (6, 6)]
    assert all(isinstance(r["image"], Image.Image) for r in got)


def test_datasets_image_feature_and_raw_bytes(tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image()})
    rows = {"prompt": ["a", "b"], "image": [{"bytes": _png((2, 2)), "path": None}] * 2}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "hf"))
    _, got = _load_all(tmp_path / "hf")
    assert [r["image"].size for r in got] == [(2, 2), (2, 2)]  # decoded by datasets, loaded here
    # Raw bytes in a binary column (no Image feature).
    raw = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Value("binary")})
    rows = {"prompt": ["c"], "image": [_png((7, 1))]}
    datasets.Dataset.from_dict(rows, features=raw).save_to_disk(str(tmp_path / "raw"))
    _, got = _load_all(tmp_path / "raw")
    assert got[0]["image"].size == (7, 1)


def test_bad_images_are_counted_skips_with_their_cause(tmp_path, caplog):
    (tmp_path / "ok.png").write_bytes(_png())
    (tmp_path / "big.png").write_bytes(_png((40, 30)))
    (tmp_path / "text.png").write_text("not an image")
    (tmp_path / "cut.png").write_bytes(_png((30, 30), "white")[:-40])  # header fine, data cut
    rows = [
        {"prompt": "ok", "image": "ok.png"},
        {"prompt": "no such file", "image": "missing.png"},
        {"prompt": "empty list", "image": []},
        {"prompt": "null", "image": None},
        {"prompt": "not an image", "image": "text.png"},
        {"prompt": "truncated", "image": "cut.png"},
        {"prompt": "a number", "image": 3},
        {"prompt": "a url", "image": "https://example.com/a.png"},
        {"prompt": "too large", "image": "big.png"},
        {"prompt": "one bad of two", "image": ["ok.png", "missing.png"]},
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    loader, got = _load_all(path, max_image_pixels=1000)
    assert [r["prompt"] for r in got] == ["ok"]
    assert loader.skipped_by_cause() == {
        **dict.fromkeys(SKIP_CAUSES, 0),
        "no_image": 4,  # missing file, empty list, null, missing file in a list
        "bad_image": 4,  # text, truncated, a number, a URL
        "image_too_large": 1,
    }
    reasons = "\n".join(loader.skipped)
    assert "missing.png' does not exist" in reasons
    assert "image 1: image file" in reasons  # which image of the list
    assert "40x30 image has 1200 pixels, over max_image_pixels=1000" in reasons
    assert "is a URL" in reasons
    # first_rows sees the same row as usable and skips the others without counting them.
    assert [r["prompt"] for r in loader.first_rows(4)] == ["ok"]


def test_without_opening_the_field_passes_as_stored(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "image": "not/a/file.npy"}])
    _, got = _load_all(path, should_open_images=False)
    assert got[0]["image"] == "not/a/file.npy"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"max_image_pixels": 0}, "max_image_pixels=0", id="zero"),
        pytest.param({"max_image_pixels": 1.5}, "max_image_pixels=1.5", id="float"),
        pytest.param(
            {"max_image_pixels": 10, "should_open_images": False}, "is checked when", id="unopened"
        ),
        pytest.param({"max_image_bytes": 0}, "max_image_bytes=0", id="zero-bytes"),
        pytest.param(
            {"max_image_bytes": 10, "should_open_images": False},
            "max_image_bytes=10 is checked when",
            id="bytes-unopened",
        ),
    ],
)
def test_bad_image_settings_fail_at_construction(tmp_path, kwargs, match):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "image": "a.png"}])
    with pytest.raises(ValueError, match=match):
        ShardedLoader(path, batch_size=1, image_key="image", **kwargs)


def test_without_pillow_the_loader_says_how_to_install_it(tmp_path, monkeypatch):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "image": "a.png"}])
    monkeypatch.setitem(__import__("sys").modules, "PIL", None)
    with pytest.raises(ImportError, match=r"yatt-core\[vision\]"):
        ShardedLoader(path, batch_size=1, image_key="image")
    ShardedLoader(path, batch_size=1, image_key="image", should_open_images=False)  # no PIL needed


def test_distinct_bad_paths_keep_the_reason_counter_bounded(tmp_path):
    """Every row names its own missing file: the per-reason texts stop growing at a bound (the
    rest counted together), the per-cause counts stay exact."""
    rows = [{"prompt": f"q{i}", "image": f"missing_{i}.png"} for i in range(300)]
    rows.append({"prompt": "ok", "image": "ok.png"})
    (tmp_path / "ok.png").write_bytes(_png())
    loader, got = _load_all(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert [r["prompt"] for r in got] == ["ok"]
    assert loader.skipped_by_cause()["no_image"] == 300 == loader.num_skipped
    assert len(loader.skipped) <= 101 and loader.skipped[OTHER_REASONS] >= 200


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")
def test_image_paths_that_are_not_regular_files_are_skipped_unread(tmp_path):
    """A FIFO would block the open, /dev/zero never ends, a folder is no image: each is a
    bad_image skip decided from the path's stat, before anything is read."""
    (tmp_path / "ok.png").write_bytes(_png())
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "folder.png").mkdir()
    rows = [
        {"prompt": "ok", "image": "ok.png"},
        {"prompt": "fifo", "image": "fifo.png"},
        {"prompt": "folder", "image": "folder.png"},
    ]
    if os.path.exists("/dev/zero"):
        rows.append({"prompt": "device", "image": "/dev/zero"})
    loader, got = _load_all(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert [r["prompt"] for r in got] == ["ok"]
    assert loader.skipped_by_cause()["bad_image"] == len(rows) - 1
    assert sum("is not a regular file" in reason for reason in loader.skipped) == len(rows) - 1


def test_an_image_file_over_max_image_bytes_is_skipped_unread(tmp_path):
    (tmp_path / "ok.png").write_bytes(_png())
    with open(tmp_path / "huge.png", "wb") as f:
        f.write(_png()[:64])  # a PNG header, then a 3 GB hole: no disk written
    os.truncate(tmp_path / "huge.png", 3 << 30)
    rows = [{"prompt": "ok", "image": "ok.png"}, {"prompt": "huge", "image": "huge.png"}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    loader = ShardedLoader(path, batch_size=2, image_key="image", should_shuffle=False)
    tracemalloc.start()
    got = loader.next_batch()  # the default cap, 32 MiB
    peak_bytes = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [r["prompt"] for r in got] == ["ok"]
    assert loader.skipped_by_cause()["image_too_large"] == 1
    assert any(f"{3 << 30} bytes, over max_image_bytes={32 << 20}" in r for r in loader.skipped)
    assert peak_bytes < 8 << 20, peak_bytes


def test_max_image_bytes_applies_to_files_and_to_inline_bytes(tmp_path):
    small, large = _png((2, 2)), _png((64, 64), "white")
    limit = len(small)
    assert len(large) > limit
    (tmp_path / "small.png").write_bytes(small)
    (tmp_path / "large.png").write_bytes(large)
    rows = [
        {"prompt": "small file", "image": "small.png"},
        {"prompt": "large file", "image": "large.png"},
        {"prompt": "large dict", "image": {"bytes": large.hex(), "path": None}},
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    loader, got = _load_all(path, max_image_bytes=limit)
    assert [r["prompt"] for r in got] == ["small file"]
    assert loader.skipped_by_cause()["image_too_large"] == 1  # the dict's hex str is no image
    # Inline bytes: the same cap.
    from yatt.core.vision._row_images import RowImageError, open_row_images

    assert open_row_images(small, base_dir=tmp_path, max_pixels=None, max_bytes=limit).size
    for value in (large, {"bytes": large, "path": None}, [small, large]):
        with pytest.raises(RowImageError, match=f"over max_image_bytes={limit}") as err:
            open_row_images(value, base_dir=tmp_path, max_pixels=None, max_bytes=limit)
        assert err.value.cause == "image_too_large"


def test_a_datasets_image_column_is_checked_before_datasets_decodes_it(tmp_path):
    """The Image feature is read undecoded (bytes), so max_image_bytes and the header's pixel
    count apply before any pixels are decoded, and a damaged image is a bad_image skip."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image()})
    small, large = _png((2, 2)), _png((64, 64), "white")
    images = [{"bytes": b, "path": None} for b in (small, large, b"not an image", small)]
    rows = {"prompt": ["small", "large", "broken", "small again"], "image": images}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "hf"))
    loader, got = _load_all(tmp_path / "hf", max_image_bytes=len(small))
    assert [r["prompt"] for r in got] == ["small", "small again"]
    assert isinstance(got[0]["image"], Image.Image) and got[0]["image"].size == (2, 2)
    counts = loader.skipped_by_cause()
    assert (counts["image_too_large"], counts["bad_image"], counts["unreadable"]) == (1, 1, 0)


def test_read_rows_gives_drawn_rows_again_by_index_without_moving_or_counting(tmp_path):
    colors = {"q0": "red", "q1": "green", "q2": "blue", "q3": "white"}
    for name, color in colors.items():
        (tmp_path / f"{name}.png").write_bytes(_png((3, 2), color))
    rows = [{"prompt": name, "image": f"{name}.png"} for name in colors]
    rows.insert(2, {"prompt": "gone", "image": "missing.png"})  # index 2: unusable
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    loader = ShardedLoader(path, batch_size=2, image_key="image", seed=3)  # shuffled
    drawn = loader.next_batch(5)
    state, skipped = loader.state_dict(), loader.skipped_by_cause()

    by_index = {row["_index"]: row for row in drawn}
    again = loader.read_rows([*sorted(by_index, reverse=True), 2])
    assert again[-1] is None  # the row with the missing image
    for row in again[:-1]:
        first = by_index[row["_index"]]
        assert row["prompt"] == first["prompt"] == rows[row["_index"]]["prompt"]
        assert isinstance(row["image"], Image.Image)
        assert row["image"].tobytes() == first["image"].tobytes()
        assert row["image"].getpixel((0, 0)) == ImageColor.getrgb(colors[row["prompt"]])
    assert loader.state_dict() == state and loader.skipped_by_cause() == skipped
    assert loader.read_rows([]) == []
    with pytest.raises(ValueError, match=r"indices \[5, -1\] are not row indices"):
        loader.read_rows([0, 5, -1])
