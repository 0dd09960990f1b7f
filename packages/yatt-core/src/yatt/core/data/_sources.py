"""Random access to rows of JSONL, Parquet and Hugging Face `datasets` folders without loading
the dataset.

Each source builds a light index first (line offsets for JSONL, row-group boundaries for
Parquet; a `save_to_disk` folder's Arrow files are memory-mapped, not read): a few bytes per
row, no payloads. `read(indices)` then materialises only the rows asked for, so a rank holding
1/N of the dataset parses only that 1/N.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

_CHUNK_BYTES = 1 << 24
_SCAN_BYTES = 1 << 20  # an oversized line is measured in pieces of this size, never held whole
# A JSONL row's line past this many bytes is skipped unread (the default of max_row_bytes):
# room for a row with an inline base64 image of 32 MiB (43 MiB of text), and a bound on what
# one row can cost to parse.
DEFAULT_MAX_ROW_BYTES = 64 << 20
# Decoded Parquet row groups kept for later draws (a draw touches the groups of its rows; a
# file of one group, the common case, was decompressed whole for every batch): up to this many
# bytes of Arrow data, and always the last group read. Keeping that one costs no more than
# the peak each draw already paid to decode it; it is held between draws instead.
PARQUET_GROUP_CACHE_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class BadRow:
    """What read() gives for a row it cannot give: the loader counts and skips it."""

    reason: str
    cause: str = "unreadable"  # one of the loader's SKIP_CAUSES


class RowSource(Protocol):
    num_rows: int

    def read(self, indices: Sequence[int]) -> list[dict[str, Any] | BadRow]: ...


def _line_offsets(path: Path) -> np.ndarray:
    """Start offsets of the non-blank lines of a file, scanning it in chunks."""
    starts: list[np.ndarray] = []
    with open(path, "rb") as f:
        base = 0
        line_start = 0
        is_blank = True
        while chunk := f.read(_CHUNK_BYTES):
            buf = np.frombuffer(chunk, dtype=np.uint8)
            newlines = np.flatnonzero(buf == 0x0A)
            # A line is a row unless it is only whitespace; check each line's bytes cheaply.
            prev = 0
            found = []
            for nl in newlines.tolist():
                segment = chunk[prev:nl]
                if is_blank and segment.strip():
                    is_blank = False
                if not is_blank:
                    found.append(line_start)
                line_start = base + nl + 1
                is_blank = True
                prev = nl + 1
            if chunk[prev:].strip():
                is_blank = False
            starts.append(np.asarray(found, dtype=np.int64))
            base += len(chunk)
        if not is_blank:
            starts.append(np.asarray([line_start], dtype=np.int64))
    return np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)


def _line_length(handle: Any, start: int, limit: int) -> int:
    """Bytes of the line at `start` (its newline excluded), counted up to limit + 1: read in
    pieces and dropped, so a line of gigabytes costs neither its size in memory nor its read."""
    handle.seek(start)
    length = 0
    while length <= limit:
        piece = handle.read(min(_SCAN_BYTES, limit + 1 - length))
        if not piece:
            break
        newline = piece.find(b"\n")
        if newline >= 0:
            return length + newline
        length += len(piece)
    return length


class JsonlSource:
    """Rows of one or more JSONL files; row i is the i-th non-blank line across the files.
    A row's line over `max_row_bytes` is a BadRow (too_long), never read whole."""

    def __init__(self, files: Sequence[Path], max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> None:
        self._files = list(files)
        self._max_row_bytes = max_row_bytes
        self._file_sizes = [os.path.getsize(f) for f in self._files]
        offsets = [_line_offsets(f) for f in self._files]
        self._file_of_row = np.concatenate(
            [np.full(len(o), i, dtype=np.int32) for i, o in enumerate(offsets)]
        )
        self._offset_of_row = np.concatenate(offsets)
        self.num_rows = int(self._offset_of_row.size)

    def _max_line_bytes(self, index: int, file_index: int) -> int:
        """An upper bound of row `index`'s line length, from the index alone: up to the next
        row's start (blank lines between included) or the end of its file."""
        start = int(self._offset_of_row[index])
        is_last_of_file = (
            index + 1 == self.num_rows or int(self._file_of_row[index + 1]) != file_index
        )
        end = self._file_sizes[file_index] if is_last_of_file else self._offset_of_row[index + 1]
        return int(end) - start

    def read(self, indices: Sequence[int]) -> list[dict[str, Any] | BadRow]:
        out: list[dict[str, Any] | BadRow] = []
        handles: dict[int, Any] = {}
        limit = self._max_row_bytes
        try:
            for index in indices:
                file_index = int(self._file_of_row[index])
                if file_index not in handles:
                    handles[file_index] = open(self._files[file_index], "rb")  # noqa: SIM115
                handle = handles[file_index]
                start = int(self._offset_of_row[index])
                # Most lines are shorter than the cap by the index alone; the others are measured.
                if self._max_line_bytes(index, file_index) > limit:
                    length = _line_length(handle, start, limit)
                    if length > limit:
                        reason = f"a JSONL line of over {limit} bytes, over max_row_bytes={limit}"
                        out.append(BadRow(reason, cause="too_long"))
                        continue
                handle.seek(start)
                out.append(_parse_row(handle.readline(limit + 1)))
        finally:
            for handle in handles.values():
                handle.close()
        return out


def _parse_row(line: bytes) -> dict[str, Any] | BadRow:
    try:
        row = json.loads(line)
    # ValueError covers bad JSON, bad UTF-8 and an integer of more digits than Python converts;
    # RecursionError, arrays or objects nested past the interpreter's recursion limit.
    except (ValueError, RecursionError) as err:
        detail = err.msg if isinstance(err, json.JSONDecodeError) else str(err)[:200]
        return BadRow(f"invalid JSON ({detail})")
    if not isinstance(row, dict):
        return BadRow(f"a JSON {type(row).__name__}, not an object")
    return row


class ParquetSource:
    """Rows of one or more Parquet files; reads only the row groups holding requested rows,
    keeping decoded groups for later draws (PARQUET_GROUP_CACHE_BYTES). A row of more Arrow
    bytes than `max_row_bytes` is a BadRow (too_long), never made into Python objects."""

    def __init__(
        self,
        files: Sequence[Path],
        columns: Sequence[str] | None = None,
        max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    ) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError(
                "reading Parquet needs pyarrow: pip install 'yatt-core[parquet]'"
            ) from err
        self._pq = pq
        self._files = list(files)
        self._columns = None if columns is None else list(columns)
        self._max_row_bytes = max_row_bytes
        self._cache: OrderedDict[int, Any] = OrderedDict()  # group -> pyarrow Table, LRU
        groups = []  # (file index, row group index, first global row)
        start = 0
        for i, f in enumerate(self._files):
            try:
                meta = pq.ParquetFile(f).metadata
            except Exception as err:  # pyarrow's errors do not name the file
                raise ValueError(
                    f"dataset file {str(f)!r} cannot be read as Parquet (truncated or not "
                    f"Parquet?): {type(err).__name__}: {err}"
                ) from err
            for g in range(meta.num_row_groups):
                groups.append((i, g, start))
                start += meta.row_group(g).num_rows
        self._groups = groups
        self._group_starts = np.asarray([g[2] for g in groups] + [start], dtype=np.int64)
        self.num_rows = int(start)

    def read(self, indices: Sequence[int]) -> list[dict[str, Any] | BadRow]:
        index_arr = np.asarray(indices, dtype=np.int64)
        group_of = np.searchsorted(self._group_starts, index_arr, side="right") - 1
        out: list[dict[str, Any] | BadRow | None] = [None] * len(index_arr)
        for g in np.unique(group_of).tolist():
            file_index, row_group, first = self._groups[g]
            positions = np.flatnonzero(group_of == g)
            try:
                table = self._group_table(g)
            except Exception as err:  # a damaged page: this group's rows are skipped, counted
                reason = (
                    f"row group {row_group} of {str(self._files[file_index])!r} cannot be read "
                    f"({type(err).__name__}: {err})"
                )
                rows = [BadRow(reason)] * len(positions)
            else:
                rows = [self._row(table, int(i)) for i in (index_arr[positions] - first)]
            for pos, row in zip(positions.tolist(), rows, strict=True):
                out[pos] = row
        return out  # type: ignore[return-value]

    def _group_table(self, group: int) -> Any:
        """Row group `group` decoded (cached: a later draw does not decompress it again)."""
        if group in self._cache:
            self._cache.move_to_end(group)
            return self._cache[group]
        file_index, row_group, _ = self._groups[group]
        table = self._pq.ParquetFile(self._files[file_index]).read_row_group(
            row_group, columns=self._columns
        )
        self._cache[group] = table
        while len(self._cache) > 1 and (
            sum(t.nbytes for t in self._cache.values()) > PARQUET_GROUP_CACHE_BYTES
        ):
            self._cache.popitem(last=False)
        return table

    def _row(self, table: Any, position: int) -> dict[str, Any] | BadRow:
        # A slice is a view: its nbytes counts the row's own bytes, and nothing is copied.
        row = table.slice(position, 1)
        if row.nbytes > self._max_row_bytes:
            return BadRow(
                f"a Parquet row of {row.nbytes} bytes, over max_row_bytes={self._max_row_bytes}",
                cause="too_long",
            )
        return row.to_pylist()[0]


class HfDatasetSource:
    """Rows of one split saved by `datasets`' `save_to_disk` (a folder with state.json and
    Arrow files). The files are memory-mapped; read() decodes only the rows asked for, with
    the dataset's features (an Image column gives PIL images, as `dataset[i]` does), except
    the `undecoded_images` columns (an Image feature, or a list of images): they give
    {"bytes", "path"} as stored, for the caller to check its size and header before decoding;
    such rows are read as Arrow, and one of more bytes than max_row_bytes is a BadRow."""

    def __init__(
        self,
        folder: Path,
        columns: Sequence[str] | None = None,
        undecoded_images: Sequence[str] = (),
        max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    ) -> None:
        self._max_row_bytes = max_row_bytes
        try:
            import datasets
        except ImportError as err:
            raise ImportError(
                f"dataset {str(folder)!r} is a Hugging Face datasets folder (save_to_disk); "
                "reading it needs the datasets package: pip install 'yatt-core[datasets]' "
                "(or pip install datasets)"
            ) from err
        try:
            dataset = datasets.load_from_disk(str(folder), keep_in_memory=False)
        except Exception as err:  # e.g. a truncated Arrow file; datasets does not name it
            raise ValueError(
                f"dataset {str(folder)!r} cannot be loaded as a datasets folder: "
                f"{_describe_arrow_problem(folder) or f'{type(err).__name__}: {err}'}"
            ) from err
        if columns is not None:
            missing = sorted(set(columns) - set(dataset.column_names))
            if missing:
                raise ValueError(
                    f"columns={list(columns)}: {missing} are not columns of {str(folder)!r}; "
                    f"it has {dataset.column_names}"
                )
            dataset = dataset.select_columns(list(columns))
        # The undecoded columns' features, with every Image in them (a plain column, or a list
        # of images) set not to decode. cast_column() would do it by writing a copy of the
        # whole dataset into a cache file; instead rows are read as Arrow and decoded here with
        # these features.
        self._raw_features = None
        if any(name in dataset.features for name in undecoded_images):
            features = copy.deepcopy(dataset.features)
            for name in undecoded_images:
                if name in features:
                    _stop_decoding_images(features[name], datasets.Image)
            self._raw_features = features
        self._dataset = dataset
        self._arrow_rows = dataset.with_format("arrow")  # rows as stored, for _raw_features
        self.num_rows = int(dataset.num_rows)

    def read(self, indices: Sequence[int]) -> list[dict[str, Any] | BadRow]:
        index_list = [int(i) for i in indices]
        if self._raw_features is not None:
            table = self._arrow_rows[index_list]
            return [self._decode(table.slice(i, 1)) for i in range(table.num_rows)]
        try:
            columns = self._dataset[index_list]
        except Exception:
            # A row whose features do not decode (a damaged image): find it, keep the others.
            return [self._read_one(i) for i in index_list]
        names = list(columns)
        return [
            dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)
        ]

    def _decode(self, row: Any) -> dict[str, Any] | BadRow:
        """One row (a one-row Arrow table) as Python values, after its size check."""
        if row.nbytes > self._max_row_bytes:
            return BadRow(
                f"a row of {row.nbytes} bytes, over max_row_bytes={self._max_row_bytes}",
                cause="too_long",
            )
        try:
            return self._raw_features.decode_example(row.to_pylist()[0])
        except Exception as err:
            return BadRow(f"undecodable row ({type(err).__name__}: {err})")

    def _read_one(self, index: int) -> dict[str, Any] | BadRow:
        try:
            return dict(self._dataset[index])
        except Exception as err:
            return BadRow(f"undecodable row ({type(err).__name__}: {err})")


def _stop_decoding_images(feature: Any, image_type: type) -> None:
    """Sets decode=False on every Image feature in `feature` (nested lists and dicts too)."""
    if isinstance(feature, image_type):
        feature.decode = False
    elif isinstance(feature, dict):
        for inner in feature.values():
            _stop_decoding_images(inner, image_type)
    elif isinstance(feature, list | tuple):
        for inner in feature:
            _stop_decoding_images(inner, image_type)
    elif hasattr(feature, "feature"):  # datasets' List, LargeList and Sequence
        _stop_decoding_images(feature.feature, image_type)


def _describe_arrow_problem(folder: Path) -> str | None:
    """Which Arrow file of a save_to_disk folder cannot be read, and why; None if all can."""
    import pyarrow as pa

    for file in sorted(folder.glob("*.arrow")):
        try:
            with pa.memory_map(str(file)) as source:  # mapped: reading costs no memory
                pa.ipc.open_stream(source).read_all()
        except Exception as err:
            return f"{str(file)!r} cannot be read (truncated?): {type(err).__name__}: {err}"
    return None


# The files `datasets` writes with save_to_disk: a Dataset folder, and a DatasetDict's root.
_HF_DATASET_STATE = "state.json"
_HF_DATASET_DICT = "dataset_dict.json"


def open_source(
    path: str | Path,
    *,
    columns: Sequence[str] | None = None,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    undecoded_images: Sequence[str] = (),
) -> RowSource:
    """A source for a JSONL or Parquet file, a directory of such files (sorted by name), or a
    Hugging Face `datasets` folder written by `save_to_disk` (for a DatasetDict: the folder of
    one split, e.g. "data/gsm8k/train"). max_row_bytes: JSONL lines and Parquet rows (their
    Arrow bytes) longer than this are BadRows (too_long), never made into Python objects. undecoded_images: a datasets folder's Image columns
    to give as stored ({"bytes", "path"}) instead of decoded."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"dataset path {str(path)!r} does not exist")
    if path.is_dir() and (path / _HF_DATASET_STATE).is_file():
        return HfDatasetSource(
            path, columns=columns, undecoded_images=undecoded_images, max_row_bytes=max_row_bytes
        )
    if path.is_dir() and (path / _HF_DATASET_DICT).is_file():
        splits = _dataset_dict_splits(path)
        example = str(path / splits[0]) if splits else str(path / "train")
        raise ValueError(
            f"dataset {str(path)!r} is a Hugging Face DatasetDict with splits {splits}; pass "
            f"one split's folder, e.g. {example!r}"
        )
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".parquet"))
        if not files:
            raise ValueError(
                f"dataset directory {str(path)!r} holds no .jsonl or .parquet files and is not "
                "a Hugging Face datasets folder (save_to_disk)"
            )
    else:
        files = [path]
    for file in files:
        _check_regular_file(file)
    suffixes = {f.suffix for f in files}
    if suffixes == {".jsonl"} or suffixes == {".json"}:
        return JsonlSource(files, max_row_bytes=max_row_bytes)
    if suffixes == {".parquet"}:
        return ParquetSource(files, columns=columns, max_row_bytes=max_row_bytes)
    raise ValueError(
        f"dataset {str(path)!r}: files must all be .jsonl or all .parquet; got {sorted(suffixes)}"
    )


def _check_regular_file(path: Path) -> None:
    """ValueError unless `path` is a regular file (after symlinks). A FIFO, a socket or a
    device such as /dev/zero would block or never end when the index is built."""
    if not path.is_file():  # stat, not open: opening a FIFO blocks until a writer comes
        raise ValueError(
            f"dataset file {str(path)!r} is not a regular file (a FIFO, socket or device?); "
            "pass a JSONL or Parquet file, a folder of them, or a datasets save_to_disk folder"
        )


def _dataset_dict_splits(folder: Path) -> list[str]:
    try:
        splits = json.loads((folder / _HF_DATASET_DICT).read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        splits = None
    if not isinstance(splits, list):  # unreadable: list the subfolders datasets would load
        splits = sorted(p.name for p in folder.iterdir() if (p / _HF_DATASET_STATE).is_file())
    return [str(s) for s in splits]
