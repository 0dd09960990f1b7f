"""Retention, and the clear errors / fallbacks for bad roots and damaged or mismatched checkpoints."""

NUM_GPUS = 0

import hashlib
import json
import random

import pytest
import torch
from torch import nn

from yatt.ckpt import Checkpointer, CheckpointError


def steps_on_disk(root) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if p.is_dir())


def save_steps(root, steps, **kwargs) -> None:
    value = torch.zeros(4)
    with Checkpointer(root, **kwargs) as ckpt:
        for step in steps:
            value.fill_(step)
            ckpt.save(step, {"value": value}, extra={"step": step})


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "want"),
    [
        (3, None, [8, 9, 10]),
        (1, None, [10]),
        (2, 4, [4, 8, 9, 10]),
        (1, 3, [3, 6, 9, 10]),
    ],
    ids=["last3", "last1", "last2-every4", "last1-every3"],
)
def test_retention_keeps_last_and_every(tmp_path, keep_last, keep_every, want):
    save_steps(tmp_path, range(1, 11), keep_last=keep_last, keep_every=keep_every)
    assert steps_on_disk(tmp_path) == want
    assert (tmp_path / "latest").read_text().strip() == "step-00000010"


def test_retention_skips_damaged_checkpoints_when_counting(tmp_path):
    save_steps(tmp_path, [1, 2, 3], keep_last=2)
    assert steps_on_disk(tmp_path) == [2, 3]
    (tmp_path / "step-00000003" / "yatt_meta.json").write_text("{not json")
    save_steps(tmp_path, [4], keep_last=2)
    # Step 3 no longer counts as one of the two kept: step 2 survives as the fallback.
    assert steps_on_disk(tmp_path) == [2, 4]


def test_unwritable_root_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"checkpoint root '.*a_file/ckpt' is not a writable"):
        Checkpointer(blocker / "ckpt")


def damage_meta_missing(folder):
    (folder / "yatt_meta.json").unlink()


def damage_meta_garbage(folder):
    (folder / "yatt_meta.json").write_text("\x00garbage")


def damage_meta_wrong_step(folder):
    meta = json.loads((folder / "yatt_meta.json").read_text())
    meta["step"] = 99
    (folder / "yatt_meta.json").write_text(json.dumps(meta))


def damage_data_truncated(folder):
    data = folder / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-5])


def damage_dcp_index_scrambled(folder):
    index = folder / ".metadata"
    index.write_bytes(b"\x13" * index.stat().st_size)  # same size: only the content check sees it


def damage_data_scrambled(folder):
    data = folder / "__0_0.distcp"
    data.write_bytes(b"\x00" * data.stat().st_size)


def damage_rank_file_missing(folder):
    (folder / "rank-00000.json").unlink()


DAMAGES = {
    "meta-missing": (damage_meta_missing, "yatt_meta.json is missing"),
    "meta-garbage": (damage_meta_garbage, "yatt_meta.json is unreadable"),
    "meta-wrong-step": (damage_meta_wrong_step, "says step 99"),
    "data-truncated": (damage_data_truncated, r"__0_0.distcp has \d+ bytes"),
    "index-scrambled": (damage_dcp_index_scrambled, r"\.metadata is damaged: its checksum"),
    "data-scrambled": (damage_data_scrambled, r"__0_0\.distcp is damaged: its checksum"),
    "rank-file-missing": (damage_rank_file_missing, "rank-00000.json is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
def test_damaged_newest_falls_back_with_warning(tmp_path, damage):
    damage_fn, message = DAMAGES[damage]
    save_steps(tmp_path, [1, 2])
    damage_fn(tmp_path / "step-00000002")
    target = torch.full((4,), -1.0)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=message) as err:
            ckpt.load({"value": target}, step=2)
        assert "step-00000002" in str(err.value)
        with pytest.warns(UserWarning, match=f"step-00000002.*{message}.*falling back"):
            extra = ckpt.load({"value": target})
    assert extra == {"step": 1}
    assert torch.equal(target, torch.full((4,), 1.0))


def save_large_steps(root, steps) -> torch.Tensor:
    """Steps of a 64 KB tensor (value = step + index), so damage can land inside tensor bytes."""
    value = torch.zeros(16384)
    with Checkpointer(root) as ckpt:
        for step in steps:
            torch.arange(16384, out=value).add_(step)
            ckpt.save(step, {"value": value}, extra={"step": step})
    return value


def test_same_size_random_bytes_in_a_shard_fall_back_naming_the_file(tmp_path):
    save_large_steps(tmp_path, [1, 2])
    data = tmp_path / "step-00000002" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2  # inside the 64 KB of tensor data, past any header
    raw[middle - 2048 : middle + 2048] = random.Random(0).randbytes(4096)
    data.write_bytes(bytes(raw))  # same size: the size check passes
    target = torch.zeros(16384)
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        with pytest.warns(UserWarning, match=r"step-00000002.*__0_0\.distcp is damaged.*falling"):
            extra = ckpt.load({"value": target})
        with pytest.raises(CheckpointError, match=r"__0_0\.distcp is damaged"):
            ckpt.verify(2)
        ckpt.verify(1)
    assert extra == {"step": 1}
    assert torch.equal(target, torch.arange(16384, dtype=torch.float32) + 1)


def test_an_edited_rank_record_of_the_same_size_falls_back(tmp_path):
    save_steps(tmp_path, [1, 2])
    record = tmp_path / "step-00000002" / "rank-00000.json"
    text = record.read_text()
    assert '"step": 2' in text
    record.write_text(text.replace('"step": 2', '"step": 7'))
    with (
        Checkpointer(tmp_path) as ckpt,
        pytest.warns(UserWarning, match="rank-00000.json is damaged"),
    ):
        assert ckpt.load({"value": torch.zeros(4)}) == {"step": 1}


def block_tree_sha256(data: bytes, block: int = 16 << 20) -> str:
    """The rule the checksum's name states: sha256 over the sha256 digests of 16 MiB blocks."""
    blocks = [data[i : i + block] for i in range(0, len(data), block)]
    return hashlib.sha256(b"".join(hashlib.sha256(b).digest() for b in blocks)).hexdigest()


def test_recorded_checksums_follow_the_stated_rule_for_every_file(tmp_path):
    # 40 MiB of float32: the data file spans three blocks (hashed on several threads).
    value = torch.zeros(10 << 20)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"value": value.uniform_()})
    folder = tmp_path / "step-00000001"
    meta = json.loads((folder / "yatt_meta.json").read_text())
    assert meta["checksums"]["algorithm"] == "sha256-of-16MiB-block-sha256s"
    files = sorted(p.name for p in folder.iterdir() if p.name != "yatt_meta.json")
    assert sorted(meta["checksums"]["files"]) == files
    assert (folder / "__0_0.distcp").stat().st_size > 2 * (16 << 20)
    for name in files:
        want = block_tree_sha256((folder / name).read_bytes())
        assert meta["checksums"]["files"][name] == want, name


def test_a_checkpoint_without_checksums_still_loads(tmp_path):
    """Checkpoints written before checksums were recorded: sizes only, as before."""
    save_steps(tmp_path, [1])
    meta_path = tmp_path / "step-00000001" / "yatt_meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["checksums"]
    meta_path.write_text(json.dumps(meta))
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.verify(1).checksums == {}
        assert ckpt.load({"value": torch.zeros(4)}) == {"step": 1}


def test_all_damaged_raises_listing_each(tmp_path):
    save_steps(tmp_path, [1, 2])
    damage_meta_missing(tmp_path / "step-00000001")
    damage_meta_missing(tmp_path / "step-00000002")
    with (
        Checkpointer(tmp_path) as ckpt,
        pytest.warns(UserWarning),
        pytest.raises(CheckpointError, match=r"no loadable checkpoint.*00000002.*00000001"),
    ):
        ckpt.load({"value": torch.zeros(4)})


def test_verify_reports_damage(tmp_path):
    save_steps(tmp_path, [1])
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.verify(1).step == 1
        damage_data_truncated(tmp_path / "step-00000001")
        with pytest.raises(CheckpointError, match=r"step-00000001.*__0_0\.distcp has"):
            ckpt.verify(1)
        with pytest.raises(CheckpointError, match="step-00000007' does not exist"):
            ckpt.verify(7)


def make_model(hidden: int, num_layers: int = 2) -> nn.Module:
    layers = [nn.Linear(4, hidden)] + [nn.Linear(hidden, hidden) for _ in range(num_layers - 1)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize(
    ("live", "message"),
    [
        (
            lambda: make_model(16),
            r"'model\.0\.weight' has shape \(8, 4\) in the checkpoint and \(16, 4\) in the live",
        ),
        (lambda: make_model(8, num_layers=3), r"it has no tensor 'model\.2\.weight'"),
        (
            lambda: make_model(8, num_layers=1),
            r"it has tensor 'model\.1\.\w+' .* the live state lacks",
        ),
    ],
    ids=["wider", "deeper", "shallower"],
)
def test_different_model_shape_names_key_and_shapes(tmp_path, live, message):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": make_model(8)})
        ckpt.save(2, {"model": make_model(8)})
        target = live()
        before = {k: v.clone() for k, v in target.state_dict().items()}
        # A shape mismatch is a wrong model, not damage: no fallback to step 1.
        with pytest.raises(ValueError, match=message) as err:
            ckpt.load({"model": target})
        assert "step-00000002" in str(err.value)
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key]), "a rejected checkpoint must not touch the model"


def test_live_key_absent_from_checkpoint_is_named(tmp_path):
    model = make_model(8)
    optim = torch.optim.AdamW(model.parameters())
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        other = make_model(8)
        other_optim = torch.optim.AdamW(other.parameters())
        with pytest.raises(ValueError, match=r"no tensor 'extra_state'"):
            ckpt.load({"model": other, "optim": other_optim, "extra_state": torch.zeros(2)})


def test_leftovers_are_removed_before_the_write_probe(tmp_path, monkeypatch):
    # A save that failed on a full disk leaves a .tmp folder holding the space the probe needs.
    from yatt.ckpt import _checkpointer

    leftover = tmp_path / "step-00000007.tmp"
    leftover.mkdir()
    (leftover / "shard.distcp").write_bytes(b"x" * 1024)
    seen_at_probe = []
    original = _checkpointer.check_root_writable

    def probe(root):
        seen_at_probe.append(leftover.exists())
        return original(root)

    monkeypatch.setattr(_checkpointer, "check_root_writable", probe)
    Checkpointer(tmp_path).close()
    assert seen_at_probe == [False] and not leftover.exists()
