"""`Batch`: the samples one rank holds, as padded tensors plus per-sample metadata.

Layout, for B samples whose longest has T tokens:
    tokens[k]   [B, T, ...]  right-padded with zeros; sample i's tokens are [i, :lengths[i]]
                             ("input_ids" and "attention_mask" are always present)
    samples[k]  [B, ...]     one tensor value per sample (reward, group id, advantage)
    meta[k]     list of B    Python objects (prompt text, image payloads, row ids)
Padding positions hold 0 in every token field; read valid positions through attention_mask.

A batch converts to and from a list of per-sample dicts (token fields unpadded). Rebalancing
does not go through them: `yatt.balance.across_ranks.rebalance_rows` moves only the rows a plan moves,
the rows bound for one peer as one payload (`_take_rows`: token fields packed end to end,
sample fields stacked, metadata as lists), and the receiver writes its kept rows and every
payload straight into one new padded batch (`_assemble`): samples change shape once.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

Index = Sequence[int] | torch.Tensor


def _as_tensor(value: Any, key: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"field {key!r}: {type(value).__name__} is not convertible to a tensor"
        ) from err


class Batch:
    """Per-sample tensors and metadata of one rank; see the module docstring for the layout."""

    def __init__(
        self,
        *,
        tokens: Mapping[str, torch.Tensor],
        samples: Mapping[str, torch.Tensor] | None = None,
        meta: Mapping[str, list[Any]] | None = None,
    ) -> None:
        self.tokens: dict[str, torch.Tensor] = dict(tokens)
        self.samples: dict[str, torch.Tensor] = dict(samples or {})
        self.meta: dict[str, list[Any]] = {k: list(v) for k, v in (meta or {}).items()}
        self.validate()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_samples(
        cls,
        rows: Sequence[Mapping[str, Any]],
        *,
        token_keys: Iterable[str] = ("input_ids",),
        like: Batch | None = None,
    ) -> Batch:
        """Pad a list of per-sample dicts into a batch.

        Keys in `token_keys` hold one value per token ([L] or [L, ...], a tensor or a list) with
        L = len(row["input_ids"]); numbers and same-shape tensors become sample fields (stacked);
        anything else (strings, numpy arrays, tensors of differing shapes) is metadata. An empty `rows` needs `like`, a batch whose
        fields, dtypes and devices the empty batch takes.
        """
        if not rows:
            if like is None:
                raise ValueError("Batch.from_samples([]) needs like=<a batch with the same fields>")
            return like.select([])
        token_keys = list(token_keys)
        if "input_ids" not in token_keys:
            token_keys.insert(0, "input_ids")
        keys = list(rows[0])
        for i, row in enumerate(rows):
            if set(row) != set(keys):
                raise ValueError(f"rows[{i}] has keys {sorted(row)}; rows[0] has {sorted(keys)}")
        missing = [k for k in token_keys if k not in rows[0]]
        if missing:
            raise ValueError(f"token_keys {missing} are not in the rows (keys: {sorted(keys)})")
        if "attention_mask" in rows[0]:
            raise ValueError("rows must not carry 'attention_mask'; Batch builds it from lengths")
        per_key = {k: [_as_tensor(row[k], k) for row in rows] for k in token_keys}
        lengths = [int(t.shape[0]) if t.dim() else -1 for t in per_key["input_ids"]]
        if min(lengths) < 1:
            raise ValueError("every row's input_ids must be a non-empty 1-D sequence")
        tokens: dict[str, torch.Tensor] = {}
        for k, values in per_key.items():
            for i, (value, length) in enumerate(zip(values, lengths, strict=True)):
                if value.dim() == 0 or value.shape[0] != length:
                    raise ValueError(
                        f"rows[{i}][{k!r}] has shape {tuple(value.shape)}; a token field needs "
                        f"one entry per input id ({length})"
                    )
            tokens[k] = torch.nn.utils.rnn.pad_sequence(values, batch_first=True)
        tokens["attention_mask"] = _mask_from_lengths(lengths, tokens["input_ids"].device)
        samples: dict[str, torch.Tensor] = {}
        meta: dict[str, list[Any]] = {}
        for k in keys:
            if k in per_key:
                continue
            values = [row[k] for row in rows]
            if all(isinstance(v, bool | int | float | np.integer | np.floating) for v in values):
                samples[k] = torch.as_tensor(values)
            elif all(isinstance(v, torch.Tensor) for v in values) and (
                len({tuple(v.shape) for v in values}) == 1
            ):
                samples[k] = torch.stack(values)
            else:
                # Ragged tensors (images of different sizes) stay per-sample, uncopied.
                meta[k] = values
        return cls(tokens=tokens, samples=samples, meta=meta)

    def to_samples(self) -> list[dict[str, Any]]:
        """Per-sample dicts with token fields unpadded; `from_samples` inverts it."""
        lengths = self.lengths.tolist()
        rows: list[dict[str, Any]] = []
        for i, length in enumerate(lengths):
            row: dict[str, Any] = {
                k: v[i, :length] for k, v in self.tokens.items() if k != "attention_mask"
            }
            row.update({k: v[i] for k, v in self.samples.items()})
            row.update({k: v[i] for k, v in self.meta.items()})
            rows.append(row)
        return rows

    @property
    def token_keys(self) -> list[str]:
        """Token fields other than the derived attention mask (what `from_samples` needs)."""
        return [k for k in self.tokens if k != "attention_mask"]

    # -- access ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.tokens["input_ids"].shape[0])

    def __contains__(self, key: object) -> bool:
        return key in self.tokens or key in self.samples or key in self.meta

    def __getitem__(self, key: str) -> Any:
        for fields in (self.tokens, self.samples, self.meta):
            if key in fields:
                return fields[key]
        raise KeyError(f"{key!r} is not a field of this batch; fields: {sorted(self.keys())}")

    def keys(self) -> Iterator[str]:
        yield from self.tokens
        yield from self.samples
        yield from self.meta

    @property
    def lengths(self) -> torch.Tensor:
        """Valid tokens per sample, int64 [B]."""
        return self.tokens["attention_mask"].sum(-1, dtype=torch.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def validate(self) -> None:
        """Raise ValueError if a field disagrees with the layout (after direct dict edits)."""
        for key in ("input_ids", "attention_mask"):
            if key not in self.tokens:
                raise ValueError(f"Batch.tokens needs {key!r}; use Batch.from_samples to build one")
        ids = self.tokens["input_ids"]
        if ids.dim() != 2:
            raise ValueError(f"tokens['input_ids'] must be [B, T]; got {tuple(ids.shape)}")
        size, length = ids.shape
        names = set()
        for fields in (self.tokens, self.samples, self.meta):
            clash = names & set(fields)
            if clash:
                raise ValueError(
                    f"fields {sorted(clash)} appear in more than one of tokens/samples/meta"
                )
            names |= set(fields)
        for k, v in self.tokens.items():
            if v.dim() < 2 or tuple(v.shape[:2]) != (size, length):
                raise ValueError(
                    f"tokens[{k!r}] has shape {tuple(v.shape)}; need [B={size}, T={length}, ...]"
                )
        for k, v in self.samples.items():
            if v.dim() < 1 or v.shape[0] != size:
                raise ValueError(f"samples[{k!r}] has shape {tuple(v.shape)}; need [B={size}, ...]")
        for k, v in self.meta.items():
            if len(v) != size:
                raise ValueError(f"meta[{k!r}] has {len(v)} entries; need B={size}")

    # -- transformations ---------------------------------------------------------------------

    def select(self, index: Index) -> Batch:
        """The samples at `index` (ints or a bool mask), trimmed to their longest length."""
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            index = index.nonzero().flatten()
        idx = torch.as_tensor(
            list(index) if not isinstance(index, torch.Tensor) else index, dtype=torch.int64
        )
        idx_list = idx.tolist()
        lengths = self.lengths
        width = int(lengths[idx].max()) if idx.numel() else 0
        tokens = {k: v[idx.to(v.device), :width] for k, v in self.tokens.items()}
        samples = {k: v[idx.to(v.device)] for k, v in self.samples.items()}
        meta = {k: [v[i] for i in idx_list] for k, v in self.meta.items()}
        return Batch(tokens=tokens, samples=samples, meta=meta)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """One batch holding every sample of `batches`, in order; fields must match."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            for name in ("tokens", "samples", "meta"):
                if set(getattr(b, name)) != set(getattr(first, name)):
                    raise ValueError(
                        f"batches[{i}].{name} has fields {sorted(getattr(b, name))}; batches[0] "
                        f"has {sorted(getattr(first, name))}"
                    )
        width = max(b.tokens["input_ids"].shape[1] for b in batches)
        tokens = {
            k: torch.cat([_pad_to(b.tokens[k], width) for b in batches]) for k in first.tokens
        }
        samples = {k: torch.cat([b.samples[k] for b in batches]) for k in first.samples}
        meta = {k: [x for b in batches for x in b.meta[k]] for k in first.meta}
        return Batch(tokens=tokens, samples=samples, meta=meta)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """A batch with every tensor on `device`; metadata is shared, not copied."""
        return Batch(
            tokens={k: v.to(device, non_blocking=non_blocking) for k, v in self.tokens.items()},
            samples={k: v.to(device, non_blocking=non_blocking) for k, v in self.samples.items()},
            meta=self.meta,
        )

    def unpad(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Token fields packed end to end, [N, ...] with N = num_tokens, and cu_seqlens [B + 1]
        (int32; sample i is rows cu_seqlens[i]:cu_seqlens[i + 1]), the varlen-attention layout."""
        mask_BT = self.tokens["attention_mask"].bool()
        packed = {k: v[mask_BT] for k, v in self.tokens.items() if k != "attention_mask"}
        cu_seqlens = torch.nn.functional.pad(self.lengths.cumsum(0), (1, 0)).to(torch.int32)
        return packed, cu_seqlens

    def with_packed(self, packed: Mapping[str, torch.Tensor], cu_seqlens: torch.Tensor) -> Batch:
        """A copy of this batch with token fields padded back from the `unpad` layout."""
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        if lengths != self.lengths.tolist():
            raise ValueError("cu_seqlens does not match this batch's lengths")
        tokens = dict(self.tokens)
        for k, flat in packed.items():
            tokens[k] = torch.nn.utils.rnn.pad_sequence(list(flat.split(lengths)), batch_first=True)
        return Batch(tokens=tokens, samples=self.samples, meta=self.meta)

    # -- exchange across data-parallel ranks -------------------------------------------------

    def rebalance(
        self,
        *,
        group: Any = None,
        group_key: str | None = None,
        costs: Sequence[float] | None = None,
        is_equal_size: bool = False,
        tolerance: float = 1e-3,
    ) -> tuple[Batch, Any]:
        """Balance samples across the data-parallel ranks of `group` (collective).

        Only lengths (and costs) are all-gathered; the samples the plan moves travel
        point-to-point through yatt.balance.across_ranks, tensors as raw bytes. group_key names a sample
        field whose equal values stay on one rank (a GRPO group); costs default to the lengths
        (pass yatt.balance.flops_cost(...) to weigh attention); is_equal_size gives every rank
        the same number of samples; tolerance trades balance for fewer moved samples (see
        yatt.balance.across_ranks.rebalance; 0 = best balance). Returns (this rank's batch, plan) for
        `restore`.
        """
        from yatt.balance.across_ranks import rebalance_rows

        groups = None if group_key is None else self[group_key].tolist()
        lengths_B = self.lengths
        moved, plan = rebalance_rows(
            functools.partial(_take_rows_to_send, self, lengths_B),
            lengths_B.cpu().numpy(),
            group=group,
            groups=groups,
            costs=costs,
            equal_size=is_equal_size,
            tolerance=tolerance,
        )
        return _assemble(self, lengths_B, moved), plan

    def restore(self, plan: Any, *, group: Any = None) -> Batch:
        """Inverse of `rebalance` (same group): every sample back on its origin rank, in its
        original order, carrying any fields added since."""
        from yatt.balance.across_ranks import restore_rows

        lengths_B = self.lengths
        moved = restore_rows(
            functools.partial(_take_rows_to_send, self, lengths_B),
            plan,
            num_rows=len(self),
            group=group,
        )
        return _assemble(self, lengths_B, moved)

    def __repr__(self) -> str:
        return (
            f"Batch(size={len(self)}, width={self.tokens['input_ids'].shape[1]}, "
            f"tokens={sorted(self.tokens)}, samples={sorted(self.samples)}, meta={sorted(self.meta)})"
        )


def _mask_from_lengths(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    lengths_B = torch.as_tensor(lengths, dtype=torch.int64, device=device)
    width = int(lengths_B.max()) if lengths_B.numel() else 0
    return (torch.arange(width, device=device)[None, :] < lengths_B[:, None]).to(torch.int64)


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[1] == width:
        return x
    pad = x.new_zeros((x.shape[0], width - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], dim=1)


# -- rows on the move (Batch.rebalance / Batch.restore) ----------------------------------------
#
# The payload for some rows of a batch (rows bound for one peer, or the rows a rank keeps), n
# rows holding N = sum(lengths) valid tokens:
#     lengths        int64 [n]
#     tokens[k]      [N, ...]   valid positions only, row after row (attention_mask is rebuilt)
#     samples[k]     [n, ...]
#     meta[k]        list of n
# yatt.balance.across_ranks moves tensors as raw bytes but pickles other objects (a pickle is a
# second and third copy of an image). Numeric numpy arrays in metadata therefore travel as
# zero-copy tensor views, tagged so the receiver turns them back into arrays.
_ARRAY_TAG = "__yatt_ndarray__"


def _take_rows(batch: Batch, lengths_B: torch.Tensor, rows: np.ndarray) -> dict[str, Any]:
    """The payload for `rows` (ascending int64 indices) of `batch`; lengths_B is batch.lengths."""
    rows_n = torch.from_numpy(rows).to(lengths_B.device)
    lengths_n = lengths_B[rows_n]
    width = batch.tokens["input_ids"].shape[1]
    source_N = _flat_token_index(rows_n, lengths_n, width)
    return {
        "lengths": lengths_n,
        "tokens": {
            # flatten is a view of a contiguous field (a copy of any other).
            k: v.flatten(0, 1).index_select(0, source_N.to(v.device))
            for k, v in batch.tokens.items()
            if k != "attention_mask"
        },
        "samples": {k: v.index_select(0, rows_n.to(v.device)) for k, v in batch.samples.items()},
        "meta": {k: [v[i] for i in rows.tolist()] for k, v in batch.meta.items()},
    }


def _take_rows_to_send(batch: Batch, lengths_B: torch.Tensor, rows: np.ndarray) -> dict[str, Any]:
    payload = _take_rows(batch, lengths_B, rows)
    payload["meta"] = {k: [_wrap_array(x) for x in v] for k, v in payload["meta"].items()}
    return payload


def _assemble(batch: Batch, lengths_B: torch.Tensor, moved: Any) -> Batch:
    """The batch a rank holds after a move (a yatt.balance.across_ranks.MovedRows): its kept rows of
    `batch` and every received payload, written once into new padded tensors."""
    if moved.num_rows == 0:
        return batch.select([])
    # (where the rows come from, their positions here, their payload)
    parts = [
        (f"rank {peer}", moved.received_at[peer], _unwrap_arrays(payload))
        for peer, payload in moved.received.items()
    ]
    if moved.kept.size:
        parts.insert(0, ("this rank", moved.kept_at, _take_rows(batch, lengths_B, moved.kept)))
    first = parts[0][2]
    for source, _, payload in parts[1:]:
        _check_same_fields(payload, source, first, parts[0][0])
    device = first["lengths"].device
    at_by_part = [torch.from_numpy(at).to(device) for _, at, _ in parts]
    lengths_by_part = [payload["lengths"].to(device) for _, _, payload in parts]
    lengths_b = torch.empty(moved.num_rows, dtype=torch.int64, device=device)
    for at_n, lengths_n in zip(at_by_part, lengths_by_part, strict=True):
        lengths_b[at_n] = lengths_n
    width = int(lengths_b.max())
    target_by_part = [
        _flat_token_index(at_n, lengths_n, width)
        for at_n, lengths_n in zip(at_by_part, lengths_by_part, strict=True)
    ]
    tokens: dict[str, torch.Tensor] = {}
    for k, like in first["tokens"].items():
        values = [payload["tokens"][k] for _, _, payload in parts]
        out = like.new_zeros((moved.num_rows, width, *like.shape[1:]), dtype=_common_dtype(values))
        for target_N, value in zip(target_by_part, values, strict=True):
            out.flatten(0, 1).index_copy_(0, target_N.to(out.device), value.to(out))
        tokens[k] = out
    mask = torch.zeros((moved.num_rows, width), dtype=torch.int64, device=device)
    for target_N in target_by_part:
        mask.view(-1).index_fill_(0, target_N, 1)
    tokens["attention_mask"] = mask.to(tokens["input_ids"].device)
    samples: dict[str, torch.Tensor] = {}
    for k, like in first["samples"].items():
        values = [payload["samples"][k] for _, _, payload in parts]
        out = like.new_empty((moved.num_rows, *like.shape[1:]), dtype=_common_dtype(values))
        for at_n, value in zip(at_by_part, values, strict=True):
            out.index_copy_(0, at_n.to(out.device), value.to(out))
        samples[k] = out
    meta: dict[str, list[Any]] = {}
    for k in first["meta"]:
        meta[k] = [None] * moved.num_rows
        for _, at, payload in parts:
            for i, value in zip(at.tolist(), payload["meta"][k], strict=True):
                meta[k][i] = value
    return Batch(tokens=tokens, samples=samples, meta=meta)


def _flat_token_index(rows_n: torch.Tensor, lengths_n: torch.Tensor, width: int) -> torch.Tensor:
    """Where each valid token of `rows_n` sits in a [rows, width] tensor flattened to one
    dimension, row after row: the packed order of a payload's token fields."""
    starts_n = torch.cumsum(lengths_n, 0) - lengths_n
    # Host/device sync on CUDA: the number of tokens sizes the output.
    index_N = torch.repeat_interleave(rows_n * width - starts_n, lengths_n)
    index_N += torch.arange(index_N.shape[0], device=index_N.device)
    return index_N


def _check_same_fields(
    payload: dict[str, Any], source: str, first: dict[str, Any], first_source: str
) -> None:
    """Rows from different ranks can share one batch only if their fields agree."""
    for kind in ("tokens", "samples", "meta"):
        if set(payload[kind]) != set(first[kind]):
            raise ValueError(
                f"rows from {source} have {kind} fields {sorted(payload[kind])} but rows from "
                f"{first_source} have {sorted(first[kind])}: every rank's batch needs the same "
                "fields for rebalance/restore"
            )
    for kind in ("tokens", "samples"):
        for k, value in payload[kind].items():
            like = first[kind][k]
            if value.shape[1:] != like.shape[1:]:
                raise ValueError(
                    f"{kind}[{k!r}] has trailing shape {tuple(value.shape[1:])} in rows from "
                    f"{source} but {tuple(like.shape[1:])} in rows from {first_source}: every "
                    "rank's batch needs the same shape per row (samples) or per token (tokens)"
                )


def _common_dtype(values: list[torch.Tensor]) -> torch.dtype:
    # As torch.cat would: rows whose dtypes differ by rank (int rewards here, float there)
    # share the promoted dtype.
    return functools.reduce(torch.promote_types, (v.dtype for v in values))


def _wrap_array(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        with warnings.catch_warnings():
            # Read-only arrays are fine: the view is only read (copied into a send buffer).
            warnings.filterwarnings("ignore", message=".*not writable.*")
            return (_ARRAY_TAG, torch.from_numpy(np.ascontiguousarray(value)))
    return value


def _unwrap_arrays(payload: dict[str, Any]) -> dict[str, Any]:
    def unwrap(value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == 2 and value[0] == _ARRAY_TAG:
            return value[1].numpy()
        return value

    meta = {k: [unwrap(x) for x in v] for k, v in payload["meta"].items()}
    return {**payload, "meta": meta}
