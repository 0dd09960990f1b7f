"""export_hf and export_hf_from_checkpoint: a trained policy saved as a Hugging Face folder
reloads with the same weights and logprobs; dtype, sharding, side files, atomic replacement;
checkpoints of one or several ranks; clear errors for missing and damaged checkpoints."""

NUM_GPUS = 0

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from yatt.core import (
    PolicyLoss,
    TorchPolicy,
    TorchPolicyConfig,
    export_hf,
    export_hf_from_checkpoint,
)
from yatt.core.policy import _export as export_module
from yatt.core.policy._export import EXPORT_MARKER, check_export_dir

WORKERS = Path(__file__).with_name("_export_workers.py")
_spec = importlib.util.spec_from_file_location("_export_workers", WORKERS)
workers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workers)


def _config(model_dir, **overrides):
    base = {"model_dir": str(model_dir), "lr": 1e-2, "dtype": "float32", "parallel": "none"}
    return TorchPolicyConfig(**{**base, **overrides})


def _batch(lengths=(7, 12, 5, 9), seed=0):
    return workers.make_batch(lengths, seed, prompt_len=2)


def _trained_policy(model_dir, **overrides):
    """A policy one optimizer step away from the weights in model_dir."""
    policy = TorchPolicy(_config(model_dir, **overrides))
    batch = _batch()
    batch.tokens["old_logprobs"] = policy.logprobs(batch)
    metrics = policy.train_step(batch, PolicyLoss(kl_coef=0.0))
    assert metrics["is_skipped"] == 0.0
    return policy


def _hf_logprobs(model, batch):
    """Logprobs of each sample's tokens from a plain forward of a reloaded model."""
    out = []
    for i, length in enumerate(batch.lengths.tolist()):
        ids = batch["input_ids"][i : i + 1, :length]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    from yatt.testing import make_tiny_causal_lm

    path = tmp_path_factory.mktemp("tiny-tied")
    make_tiny_causal_lm(path, arch="qwen2", tie_word_embeddings=True, max_position_embeddings=64)
    return path


def test_export_reloads_with_the_policys_weights_and_logprobs(tiny_model_dir, tmp_path, caplog):
    policy = _trained_policy(tiny_model_dir)
    weights = {name: t.clone() for name, t in policy.named_weights()}
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    moved = [n for n, t in initial.named_parameters() if not torch.equal(t, weights[n])]
    assert len(moved) == len(weights)  # the step moved every weight: not the initial model

    with caplog.at_level("INFO", logger="yatt.core"):
        out = export_hf(policy, tmp_path / "hf")
    assert out == tmp_path / "hf"
    assert f"exported {len(weights)} tensors" in caplog.text  # the log counts what was written
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert dict(reloaded.named_parameters()).keys() == weights.keys()
    for name, tensor in reloaded.named_parameters():
        assert torch.equal(tensor, weights[name]), name
    batch = _batch(seed=1)
    expected = policy.logprobs(batch)
    for i, got in enumerate(_hf_logprobs(reloaded, batch)):
        length = int(batch.lengths[i])
        torch.testing.assert_close(got, expected[i, 1:length], atol=1e-5, rtol=0)
    # A policy built on the export computes the very same logprobs.
    again = TorchPolicy(_config(out))
    assert torch.equal(again.logprobs(batch), expected)


def test_export_copies_tokenizer_and_generation_config(tiny_model_dir, tmp_path):
    out = export_hf(TorchPolicy(_config(tiny_model_dir)), tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    original = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "héllo <|im_start|>"
    assert tokenizer(text)["input_ids"] == original(text)["input_ids"]
    assert tokenizer.chat_template == original.chat_template
    source = json.loads((Path(tiny_model_dir) / "generation_config.json").read_text())
    assert json.loads((out / "generation_config.json").read_text()) == source
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        pytest.param(None, torch.float32, id="default-is-model_dir-dtype"),
        pytest.param("bfloat16", torch.bfloat16, id="bf16"),
        pytest.param(torch.float16, torch.float16, id="fp16"),
    ],
)
def test_export_writes_the_dtype_asked(tiny_model_dir, tmp_path, dtype, expected):
    policy = _trained_policy(tiny_model_dir)
    weights = dict(policy.named_weights())
    out = export_hf(policy, tmp_path / "hf", dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == str(expected).removeprefix("torch.")
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # dtype from config.json
    for name, tensor in reloaded.named_parameters():
        assert tensor.dtype == expected
        assert torch.equal(tensor, weights[name].to(expected)), name


def test_default_dtype_follows_the_saved_model(tmp_path):
    from yatt.testing import make_tiny_causal_lm

    make_tiny_causal_lm(tmp_path / "bf16", dtype=torch.bfloat16, max_position_embeddings=64)
    out = export_hf(TorchPolicy(_config(tmp_path / "bf16")), tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_large_models_are_sharded_with_an_index(tiny_model_dir, tmp_path):
    policy = _trained_policy(tiny_model_dir)
    out = export_hf(policy, tmp_path / "hf", max_shard_bytes=64_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    weights = dict(policy.named_weights())
    for name, tensor in reloaded.named_parameters():
        assert torch.equal(tensor, weights[name]), name


def test_tied_embeddings_are_saved_once_and_stay_tied(tied_model_dir, tmp_path):
    policy = _trained_policy(tied_model_dir)
    out = export_hf(policy, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    weights = dict(policy.named_weights())
    assert torch.equal(reloaded.lm_head.weight, weights["model.embed_tokens.weight"])


def test_a_sleeping_policy_exports_without_waking(tiny_model_dir, tmp_path):
    policy = _trained_policy(tiny_model_dir)
    weights = {name: t.clone() for name, t in policy.named_weights()}
    policy.sleep()
    out = export_hf(policy, tmp_path / "hf")
    with pytest.raises(RuntimeError, match="offloaded"):
        policy.logprobs(_batch())  # still asleep
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in reloaded.named_parameters():
        assert torch.equal(tensor, weights[name]), name


def test_an_earlier_export_is_replaced_only_when_asked(tiny_model_dir, tmp_path):
    initial = TorchPolicy(_config(tiny_model_dir))
    first = export_hf(initial, tmp_path / "hf")
    marker = json.loads((first / EXPORT_MARKER).read_text())
    assert marker["source"] == "policy" and marker["dtype"] == "float32"
    assert marker["model_dir"] == str(Path(tiny_model_dir).absolute())
    with pytest.raises(ValueError, match="should_overwrite=True"):
        export_hf(initial, tmp_path / "hf")
    trained = _trained_policy(tiny_model_dir)
    weights = dict(trained.named_weights())
    out = export_hf(trained, tmp_path / "hf", should_overwrite=True)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in reloaded.named_parameters():
        assert torch.equal(tensor, weights[name]), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no old or tmp folder left
    (tmp_path / "empty").mkdir()  # an empty folder holds nothing to lose
    assert export_hf(trained, tmp_path / "empty", should_overwrite=True) == tmp_path / "empty"


def _refuse_to_read(monkeypatch):
    """Reading tensors fails the test: a refusal must come before anything expensive."""

    def fail(*args, **kwargs):
        raise AssertionError("read tensors before refusing the out_dir")

    monkeypatch.setattr(export_module, "read_model_tensors", fail)
    monkeypatch.setattr(export_module, "_full_named_weights", fail)


def _snapshot(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(
    ("contents", "match"),
    [
        pytest.param({"notes.txt": "mine"}, "is not a yatt export", id="unmarked"),
        pytest.param({EXPORT_MARKER: "{torn"}, "unreadable", id="torn-marker"),
        pytest.param({EXPORT_MARKER: "[1, 2]"}, "did not write", id="foreign-marker"),
    ],
)
def test_a_folder_yatt_did_not_export_is_never_replaced(
    tiny_model_dir, tmp_path, monkeypatch, contents, match
):
    policy = TorchPolicy(_config(tiny_model_dir))
    target = tmp_path / "data"  # an absolute path to someone's folder
    target.mkdir()
    for name, text in contents.items():
        (target / name).write_text(text)
    before = _snapshot(tmp_path)
    _refuse_to_read(monkeypatch)
    with pytest.raises(ValueError, match=match):
        export_hf(policy, target, should_overwrite=True)
    with pytest.raises(ValueError, match=match):
        check_export_dir(target, should_overwrite=True)
    assert _snapshot(tmp_path) == before


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_out_dir_holding_the_checkpoint_or_the_model_is_refused(
    tiny_model_dir, tmp_path, monkeypatch
):
    """export.dir="checkpoints" and export.dir="." of a trainer: out_dir is (or holds) what the
    export reads, and replacing it would delete that."""
    run = tmp_path / "run"
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    ckpt = _save_checkpoint(TorchPolicy(_config(model_dir)), run / "checkpoints" / "step-1")
    (run / "metrics.jsonl").write_text("{}\n")
    before = _snapshot(tmp_path)
    _refuse_to_read(monkeypatch)
    monkeypatch.chdir(run)
    for out, match in [
        (run / "checkpoints", "holds the checkpoint"),
        (ckpt, "is the checkpoint"),
        (".", "holds the checkpoint"),  # relative: the working folder
        ("model/..", "holds the checkpoint"),
    ]:
        with pytest.raises(ValueError, match=match):
            export_hf_from_checkpoint(ckpt, out, model_dir=model_dir, should_overwrite=True)
    # A live export knows no checkpoint; the model folder is still protected, and the run
    # folder is not an export.
    policy = TorchPolicy(_config(model_dir))
    with pytest.raises(ValueError, match="holds the model_dir"):
        export_hf(policy, tmp_path, should_overwrite=True)
    with pytest.raises(ValueError, match="is not a yatt export"):
        export_hf(policy, run, should_overwrite=True)
    with pytest.raises(ValueError, match="is not a yatt export"):
        export_hf(policy, run / "checkpoints", should_overwrite=True)
    assert _snapshot(tmp_path) == before
    # Checked up front too, before the checkpoint root exists (a trainer at start-up).
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match="holds the checkpoint"):
        check_export_dir(fresh / ".", checkpoint_dir=fresh / "checkpoints")
    assert check_export_dir(fresh / "export", checkpoint_dir=fresh / "checkpoints") == (
        fresh / "export"
    )


def test_a_leftover_tmp_folder_is_removed_only_if_it_is_ours(tiny_model_dir, tmp_path):
    policy = TorchPolicy(_config(tiny_model_dir))
    foreign = tmp_path / "hf.export.tmp"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an unfinished yatt export"):
        export_hf(policy, tmp_path / "hf")
    assert (foreign / "notes.txt").exists()
    (foreign / "notes.txt").unlink()
    (foreign / EXPORT_MARKER).write_text('{"format": 1}')  # what a crashed export leaves
    (foreign / "model.safetensors").write_bytes(b"half")
    export_hf(policy, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("can_swap", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_replacing_an_export_keeps_one_at_every_moment(
    tiny_model_dir, tmp_path, monkeypatch, can_swap
):
    policy = TorchPolicy(_config(tiny_model_dir))
    out = export_hf(policy, tmp_path / "hf")
    (out / "generation_config.json").write_text('{"old": true}')
    real_exchange = export_module._exchange
    swaps = []

    def exchange(a, b):
        assert (b / EXPORT_MARKER).is_file() and (a / "model.safetensors").is_file()
        swapped = real_exchange(a, b) if can_swap else False
        swaps.append(swapped)
        return swapped

    if can_swap and not _filesystem_can_swap(tmp_path):
        pytest.skip("this filesystem has no renameat2 RENAME_EXCHANGE")
    monkeypatch.setattr(export_module, "_exchange", exchange)
    export_hf(policy, out, should_overwrite=True)
    assert swaps == [can_swap]
    assert json.loads((out / "generation_config.json").read_text()) != {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def _filesystem_can_swap(folder):
    (folder / "swap-a").mkdir()
    (folder / "swap-b").mkdir()
    (folder / "swap-a" / "x").write_text("a")
    try:
        if not export_module._exchange(folder / "swap-a", folder / "swap-b"):
            return False
        # An independent check of the swap: the file moved with its folder's name.
        assert (folder / "swap-b" / "x").read_text() == "a"
        assert not (folder / "swap-a" / "x").exists()
        return True
    finally:
        shutil.rmtree(folder / "swap-a")
        shutil.rmtree(folder / "swap-b")


def test_a_failed_write_leaves_no_folder(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    def fail(self, folder, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        export_hf(TorchPolicy(_config(tiny_model_dir)), tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"dtype": "int8"}, "dtype='int8'", id="dtype"),
        pytest.param({"dtype": "fp32"}, "use one of", id="dtype-alias"),
    ],
)
def test_bad_arguments_fail_before_anything_is_written(tiny_model_dir, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        export_hf(TorchPolicy(_config(tiny_model_dir)), tmp_path / "hf", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_out_dir_cannot_be_the_model_dir(tiny_model_dir):
    with pytest.raises(ValueError, match="is the model_dir"):
        export_hf(TorchPolicy(_config(tiny_model_dir)), tiny_model_dir, should_overwrite=True)


# -- from a checkpoint ----------------------------------------------------------------------------


def _save_checkpoint(policy, folder):
    """What yatt-ckpt's Checkpointer writes for policy.state(): DCP, module under "model"."""
    dcp.save({"model": get_model_state_dict(policy.module)}, checkpoint_id=folder, no_dist=True)
    return folder


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_from_a_checkpoint_equals_the_live_export(tiny_model_dir, tmp_path):
    policy = _trained_policy(tiny_model_dir)
    ckpt = _save_checkpoint(policy, tmp_path / "ckpt")
    live = export_hf(policy, tmp_path / "live", dtype="bfloat16")
    saved = export_hf_from_checkpoint(
        ckpt, tmp_path / "saved", model_dir=tiny_model_dir, dtype="bfloat16"
    )
    assert sorted(p.name for p in live.iterdir()) == sorted(p.name for p in saved.iterdir())
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (live / name).read_bytes() == (saved / name).read_bytes(), name
    a = AutoModelForCausalLM.from_pretrained(live).state_dict()
    b = AutoModelForCausalLM.from_pretrained(saved).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_from_a_tied_model_checkpoint(tied_model_dir, tmp_path):
    policy = _trained_policy(tied_model_dir)
    ckpt = _save_checkpoint(policy, tmp_path / "ckpt")
    out = export_hf_from_checkpoint(ckpt, tmp_path / "hf", model_dir=tied_model_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    weights = dict(policy.named_weights())
    for name, tensor in reloaded.named_parameters():
        assert torch.equal(tensor, weights[name]), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_from_a_yatt_ckpt_checkpoint(tiny_model_dir, tmp_path):
    ckpt = pytest.importorskip("yatt.ckpt")  # a sibling: installed beside yatt-core, not by it
    policy = _trained_policy(tiny_model_dir)
    with ckpt.Checkpointer(tmp_path / "ckpts", async_save=False) as checkpointer:
        checkpointer.save(3, policy.state(), extra={"step": 3})
        folder = checkpointer.verify(checkpointer.latest()).path
    out = export_hf_from_checkpoint(folder, tmp_path / "hf", model_dir=tiny_model_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    weights = dict(policy.named_weights())
    for name, tensor in reloaded.named_parameters():
        assert torch.equal(tensor, weights[name]), name
    with pytest.raises(ValueError, match=r"pass one of them, e\.g\. .*step-00000003"):
        export_hf_from_checkpoint(tmp_path / "ckpts", tmp_path / "x", model_dir=tiny_model_dir)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_missing_and_damaged_checkpoints_are_clear_errors(tiny_model_dir, tmp_path):
    def export(folder):
        return export_hf_from_checkpoint(folder, tmp_path / "hf", model_dir=tiny_model_dir)

    with pytest.raises(ValueError, match="does not exist"):
        export(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no \.metadata file"):
        export(tmp_path / "empty")
    policy = TorchPolicy(_config(tiny_model_dir))
    ckpt = _save_checkpoint(policy, tmp_path / "step-00000001.tmp")
    with pytest.raises(ValueError, match="unfinished save"):
        export(ckpt)
    ckpt = _save_checkpoint(policy, tmp_path / "ckpt")
    data = next(ckpt.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"incomplete: {data.name} has \d+ bytes"):
        export(ckpt)
    data.unlink()
    with pytest.raises(ValueError, match=f"incomplete: {data.name} is missing"):
        export(ckpt)
    (ckpt / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"\.metadata is unreadable"):
        export(ckpt)
    with pytest.raises(ValueError, match=r"no tensors under state_key='policy'.*\['model'\]"):
        export_hf_from_checkpoint(
            _save_checkpoint(policy, tmp_path / "ok"),
            tmp_path / "hf",
            model_dir=tiny_model_dir,
            state_key="policy",
        )
    assert not (tmp_path / "hf").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_of_another_model_is_refused(tiny_model_dir, tied_model_dir, tmp_path):
    ckpt = _save_checkpoint(TorchPolicy(_config(tied_model_dir)), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="another model"):
        export_hf_from_checkpoint(ckpt, tmp_path / "hf", model_dir=tiny_model_dir)
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_ranks_export_the_same_model_as_one(launch_export, tiny_model_dir, tmp_path, parallel):
    """Two gloo ranks, one step, then export awake and asleep (FSDP2: host-side shards);
    rank 0 writes; the checkpoint the two ranks wrote exports to the same weights."""
    results = launch_export(parallel=parallel, model_dir=tiny_model_dir, out=str(tmp_path))
    weights = results[0]["weights"]
    for result in results:
        assert result["returned"] == str(tmp_path / "awake")
        assert "exists; pass should_overwrite=True" in result["refusal"]
        for name, tensor in result["weights"].items():
            assert torch.equal(tensor, weights[name]), name
    for key in ("awake", "asleep"):
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / key)
        for name, tensor in reloaded.named_parameters():
            assert torch.equal(tensor, weights[name]), (key, name)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(initial.lm_head.weight, weights["lm_head.weight"])
    saved = export_hf_from_checkpoint(
        tmp_path / "ckpt", tmp_path / "saved", model_dir=tiny_model_dir
    )
    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    for name, tensor in reloaded.named_parameters():
        assert torch.equal(tensor, weights[name]), name


@pytest.fixture
def launch_export(tmp_path):
    import subprocess
    import sys

    from yatt.testing import run_ranks

    def run(**kwargs):
        script = WORKERS
        args = [sys.executable, str(script), json.dumps(kwargs)]
        try:
            run_ranks(args, 2, env={"CUDA_VISIBLE_DEVICES": ""}, timeout_s=180)
        except subprocess.TimeoutExpired:
            pytest.fail("the export ranks did not finish in 180 s (a collective out of step?)")
        out = Path(kwargs["out"])
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]

    return run
