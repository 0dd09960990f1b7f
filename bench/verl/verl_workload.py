"""The parts of bench/verl/verl_plugins.py that need no verl (tested on the CPU): which forced length
a copy of a dataset row gets, and the judge's prompt ids as yatt's GenRM renders them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))  # bench/step: _step_setup
from _step_setup import JUDGE_USER, ids_to_text  # bench/ is not a package


def forced_length(
    extra_info: dict[str, Any], copies_seen: dict[int, int], session_id: int | None = None
) -> int:
    """The forced response length of one copy of a dataset row: the k-th copy takes the k-th of
    the row's `forced_lengths` (its GRPO group's, prompt-major, group-minor). k is the copy's
    session_id where verl gives one (its V1 trainer numbers a prompt's n samples 0..n-1), else
    the copies of the row counted so far in `copies_seen` (row index -> count; the V0 trainer)."""
    lengths = [int(n) for n in extra_info["forced_lengths"]]
    if not lengths:
        raise ValueError(f"extra_info.forced_lengths of row {extra_info.get('index')} is empty")
    if session_id is not None:
        return lengths[int(session_id) % len(lengths)]
    row = int(extra_info["index"])
    k = copies_seen.get(row, 0)
    copies_seen[row] = k + 1
    return lengths[k % len(lengths)]


def prompt_text(raw_prompt: Any) -> str:
    """The policy's prompt text from verl's `raw_prompt` (the row's chat messages): the last
    message's content (the bench's rows hold one user message)."""
    messages = list(raw_prompt)
    if not messages or not isinstance(messages[-1], dict) or "content" not in messages[-1]:
        raise ValueError(f"raw_prompt {raw_prompt!r}: expected chat messages with a content")
    return str(messages[-1]["content"])


def judge_prompt_ids(tokenizer: Any, prompt: str, response_ids: list[int]) -> list[int]:
    """The judge's prompt token ids, as yatt.genrm.JudgeTemplate(user=JUDGE_USER).render_ids
    makes them with a chat-template tokenizer: the response shown one letter per token."""
    content = JUDGE_USER.format(prompt=prompt, response=ids_to_text(response_ids))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
