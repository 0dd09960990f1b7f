"""A rank's next prompts: rows from its ShardedLoader through a PromptEncoder, unusable ones
skipped (and counted by both), redrawn until some are usable.

    prompts = draw_prompts(loader, encoder, num_rows)   # list[Prompt], never empty
"""

from __future__ import annotations

from typing import Any

from yatt.core.data._prompts import Prompt


def draw_prompts(loader: Any, encoder: Any, num_rows: int) -> list[Prompt]:
    """This rank's next prompts (`loader` a ShardedLoader, `encoder` a PromptEncoder). A draw
    of only unusable rows (skipped and counted) draws again; once a whole epoch of the shard
    gave no usable prompt (the loader's skips or the encoder's) no number of draws could, and
    a ValueError names the counts."""
    num_drawn = 0
    prompts: list[Prompt] = []
    while not prompts:
        if num_drawn >= 2 * loader.num_local_rows:  # twice the shard: a whole epoch in it
            raise ValueError(
                f"data.path: the last {num_drawn} rows rank {loader.rank} drew (a whole epoch "
                f"of its {loader.num_local_rows} rows) gave no usable prompt; skipped rows by "
                f"cause: {encoder.skipped_by_cause(loader)}"
            )
        rows = loader.next_batch(num_rows)
        num_drawn += max(len(rows), 1)
        prompts = encoder.encode(rows)
    return prompts
