"""rollout.keep_partial's cut groups across a checkpoint: each held group's prompt as its data
row and ids, and back through the run's encoder.

    partials = held_cut_groups("token_tis", encoder, loader)   # a PartialRollouts
    ckpt.track("partials", partials)                            # saved with each checkpoint

A checkpoint keeps each held group's prompt as its data row and ids (saved_prompt;
loaded_prompt rebuilds it through the run's encoder), so a run resumed after a crash resumes
the groups the uninterrupted run would have. A row with opened images is not JSON: it is kept
by its dataset index (ROW_INDEX_KEY) and read again on resume (ShardedLoader.read_rows), its
images opened anew. A group whose prompt cannot be rebuilt (its row unusable now, other ids)
is dropped, counted (PartialRollouts.num_dropped_on_load).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from yatt.core.data._loader import ROW_INDEX_KEY
from yatt.core.data._prompts import Prompt
from yatt.core.rl._partial_rollouts import PartialRollouts


def saved_prompt(prompt: Prompt) -> dict | None:
    """A cut group's prompt as a checkpoint keeps it (PartialRollouts.state_dict(save_prompt=)):
    its ids and its data row, JSON-able; a row JSON cannot hold as it is (its opened images)
    by its dataset index instead (`row_index`, read again on resume). None for such a row
    without an index (not the loader's): that group is not resumed (loaded_prompt drops it)."""
    ids = [int(t) for t in prompt.ids]
    try:
        row = json.loads(json.dumps(prompt.row, allow_nan=False))
    except (TypeError, ValueError):
        row = None
    if row is not None and row == prompt.row:
        return {"row": row, "ids": ids}
    index = prompt.row.get(ROW_INDEX_KEY)
    if isinstance(index, int) and not isinstance(index, bool):
        return {"row_index": index, "ids": ids}
    return None


def loaded_prompt(
    saved: dict | None,
    encoder: Any,
    *,
    read_rows: Callable[[list[int]], list[dict | None]] | None = None,
) -> Prompt | None:
    """The Prompt `saved_prompt` stored, rebuilt by the run's encoder (encoder.encode(rows,
    should_count=False)); a row kept by its index is read again by `read_rows` (the run's
    ShardedLoader.read_rows). None (the group dropped) when the row is unusable now, no
    read_rows is given for it, or it no longer gives a prompt or gives other ids (another
    tokenizer or chat template, other images): its responses continue those ids."""
    if saved is None:
        return None
    if "row_index" in saved:
        if read_rows is None:
            return None
        (row,) = read_rows([saved["row_index"]])
        if row is None:
            return None
    else:
        row = saved["row"]
    prompts = encoder.encode([row], should_count=False)
    if len(prompts) != 1 or list(prompts[0].ids) != list(saved["ids"]):
        return None
    return prompts[0]


def held_cut_groups(rollout_correction: str, encoder: Any, loader: Any) -> PartialRollouts:
    """rollout.keep_partial's holder of cut groups (a PartialRollouts); a checkpoint keeps each
    one's prompt as its row and ids (saved_prompt), rebuilt on resume through the run's
    `encoder` (a PromptEncoder), a row with opened images read again by its index through
    `loader` (a ShardedLoader; None: such groups are dropped on resume)."""
    read_rows = None if loader is None else loader.read_rows
    return PartialRollouts(
        rollout_correction=rollout_correction,
        save_prompt=saved_prompt,
        load_prompt=lambda saved: loaded_prompt(saved, encoder, read_rows=read_rows),
    )
