"""ShardedLoader on hostile input: files that are not files, rows too large to read or to
tokenize, damaged Parquet/Arrow files, blank prompts, non-finite answers, a shard smaller than
a batch. Each is a clear error at construction or a counted skip with its cause, and none reads
more than a bounded number of bytes."""

import json
import os
import stat

import pytest

from yatt.core import ShardedLoader

NUM_GPUS = 0


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")
def test_a_fifo_data_path_is_an_error_not_a_hang(tmp_path):
    fifo = tmp_path / "d.jsonl"
    os.mkfifo(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(ValueError, match=r"d\.jsonl' is not a regular file"):
        ShardedLoader(fifo, batch_size=1)
    # The same FIFO inside a folder of shards.
    (tmp_path / "ds").mkdir()
    _write_jsonl(tmp_path / "ds" / "a.jsonl", [{"prompt": "q"}])
    os.mkfifo(tmp_path / "ds" / "b.jsonl")
    with pytest.raises(ValueError, match=r"b\.jsonl' is not a regular file"):
        ShardedLoader(tmp_path / "ds", batch_size=1)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_data_path_is_an_error_not_a_hang(tmp_path):
    link = tmp_path / "zero.jsonl"
    link.symlink_to("/dev/zero")  # the suffix passes; the file never ends
    with pytest.raises(ValueError, match=r"zero\.jsonl' is not a regular file"):
        ShardedLoader(link, batch_size=1)
    with pytest.raises(ValueError, match="/dev/zero"):
        ShardedLoader("/dev/zero", batch_size=1)


def test_a_truncated_parquet_file_is_named_at_construction(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "ds").mkdir()
    rows = [{"prompt": f"q{i}"} for i in range(20)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "ds" / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "ds" / "b.parquet")
    size = os.path.getsize(tmp_path / "ds" / "b.parquet")
    os.truncate(tmp_path / "ds" / "b.parquet", size // 2)  # the footer (metadata) is gone
    with pytest.raises(ValueError, match=r"b\.parquet' cannot be read as Parquet"):
        ShardedLoader(tmp_path / "ds", batch_size=1)


def test_a_damaged_parquet_row_group_is_a_counted_skip_naming_the_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    rows = [{"prompt": f"question {i} " * 20} for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10, compression="snappy")
    metadata = pq.ParquetFile(path).metadata
    # Overwrite the third row group's column chunk; the footer stays intact.
    chunk = metadata.row_group(2).column(0)
    start = min(chunk.data_page_offset, chunk.dictionary_page_offset or chunk.data_page_offset)
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\xff" * chunk.total_compressed_size)
    loader = ShardedLoader(path, batch_size=40, should_shuffle=False)
    got = loader.next_batch()
    assert [r["_index"] for r in got] == [*range(20), *range(30, 40)]
    assert loader.skipped_by_cause()["unreadable"] == 10
    assert any("d.parquet" in reason and "row group 2" in reason for reason in loader.skipped)


def test_a_truncated_arrow_file_of_a_datasets_folder_is_named(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "hf"
    datasets.Dataset.from_list([{"prompt": f"q{i}"} for i in range(50)]).save_to_disk(
        str(folder), num_shards=2
    )
    arrow = sorted(folder.glob("*.arrow"))[1]
    os.truncate(arrow, os.path.getsize(arrow) // 2)
    with pytest.raises(ValueError, match=rf"{arrow.name}' cannot be read"):
        ShardedLoader(folder, batch_size=1)
