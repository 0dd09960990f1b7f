"""`ShardedLoader`: each data-parallel rank reads only its own prompts, in a resumable order.

    epoch e:  perm = permutation(num_rows, seed=(seed, e))       same on every rank
    rank r:   rows perm[r], perm[r + W], perm[r + 2W], ...        W = data-parallel size
    step:     the next batch_size of them (or as many as asked: a refill may ask for fewer)

Ranks never exchange rows: each builds the same light index (line offsets or row-group sizes),
computes the same permutation, and parses only its own rows. The last num_rows % W rows of a
permutation are left out of that epoch so every rank has the same number of steps. Rows that
are unusable (bad JSON, no prompt text, a prompt or a JSONL line too long, a required field
missing, blank or not finite, an image that is missing, does not decode or is too large) are
skipped, counted per cause (`skipped_by_cause()`, fixed keys for metrics) and logged; the batch
is then smaller on that rank. Sizes are checked before the costly step, so one bad row costs a
bounded time and memory: a JSONL line's length before it is read (max_row_bytes), a prompt's
UTF-8 bytes before it is tokenized (max_prompt_bytes), an image file's stat and size before it
is opened (max_image_bytes) and its header's pixel count before it is decoded; a Parquet row's
Arrow bytes before it becomes Python objects (max_row_bytes), a `datasets` column of images
(one, or a list) read as stored, never decoded by `datasets`; a row's nesting depth
(MAX_ROW_DEPTH) before anything else reads it.

With `image_key`, a row's images are opened where the row is read (this rank): the field may
hold a path (relative to the data file's folder, or absolute), bytes, a `datasets` Image
feature ({"bytes", "path"} or a PIL image) or a list of these, and the row gives loaded PIL
images in the same shape (see yatt.core.vision._row_images). A rank that draws a whole epoch of its shard without one
usable row stops with the data file and the counts: no number of draws could fill a batch.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from yatt.core.data._row_fields import (
    field_names,
    get_field,
    has_field,
    top_level_key,
    with_field,
)
from yatt.core.data._sources import DEFAULT_MAX_ROW_BYTES, BadRow, open_source
from yatt.core.vision._row_images import (
    DEFAULT_MAX_IMAGE_BYTES,
    RowImageError,
    import_pil,
    open_row_images,
)

logger = logging.getLogger("yatt.core")

ROW_INDEX_KEY = "_index"  # added to every row: its global index in the dataset
_MAX_LOGGED_SKIPS = 20
# Reason texts name a row's own value (an image path): past this many distinct ones, further
# new reasons are counted under OTHER_REASONS, so a large bad dataset cannot grow the counter.
_MAX_SKIP_REASONS = 100
OTHER_REASONS = "(other reasons)"
_NUM_ROWS_CHECKED = 16  # rows read at start-up to catch a misspelled key
# Without max_prompt_bytes, a prompt of more UTF-8 bytes than max_prompt_tokens times this is
# too long before it is tokenized (a tokenizer's time and memory grow with its input: a 50 MB
# prompt took minutes and 20 GB). An assumed bound on the bytes one token covers, far above
# real text (English about 4, CJK about 3 to 6); pass max_prompt_bytes for an exact one, e.g.
# max_prompt_tokens x the vocabulary's longest token in bytes.
MAX_BYTES_PER_TOKEN = 128
# A row nested deeper than this (lists and dicts in lists and dicts) is skipped (too_deep):
# it would pass the loader, then fail where it is pickled for a reward worker. Chat messages
# are 3 deep, verl's rows 3.
MAX_ROW_DEPTH = 64
# Why a row was skipped, as metric keys (every rank reports all of them, zeros included).
SKIP_CAUSES = (
    "too_deep",
    "unreadable",
    "no_prompt",
    "bad_prompt",
    "too_long",
    "no_image",
    "bad_image",
    "image_too_large",
    "no_field",
    "bad_field",
)


class ShardedLoader:
    """Batches of prompt rows (dicts) for one data-parallel rank; see the module docstring."""

    def __init__(
        self,
        path: str | Path,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        prompt_key: str = "prompt",
        image_key: str | None = None,
        should_open_images: bool = True,
        max_image_pixels: int | None = None,
        seed: int = 0,
        should_shuffle: bool = True,
        max_prompt_tokens: int | None = None,
        count_tokens: Callable[[Any], int] | None = None,
        prompt_encoder: Any = None,
        columns: Sequence[str] | None = None,
        required_keys: Sequence[str] = (),
        expected_keys: Sequence[str] = (),
        max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
        max_prompt_bytes: int | None = None,
        max_image_bytes: int | None = None,
    ) -> None:
        """batch_size: prompts per rank per step. prompt_key, image_key, required_keys:
        row fields, dotted for a nested one ("reward_model.ground_truth" reads
        row["reward_model"]["ground_truth"]). prompt_encoder (a yatt.core.PromptEncoder):
        counts a prompt's tokens as the policy reads them, keeping the ids for its encode();
        max_prompt_tokens defaults to the encoder's. max_prompt_tokens with count_tokens
        (e.g. a tokenizer applied to the prompt; not with prompt_encoder) skips rows whose
        prompt is longer. columns: Parquet
        columns to read (default all). required_keys: fields a row must hold as a string or a
        number (e.g. the reference answer a judge reads); rows without them are skipped
        (no_field), as are rows where one is blank text or a non-finite number (bad_field).
        expected_keys: fields the data must have (an answer no judge reads yet): a ValueError
        at start-up when none of the first rows has one, but a row without it is kept.
        image_key: the field holding a row's image(s); rows without one are skipped.
        should_open_images: open them into PIL images (default; see the module docstring),
        or False to pass the field on as stored (a payload the caller decodes itself).
        max_image_pixels: skip rows with an image of more pixels (width x height) than this.
        max_row_bytes: a JSONL row whose line is longer, or a Parquet row (or a datasets row
        with images left undecoded) of more Arrow bytes, is skipped as too_long before it is
        made into Python objects (default 64 MiB).
        max_prompt_bytes: a prompt of more UTF-8 bytes (a message list: its contents') is
        skipped as too_long before count_tokens sees it; default max_prompt_tokens x
        MAX_BYTES_PER_TOKEN (128), none without max_prompt_tokens. The bound assumes the chat
        template keeps every message's content.
        max_image_bytes: skip rows with an image file (or inline bytes) larger than this,
        unread; default 32 MiB when images are opened."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"batch_size={batch_size!r} must be an int >= 1 (prompts per rank per step)"
            )
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be an int >= 1")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size})")
        if prompt_encoder is not None:
            if count_tokens is not None:
                raise ValueError(
                    "pass prompt_encoder or count_tokens, not both: the encoder counts tokens"
                )
            count_tokens = prompt_encoder.count_tokens
            if max_prompt_tokens is None:
                max_prompt_tokens = prompt_encoder.max_prompt_tokens
        if max_prompt_tokens is not None and count_tokens is None:
            raise ValueError(
                f"max_prompt_tokens={max_prompt_tokens} needs count_tokens=<prompt -> token count>, "
                "e.g. lambda p: len(tokenizer.apply_chat_template(p))"
            )
        _check_positive_int("max_row_bytes", max_row_bytes, "bytes of a JSONL line")
        if max_prompt_bytes is not None:
            _check_positive_int("max_prompt_bytes", max_prompt_bytes, "UTF-8 bytes, or None")
        elif max_prompt_tokens is not None:
            max_prompt_bytes = max_prompt_tokens * MAX_BYTES_PER_TOKEN
        if max_image_pixels is not None and (
            isinstance(max_image_pixels, bool)
            or not isinstance(max_image_pixels, int)
            or max_image_pixels < 1
        ):
            raise ValueError(
                f"max_image_pixels={max_image_pixels!r} must be an int >= 1 (width x height), "
                "or None for no limit"
            )
        _check_positive_int("max_row_bytes", max_row_bytes, "bytes of a JSONL line")
        if max_prompt_bytes is not None:
            _check_positive_int("max_prompt_bytes", max_prompt_bytes, "UTF-8 bytes, or None")
        elif max_prompt_tokens is not None:
            max_prompt_bytes = max_prompt_tokens * MAX_BYTES_PER_TOKEN
        if max_image_pixels is not None and (image_key is None or not should_open_images):
            raise ValueError(
                f"max_image_pixels={max_image_pixels} is checked when images are opened; set "
                "image_key (and leave should_open_images=True), or drop max_image_pixels"
            )
        if max_image_bytes is not None:
            _check_positive_int("max_image_bytes", max_image_bytes, "bytes of an image file")
            if image_key is None or not should_open_images:
                raise ValueError(
                    f"max_image_bytes={max_image_bytes} is checked when images are opened; set "
                    "image_key (and leave should_open_images=True), or drop max_image_bytes"
                )
        if image_key is not None and should_open_images:
            import_pil()  # ImportError now, naming the extra, not at the first row
        if columns is not None:
            missing = [
                k
                for k in (prompt_key, image_key)
                if k is not None and top_level_key(columns, k) not in columns
            ]
            if missing:
                raise ValueError(f"columns={list(columns)} must include {missing}")
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.prompt_key = prompt_key
        self.image_key = image_key
        self.should_open_images = should_open_images
        self.max_image_pixels = max_image_pixels
        self.max_image_bytes = (
            DEFAULT_MAX_IMAGE_BYTES if max_image_bytes is None else max_image_bytes
        )
        # Relative image paths are relative to the data file's folder (a folder of shards: itself).
        self._image_dir = Path(path) if Path(path).is_dir() else Path(path).parent
        self.seed = seed
        self.should_shuffle = should_shuffle
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_bytes = max_prompt_bytes
        self.count_tokens = count_tokens
        self.required_keys = tuple(required_keys)
        self.expected_keys = tuple(expected_keys)
        # A datasets Image column is opened here, not by datasets: its size and header are
        # checked before its pixels are decoded, as for any other image.
        undecoded_images = (
            [image_key.split(".", 1)[0]] if image_key is not None and should_open_images else []
        )
        self._source = open_source(
            path, columns=columns, max_row_bytes=max_row_bytes, undecoded_images=undecoded_images
        )
        self.num_rows = self._source.num_rows
        if self.num_rows < world_size:
            raise ValueError(
                f"dataset {str(path)!r} has {self.num_rows} rows, fewer than the {world_size} "
                "data-parallel ranks; every rank needs at least one row"
            )
        self.num_local_rows = self.num_rows // world_size  # per rank per epoch
        if batch_size > self.num_local_rows:
            # Epochs would roll over inside one batch: the same prompt twice in a step.
            raise ValueError(
                f"batch_size={batch_size} (prompts per rank per step: the trainer's "
                f"data.prompts_per_rank) is more than dataset {str(path)!r} gives each rank: "
                f"{self.num_rows} rows // {world_size} ranks = {self.num_local_rows} rows per "
                f"rank per epoch; lower it to at most {self.num_local_rows}, or use more data"
            )
        self.epoch = 0
        self.position = 0  # rows of this epoch consumed by each rank
        self.path = path
        self.skipped: Counter[str] = Counter()  # by reason text, bounded (logs and errors)
        self._first_reason: dict[str, str] = {}  # by cause
        self._skipped_by_cause: Counter[str] = Counter()
        self._num_unusable_in_a_row = 0
        self.num_rows_parsed = 0  # rows this rank materialised (its own, never another rank's)
        self._perm: np.ndarray | None = None
        self._check_first_row(path)

    def _check_first_row(self, path: str | Path) -> None:
        # A misspelled prompt_key would otherwise turn into "every row skipped" at step 1. The
        # file's rows are read in file order until one has the keys (usually the first), on
        # every rank alike: the verdict depends on neither the seed nor the rank, one bad row
        # (skipped later, and counted) refuses nothing, and a rank reads one row, not a shard.
        keys = [("prompt_key", self.prompt_key), ("image_key", self.image_key)]
        keys += [("required_keys", key) for key in self.required_keys]
        keys += [("expected_keys", key) for key in self.expected_keys]
        wanted = [(name, key) for name, key in keys if key is not None]
        seen: set[str] = set()
        found: set[str] = set()
        for index in range(min(_NUM_ROWS_CHECKED, self.num_rows)):
            row = self._source.read([index])[0]
            self.num_rows_parsed += 1
            if not isinstance(row, dict):
                continue
            held = {key for _, key in wanted if has_field(row, key)}
            if len(held) == len(wanted):
                return
            found |= held
            seen |= set(field_names(row))
        missing = [(name, key) for name, key in wanted if key not in found]
        if seen and missing:
            name, key = missing[0]
            raise ValueError(
                f"{name}={key!r} is not a field of the first {_NUM_ROWS_CHECKED} rows of "
                f"{str(path)!r}; their fields are {sorted(seen)} (a nested field is named "
                "with dots, e.g. 'reward_model.ground_truth')"
            )

    def first_rows(self, num_rows: int = 8) -> list[dict[str, Any]]:
        """The file's first usable rows in file order (at most `num_rows`), for start-up checks
        of what a row gives (e.g. a prompt template): the same on every rank and seed. Nothing
        is counted as skipped and the position does not move. ValueError, with the causes, if
        none of the file's first 16 rows is usable."""
        out = []
        reasons: Counter[str] = Counter()
        for index in range(min(_NUM_ROWS_CHECKED, self.num_rows)):
            row = self._source.read([index])[0]
            row, problem = self._usable_row(row)
            if problem is not None:
                reasons[problem[1]] += 1
                continue
            out.append({**row, ROW_INDEX_KEY: index})
            if len(out) == num_rows:
                break
        if not out:
            raise ValueError(
                f"dataset {str(self.path)!r}: none of its first {sum(reasons.values())} rows is "
                f"usable; by cause: {dict(reasons)}"
            )
        return out

    @property
    def steps_per_epoch(self) -> int:
        """Full batches per epoch (a batch may also span two epochs)."""
        return self.num_local_rows // self.batch_size

    def _permutation(self) -> np.ndarray:
        if self._perm is None:
            if self.should_shuffle:
                rng = np.random.default_rng([self.seed, self.epoch])
                self._perm = rng.permutation(self.num_rows)
            else:
                self._perm = np.arange(self.num_rows)
        return self._perm

    def _take_positions(self, count: int) -> list[int]:
        """Global row indices of this rank's next `count` positions, advancing across epochs."""
        out: list[int] = []
        while len(out) < count:
            perm = self._permutation()
            take = min(count - len(out), self.num_local_rows - self.position)
            start = self.position * self.world_size + self.rank
            out.extend(perm[start : start + take * self.world_size : self.world_size].tolist())
            self.position += take
            if self.position == self.num_local_rows:
                self.epoch += 1
                self.position = 0
                self._perm = None
        return out

    def next_batch(self, num_rows: int | None = None) -> list[dict[str, Any]]:
        """This rank's next rows (batch_size by default, fewer where rows were skipped)."""
        count = self.batch_size if num_rows is None else num_rows
        if count < 0:
            raise ValueError(f"num_rows={num_rows!r} must be >= 0")
        indices = self._take_positions(count)
        rows = self._source.read(indices)
        self.num_rows_parsed += len(rows)
        out = []
        for index, row in zip(indices, rows, strict=True):
            row, problem = self._usable_row(row)
            if problem is not None:
                self._skip(index, *problem)
                continue
            self._num_unusable_in_a_row = 0
            row[ROW_INDEX_KEY] = index
            out.append(row)
        return out

    def read_rows(self, indices: Sequence[int]) -> list[dict[str, Any] | None]:
        """The rows at these global indices (a row's ROW_INDEX_KEY), as next_batch gave them
        (a copy, images opened, the index set), or None for a row unusable now. Neither moves
        the position nor counts skips: for a caller rebuilding rows it drew before (a
        checkpoint that keeps a row with opened images by its index)."""
        bad = [
            i
            for i in indices
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_rows
        ]
        if bad:
            raise ValueError(
                f"read_rows: indices {bad[:5]} are not row indices of this dataset "
                f"(ints in [0, {self.num_rows})); pass rows' {ROW_INDEX_KEY!r} values"
            )
        out: list[dict[str, Any] | None] = []
        if not indices:
            return out
        for index, row in zip(indices, self._source.read(list(indices)), strict=True):
            row, _ = self._usable_row(row)
            if row is not None:
                row[ROW_INDEX_KEY] = index
            out.append(row)
        return out

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        """Batches forever (epochs roll over); stop by step count in the training loop."""
        while True:
            yield self.next_batch()

    def _usable_row(
        self, row: dict[str, Any] | BadRow
    ) -> tuple[dict[str, Any], None] | tuple[None, tuple[str, str]]:
        """(a copy of the row, its images opened, None), or (None, (cause, reason))."""
        # The source gives a BadRow for a row it could not give (bad JSON, a line too long).
        if isinstance(row, BadRow):
            return None, (row.cause, row.reason)
        if _is_deeper_than(row, MAX_ROW_DEPTH):
            return None, ("too_deep", f"fields nested over {MAX_ROW_DEPTH} levels")
        problem = self._check_row(row)
        if problem is not None:
            return None, problem
        row = dict(row)
        if self.image_key is not None and self.should_open_images:
            # Last: a row skipped for a cheaper cause never has its images decoded.
            try:
                images = open_row_images(
                    get_field(row, self.image_key),
                    base_dir=self._image_dir,
                    max_pixels=self.max_image_pixels,
                    max_bytes=self.max_image_bytes,
                )
            except RowImageError as err:
                return None, (err.cause, f"{self.image_key!r}: {err}")
            row = with_field(row, self.image_key, images)
        return row, None

    def _check_row(self, row: Mapping[str, Any]) -> tuple[str, str] | None:
        """(cause, reason) when `row` is unusable, else None."""
        prompt = get_field(row, self.prompt_key)
        if prompt is None:
            return "no_prompt", f"no {self.prompt_key!r} field"
        if not isinstance(prompt, str | list):
            return "bad_prompt", f"{self.prompt_key!r} is not a string or a message list"
        if isinstance(prompt, list) and not all(_is_message(m) for m in prompt):
            return (
                "bad_prompt",
                f"{self.prompt_key!r} is a list but not of {{role, content}} string messages",
            )
        texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
        # Whitespace only would be trained on as a prompt of nothing (str.isspace() is
        # Unicode-aware, and False for ""; a huge text stops at its first other character).
        if not any(text and not text.isspace() for text in texts):
            return "no_prompt", f"{self.prompt_key!r} holds no text (empty or whitespace only)"
        problem = self._check_prompt_bytes(prompt)
        if problem is not None:
            return problem
        if self.image_key is not None and get_field(row, self.image_key) is None:
            return "no_image", f"no {self.image_key!r} field"
        for key in self.required_keys:
            value = get_field(row, key)
            # bool is an int in Python, never an answer; an int or float answer is used as text.
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                return "no_field", f"no {key!r} field with a string or number"
            # JSON's NaN/Infinity (and 1e400, parsed as inf) would be a judge's reference "nan".
            if isinstance(value, float) and not math.isfinite(value):
                return "bad_field", f"{key!r} is {value}, not a finite number"
            if isinstance(value, str) and (not value or value.isspace()):
                return "bad_field", f"{key!r} holds no text (empty or whitespace only)"
            if isinstance(value, str) and not _is_valid_unicode(value):
                # A lone surrogate (JSON's \ud800): a tokenizer raises a TypeError on it.
                return "bad_field", f"{key!r} is not valid Unicode text (a lone surrogate)"
        if self.max_prompt_tokens is not None:
            assert self.count_tokens is not None
            num_tokens = self.count_tokens(prompt)
            if num_tokens > self.max_prompt_tokens:
                return "too_long", f"prompt longer than max_prompt_tokens={self.max_prompt_tokens}"
        return None

    def _check_prompt_bytes(self, prompt: str | list[dict[str, str]]) -> tuple[str, str] | None:
        """too_long past max_prompt_bytes, measured without tokenizing (and without encoding a
        text whose character count is already over: a character is at least one byte);
        bad_prompt for text that is not valid Unicode (a lone surrogate JSON can escape), which
        a tokenizer would raise on."""
        texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
        limit = self.max_prompt_bytes
        num_bytes = 0
        for text in texts:
            if limit is not None and num_bytes + len(text) > limit:
                return "too_long", f"prompt over max_prompt_bytes={limit} (not tokenized)"
            try:
                num_bytes += len(text.encode("utf-8"))
            except UnicodeEncodeError as err:
                return "bad_prompt", f"{self.prompt_key!r} is not valid Unicode text ({err.reason})"
        if limit is not None and num_bytes > limit:
            return "too_long", f"prompt of {num_bytes} bytes, over max_prompt_bytes={limit}"
        return None

    def _skip(self, index: int, cause: str, reason: str) -> None:
        if reason not in self.skipped and len(self.skipped) >= _MAX_SKIP_REASONS:
            reason = OTHER_REASONS
        self.skipped[reason] += 1
        self._skipped_by_cause[cause] += 1
        self._first_reason.setdefault(cause, reason)
        self._num_unusable_in_a_row += 1
        if self._num_unusable_in_a_row >= 2 * self.num_local_rows:
            # Twice the shard without one usable row holds a whole epoch without one: no number
            # of further draws can fill a batch, and a resumed run would stop here again.
            raise ValueError(
                f"dataset {str(self.path)!r}: the last {self._num_unusable_in_a_row} rows rank "
                f"{self.rank} drew (a whole epoch of its {self.num_local_rows} rows) were "
                f"unusable; skipped rows by cause (first reason): {self._describe_skips()}"
            )
        total = sum(self.skipped.values())
        if total <= _MAX_LOGGED_SKIPS:
            logger.warning("rank %d: skipping dataset row %d: %s", self.rank, index, reason)
            if total == _MAX_LOGGED_SKIPS:
                logger.warning("rank %d: further skipped rows are only counted", self.rank)

    def _describe_skips(self) -> str:
        return "; ".join(
            f"{cause} {count} ({self._first_reason[cause]})"
            for cause, count in self._skipped_by_cause.items()
        )

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def skipped_by_cause(self) -> dict[str, int]:
        """Rows skipped so far by cause, every cause of SKIP_CAUSES present (zeros included)."""
        return {cause: self._skipped_by_cause[cause] for cause in SKIP_CAUSES}

    def state_dict(self) -> dict[str, Any]:
        """Where this rank's loader is. Save it per rank: ranks that ask for different numbers
        of rows (refills, redraws after unusable rows) are at different positions."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_rows": self.num_rows,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume exactly where `state_dict()` was taken (same dataset and world size)."""
        for key in ("num_rows", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state has {key}={state[key]} but this loader has "
                    f"{getattr(self, key)}; resume with the same dataset and data-parallel size"
                )
        if not 0 <= state["position"] < self.num_local_rows:
            raise ValueError(f"loader state position={state['position']} is out of range")
        if state["seed"] != self.seed:
            logger.warning(
                "loader: resuming with the checkpoint's seed %d (was %d)", state["seed"], self.seed
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._perm = None


def _check_positive_int(name: str, value: Any, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1 ({unit})")


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_deeper_than(row: Mapping[str, Any], limit: int) -> bool:
    """Whether a field of `row` nests lists and dicts more than `limit` levels deep (a field
    that is a list of dicts: 2). Iterative: a row nested past Python's recursion limit is
    measured too, and the walk stops at the first container past the limit."""
    stack = [(value, 1) for value in row.values()]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _is_message(item: Any) -> bool:
    return (
        isinstance(item, Mapping)
        and isinstance(item.get("role"), str)
        and isinstance(item.get("content"), str)
    )
