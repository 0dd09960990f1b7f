"""Dotted names read nested row fields (verl's `reward_model.ground_truth`) wherever a field is
named, and a field no row has is an error naming it and the fields the rows do have."""

NUM_GPUS = 0

import json

import pytest

from yatt.core import ShardedLoader, get_field, has_field
from yatt.core.data._row_fields import with_field

# A row as verl's examples/data_preprocess/gsm8k.py writes it.
VERL_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "3+4=?"}],
    "reward_model": {"style": "rule", "ground_truth": "7"},
    "extra_info": {"split": "train", "index": 0},
}


def test_a_dotted_name_reads_the_nested_field():
    assert get_field(VERL_ROW, "reward_model.ground_truth") == "7"
    assert get_field(VERL_ROW, "extra_info.index") == 0
    assert get_field(VERL_ROW, "reward_model.missing") is None
    assert get_field(VERL_ROW, "data_source.x", "default") == "default"  # a str is no mapping
    assert has_field(VERL_ROW, "reward_model.style")
    assert not has_field(VERL_ROW, "reward_model.ground_truth.x")
    # A column literally named with a dot wins over the nested reading.
    assert get_field({"a.b": 1, "a": {"b": 2}}, "a.b") == 1


def test_setting_a_nested_field_copies_its_path_only():
    row = {"x": {"y": 1, "z": 2}, "w": [3]}
    new = with_field(row, "x.y", 10)
    assert new == {"x": {"y": 10, "z": 2}, "w": [3]}
    assert row["x"]["y"] == 1 and new["w"] is row["w"]


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_loader_reads_and_requires_nested_fields(tmp_path):
    rows = [VERL_ROW, {**VERL_ROW, "reward_model": {"style": "rule"}}]
    path = _write(tmp_path / "gsm8k.jsonl", rows)
    loader = ShardedLoader(
        path, batch_size=2, should_shuffle=False, required_keys=["reward_model.ground_truth"]
    )
    (row,) = loader.next_batch()
    assert get_field(row, "reward_model.ground_truth") == "7"
    assert loader.skipped_by_cause()["no_field"] == 1


@pytest.mark.parametrize("argument", ["required_keys", "expected_keys"])
def test_a_field_no_row_has_is_an_error_naming_it_and_the_fields_rows_have(tmp_path, argument):
    path = _write(tmp_path / "gsm8k.jsonl", [VERL_ROW])
    with pytest.raises(ValueError) as err:
        ShardedLoader(path, batch_size=1, **{argument: ["reward_model.answer"]})
    message = str(err.value)
    assert f"{argument}='reward_model.answer' is not a field" in message
    assert "'reward_model.ground_truth'" in message and "'extra_info.index'" in message


def test_an_expected_field_some_rows_lack_keeps_those_rows(tmp_path):
    rows = [VERL_ROW, {"prompt": "1+1="}]
    path = _write(tmp_path / "rows.jsonl", rows)
    loader = ShardedLoader(
        path, batch_size=2, should_shuffle=False, expected_keys=["reward_model.ground_truth"]
    )
    assert len(loader.next_batch()) == 2
