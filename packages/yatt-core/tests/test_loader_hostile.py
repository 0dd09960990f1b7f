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
