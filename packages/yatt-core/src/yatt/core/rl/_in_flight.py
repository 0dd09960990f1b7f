"""The prompts started but not yet trained, with their versions: what a checkpoint must hold
so that a resumed off-policy run trains every prompt of an epoch exactly once.

    loader position --- next_batch ---> in flight (generating) ---> finished ---> taken (trained)
                                        |_____________ InFlightPrompts ______|

A checkpoint taken with the loader's state and this object's state holds every prompt the
loader gave out and the trainer has not yet taken: the loader resumes after them, and on
resume each prompt here is either finished (its group was done: it is trained as it is) or
re-queued (its generation restarts from its row), exactly once. A prompt the trainer took
is gone from here, so a resumed run never trains it again (NVIDIA-NeMo/RL PR #3599: an async
resume that lost its in-flight prompts skipped about 30% of them, the long ones first).

Each prompt has a number, its place in start order (0, 1, ...), which is its key: a small
dataset's row may be in flight twice, drawn again in the next epoch. "result" is whatever the
generate function returned (the group's completions with their per-token versions); it must
be picklable, since it is saved with the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass
class InFlightPrompt:
    number: int  # place in start order (0-based; AdmissionControl.version_trained_at reads it)
    row_index: int  # the loader's ROW_INDEX_KEY: rebuilds the row on resume (read_rows)
    version: int  # the policy version its generation (last) started under
    result: Any = None  # the finished group; None while generating
    finish_order: int = -1  # when it finished, among all prompts (-1: still generating)

    @property
    def is_finished(self) -> bool:
        return self.finish_order >= 0


class InFlightPrompts:
    """Prompts started and not yet taken by the trainer, by number. Not thread-safe: the
    caller holds its lock (yatt.core.rl._async_rollout does)."""

    def __init__(self) -> None:
        self._prompts: dict[int, InFlightPrompt] = {}
        self._num_finished = 0

    def __len__(self) -> int:
        return len(self._prompts)

    def __contains__(self, number: object) -> bool:
        return number in self._prompts

    def add(self, number: int, *, row_index: int, version: int) -> None:
        """A prompt whose generation starts now under weights `version`."""
        assert number not in self._prompts, f"prompt {number} is already in flight"
        self._prompts[number] = InFlightPrompt(number, int(row_index), int(version))

    def finish(self, number: int, result: Any) -> None:
        """Its group is done; `result` is kept (and checkpointed) until the trainer takes it."""
        prompt = self._prompts[number]
        assert not prompt.is_finished, f"prompt {number} finished twice"
        prompt.result = result
        prompt.finish_order = self._num_finished
        self._num_finished += 1

    def drop(self, number: int) -> InFlightPrompt:
        """Forget a prompt that will never be trained (its generation failed, its row is gone)."""
        return self._prompts.pop(number)

    @property
    def num_finished(self) -> int:
        """Finished prompts waiting for the trainer."""
        return sum(p.is_finished for p in self._prompts.values())

    def take_finished(self, num_prompts: int) -> list[InFlightPrompt]:
        """The `num_prompts` earliest finished prompts (finish order), removed from flight."""
        finished = sorted(
            (p for p in self._prompts.values() if p.is_finished), key=lambda p: p.finish_order
        )
        assert len(finished) >= num_prompts, (len(finished), num_prompts)
        for prompt in finished[:num_prompts]:
            del self._prompts[prompt.number]
        return finished[:num_prompts]

    def put_back(self, prompt: InFlightPrompt) -> None:
        """A finished prompt the trainer took but did not train (a step a stop signal
        ended): in flight again, so the checkpoint holds it."""
        assert prompt.number not in self._prompts, f"prompt {prompt.number} is in flight"
        assert prompt.is_finished, f"prompt {prompt.number} never finished"
        self._prompts[prompt.number] = prompt

    def unfinished(self) -> list[InFlightPrompt]:
        """Prompts still generating, in start order (what a resume re-queues)."""
        return sorted((p for p in self._prompts.values() if not p.is_finished), key=_number)

    def restart(self, number: int, *, version: int) -> None:
        """A re-queued prompt's generation starts again under weights `version`."""
        prompt = self._prompts[number]
        assert not prompt.is_finished, f"prompt {number} is finished; it is not re-queued"
        prompt.version = int(version)

    def state_dict(self, *, should_save_results: bool = True) -> dict[str, Any]:
        """Every prompt by number; without should_save_results a finished prompt is written
        as unfinished (no result: a resume generates it again, once), so a result need not
        be JSON-able and is never copied."""
        prompts = sorted(self._prompts.values(), key=_number)
        if not should_save_results:
            prompts = [replace(p, result=None, finish_order=-1) for p in prompts]
        return {"prompts": [asdict(p) for p in prompts], "num_finished": self._num_finished}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        prompts = _prompts_from(state["prompts"])
        numbers = [p.number for p in prompts]
        if len(set(numbers)) != len(numbers):
            raise ValueError(f"in-flight state lists prompt numbers twice: {sorted(numbers)}")
        self._prompts = {p.number: p for p in prompts}
        self._num_finished = int(state["num_finished"])


def _prompts_from(entries: Iterable[Mapping[str, Any]]) -> list[InFlightPrompt]:
    return [InFlightPrompt(**dict(entry)) for entry in entries]


def _number(prompt: InFlightPrompt) -> int:
    return prompt.number
