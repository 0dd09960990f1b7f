"""held_cut_groups' prompt in a checkpoint (saved_prompt / loaded_prompt) and Resumed's metrics;
tests/test_train_grpo_resume.py runs them through a real Checkpointer and the trainer's config."""

NUM_GPUS = 0

import json

from yatt import core


class _Encoder:
    """A row's ids are its prompt's characters, shifted by `offset` (another tokenizer)."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset

    def encode(self, rows, *, should_count=True):
        return [
            core.Prompt(dict(row), [ord(c) + self.offset for c in row["prompt"]]) for row in rows
        ]


def test_a_json_row_is_kept_whole_and_rebuilt_with_the_same_ids():
    prompt = _Encoder().encode([{"prompt": "ab", "answer": 3}])[0]
    saved = core.saved_prompt(prompt)
    assert saved == {"row": {"prompt": "ab", "answer": 3}, "ids": [97, 98]}
    assert json.loads(json.dumps(saved)) == saved  # what a checkpoint can hold
    rebuilt = core.loaded_prompt(saved, _Encoder())
    assert rebuilt.row == prompt.row and list(rebuilt.ids) == [97, 98]
    assert core.loaded_prompt(saved, _Encoder(offset=1)) is None  # other ids: dropped


def test_a_row_json_cannot_hold_is_kept_by_its_index_and_read_again():
    row = {"prompt": "ab", "image": object(), core.ROW_INDEX_KEY: 7}
    saved = core.saved_prompt(core.Prompt(row, [97, 98]))
    assert saved == {"row_index": 7, "ids": [97, 98]}
    read = []

    def read_rows(indices):
        read.extend(indices)
        return [{"prompt": "ab"}]

    assert core.loaded_prompt(saved, _Encoder()) is None  # no way to read it again
    assert list(core.loaded_prompt(saved, _Encoder(), read_rows=read_rows).ids) == [97, 98]
    assert read == [7]
    no_index = core.Prompt({"prompt": "ab", "image": object()}, [97, 98])
    assert core.saved_prompt(no_index) is None


def test_held_cut_groups_needs_rollout_correction_and_resumed_counts_on_one_rank():
    partials = core.held_cut_groups("token_tis", _Encoder(), None)
    assert isinstance(partials, core.PartialRollouts)
    resumed = core.Resumed(start_step=4, num_partial_groups_dropped=2, changed=("data.path",))
    assert resumed.metrics(None) == {
        core.RESUME_DROPPED_METRIC: 2.0,
        "resume/changed/data.path": 1.0,
    }
