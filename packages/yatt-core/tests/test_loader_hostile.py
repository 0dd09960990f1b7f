"""ShardedLoader on hostile input: files that are not files, rows too large to read or to
tokenize, damaged Parquet/Arrow files, blank prompts, non-finite answers, a shard smaller than
a batch. Each is a clear error at construction or a counted skip with its cause, and none reads
more than a bounded number of bytes."""

import json
import os
import stat
import time
import tracemalloc

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


def _append_sparse_line(path, num_bytes):
    """Append a JSONL row whose line is `num_bytes` long, mostly a hole in the file: a prompt
    string of NUL bytes (no disk written), then a normal row after it."""
    with open(path, "ab") as f:
        f.write(b'{"prompt": "')
        start = f.tell()
    os.truncate(path, start + num_bytes - len(b'{"prompt": "') - 2)
    with open(path, "ab") as f:
        f.write(b'"}\n' + json.dumps({"prompt": "after"}).encode() + b"\n")


def test_an_oversized_jsonl_line_is_skipped_unread(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "before"}])
    _append_sparse_line(path, 100 << 20)  # 100 MiB on one line
    loader = ShardedLoader(path, batch_size=3, should_shuffle=False, max_row_bytes=1 << 20)
    tracemalloc.start()
    started = time.perf_counter()
    got = loader.next_batch()
    seconds = time.perf_counter() - started
    peak_bytes = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [r["prompt"] for r in got] == ["before", "after"]
    assert loader.skipped_by_cause()["too_long"] == 1
    assert any("over max_row_bytes=1048576" in reason for reason in loader.skipped)
    assert peak_bytes < 8 << 20, peak_bytes  # the line was measured in chunks, never held
    assert seconds < 5, seconds


def test_a_line_at_the_row_cap_is_read_and_one_byte_over_is_not(tmp_path):
    line = json.dumps({"prompt": "x" * 100})
    path = tmp_path / "d.jsonl"
    # The second row is followed by blank lines: they do not count towards its size.
    path.write_text(f"{line}\n{line}\n" + " " * 500 + "\n\n" + f"{line}x\n")
    loader = ShardedLoader(path, batch_size=3, should_shuffle=False, max_row_bytes=len(line))
    assert [r["_index"] for r in loader.next_batch()] == [0, 1]
    assert loader.skipped_by_cause()["too_long"] == 1


@pytest.mark.parametrize(
    "line",
    [
        pytest.param("[" * 100_000 + "]" * 100_000, id="nested-past-the-recursion-limit"),
        pytest.param('{"prompt": "q", "answer": ' + "9" * 5000 + "}", id="5000-digit-int"),
        pytest.param('{"prompt": "q\\ud800"', id="cut-after-a-lone-surrogate"),
    ],
)
def test_json_the_parser_refuses_is_an_unreadable_skip(tmp_path, line):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + line + "\n")
    loader = ShardedLoader(path, batch_size=2, should_shuffle=False)
    assert [r["prompt"] for r in loader.next_batch()] == ["ok"]
    assert loader.skipped_by_cause()["unreadable"] == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"max_row_bytes": 0}, "max_row_bytes=0", id="zero-row-bytes"),
        pytest.param({"max_row_bytes": True}, "max_row_bytes=True", id="bool-row-bytes"),
        pytest.param({"max_prompt_bytes": 0}, "max_prompt_bytes=0", id="zero-prompt-bytes"),
        pytest.param({"max_prompt_bytes": 1.5}, "max_prompt_bytes=1.5", id="float-prompt-bytes"),
    ],
)
def test_bad_limits_fail_at_construction(tmp_path, kwargs, match):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}"} for i in range(4)])
    with pytest.raises(ValueError, match=match):
        ShardedLoader(path, batch_size=1, **kwargs)


class _TokenCounter:
    """count_tokens that records the size of every prompt it was given (1 token per char)."""

    def __init__(self):
        self.sizes = []

    def __call__(self, prompt):
        text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        self.sizes.append(len(text))
        return len(text)


def test_a_huge_prompt_is_skipped_before_the_tokenizer_sees_it(tmp_path):
    rows = [{"prompt": "short"}, {"prompt": "x" * (5 << 20)}, {"prompt": "also short"}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    counter = _TokenCounter()
    # Derived cap: 100 tokens x 128 bytes per token at most = 12800 bytes.
    loader = ShardedLoader(
        path, batch_size=3, should_shuffle=False, max_prompt_tokens=100, count_tokens=counter
    )
    assert [r["prompt"] for r in loader.first_rows()] == ["short", "also short"]
    assert [r["prompt"] for r in loader.next_batch()] == ["short", "also short"]
    assert max(counter.sizes) == len("also short")  # the 5 MiB prompt never reached it
    assert loader.skipped_by_cause()["too_long"] == 1
    assert any("over max_prompt_bytes=12800" in reason for reason in loader.skipped)


def test_the_byte_cap_counts_utf8_bytes_of_text_and_message_contents(tmp_path):
    rows = [
        {"prompt": "\u00e9" * 5},  # 10 bytes: at the cap
        {"prompt": "\u00e9" * 6},  # 12 bytes in 6 characters: over
        {"prompt": [{"role": "system", "content": "abcd"}, {"role": "user", "content": "efghij"}]},
        {"prompt": [{"role": "system", "content": "abcd"}, {"role": "user", "content": "efghijk"}]},
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    counter = _TokenCounter()
    loader = ShardedLoader(
        path,
        batch_size=4,
        should_shuffle=False,
        max_prompt_bytes=10,
        max_prompt_tokens=1000,
        count_tokens=counter,
    )
    assert [r["_index"] for r in loader.next_batch()] == [0, 2]
    assert sorted(counter.sizes) == [5, 10]  # only the rows within the cap were tokenized
    assert loader.skipped_by_cause()["too_long"] == 2
    # Without a token limit the byte cap stands alone (no tokenizer needed).
    loader = ShardedLoader(path, batch_size=4, should_shuffle=False, max_prompt_bytes=10)
    assert [r["_index"] for r in loader.next_batch()] == [0, 2]


def test_a_prompt_that_is_not_valid_unicode_is_a_bad_prompt(tmp_path):
    # JSON may escape a lone surrogate; a tokenizer (UTF-8 in Rust) would raise on it mid-run.
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "half of a pair: \\ud800"}\n')

    def count_tokens(prompt):
        return len(prompt.encode("utf-8"))  # raises on a lone surrogate, as a tokenizer would

    loader = ShardedLoader(
        path, batch_size=2, should_shuffle=False, max_prompt_tokens=100, count_tokens=count_tokens
    )
    assert [r["prompt"] for r in loader.next_batch()] == ["ok"]
    assert loader.skipped_by_cause()["bad_prompt"] == 1


def test_a_prompt_without_text_is_no_prompt(tmp_path):
    blank_messages = [{"role": "system", "content": " "}, {"role": "user", "content": "\n\t"}]
    rows = [
        {"prompt": "ok"},
        {"prompt": ""},
        {"prompt": " \n\t\u3000"},  # whitespace only (an ideographic space too)
        {"prompt": []},
        {"prompt": blank_messages},
        {"prompt": [{"role": "system", "content": " "}, {"role": "user", "content": "hi"}]},
        {"prompt": 5},  # not text at all: bad_prompt, as before
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    loader = ShardedLoader(path, batch_size=7, should_shuffle=False)
    assert [r["_index"] for r in loader.next_batch()] == [0, 5]
    counts = loader.skipped_by_cause()
    assert (counts["no_prompt"], counts["bad_prompt"]) == (4, 1)
    assert loader.first_rows() == [{**rows[0], "_index": 0}, {**rows[5], "_index": 5}]


def test_a_required_field_that_is_no_finite_number_or_blank_is_a_bad_field(tmp_path):
    lines = [
        '{"prompt": "a", "answer": 7}',
        '{"prompt": "b", "answer": 2.5}',
        '{"prompt": "c", "answer": NaN}',  # Python's json accepts these three
        '{"prompt": "d", "answer": Infinity}',
        '{"prompt": "e", "answer": -Infinity}',
        '{"prompt": "f", "answer": 1e400}',  # overflows to inf
        '{"prompt": "g", "answer": " \\n"}',
        '{"prompt": "h", "answer": ""}',
        '{"prompt": "i", "answer": "NaN"}',  # a string: text, kept
        '{"prompt": "j"}',  # missing: no_field, as before
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    loader = ShardedLoader(path, batch_size=10, should_shuffle=False, required_keys=["answer"])
    assert [r["prompt"] for r in loader.next_batch()] == ["a", "b", "i"]
    counts = loader.skipped_by_cause()
    assert (counts["bad_field"], counts["no_field"]) == (6, 1)
    assert any("'answer' is inf, not a finite number" in r for r in loader.skipped)


def test_a_non_finite_required_number_from_parquet_is_a_bad_field(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": "a", "answer": 1.0}, {"prompt": "b", "answer": float("nan")}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    loader = ShardedLoader(
        tmp_path / "d.parquet", batch_size=2, should_shuffle=False, required_keys=["answer"]
    )
    assert [r["prompt"] for r in loader.next_batch()] == ["a"]
    assert loader.skipped_by_cause()["bad_field"] == 1


@pytest.mark.parametrize(
    ("num_rows", "world_size", "batch_size", "shard"),
    [
        pytest.param(5, 1, 6, 5, id="one-rank"),
        pytest.param(7, 2, 4, 3, id="two-ranks-7-rows"),  # 7 // 2 = 3 rows per rank per epoch
    ],
)
def test_a_batch_larger_than_the_shard_fails_at_construction(
    tmp_path, num_rows, world_size, batch_size, shard
):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}"} for i in range(num_rows)])
    with pytest.raises(
        ValueError,
        match=rf"batch_size={batch_size} \(prompts per rank per step.*prompts_per_rank\).*"
        rf"{shard} rows per rank",
    ):
        ShardedLoader(path, batch_size=batch_size, world_size=world_size)
    # A batch of the whole shard is fine: each step one epoch, every prompt once.
    loader = ShardedLoader(path, batch_size=shard, world_size=world_size, rank=world_size - 1)
    indices = [r["_index"] for r in loader.next_batch()]
    assert len(indices) == len(set(indices)) == shard
