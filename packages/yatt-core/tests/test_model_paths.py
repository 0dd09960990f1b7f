"""resolve_model_dir: local folders as they are, Hub ids from a populated cache (never a download),
clear errors that say how to fetch what is missing."""

NUM_GPUS = 0

import socket
import uuid

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.core import TorchPolicy, TorchPolicyConfig, resolve_model_dir
from yatt.testing import make_tiny_causal_lm


def _populate_cache(cache, repo_id, *, ref="main"):
    """The layout huggingface_hub writes: models--org--name/{refs/<ref>, snapshots/<commit>/}."""
    commit = uuid.uuid4().hex + uuid.uuid4().hex[:8]  # 40 hex digits, like a git commit
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    make_tiny_causal_lm(snapshot, max_position_embeddings=64)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot, commit


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any connection attempt fails the test: resolving must never try to download."""

    def refuse(*args, **kwargs):
        raise AssertionError("resolve_model_dir tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_a_local_folder_is_returned_as_is(tiny_model_dir, tmp_path):
    assert resolve_model_dir(tiny_model_dir) == type(tmp_path)(tiny_model_dir)


def test_a_hub_id_resolves_from_the_cache_named_by_the_environment(tmp_path, monkeypatch):
    cache = tmp_path / "home" / "hub"
    snapshot, commit = _populate_cache(cache, "tiny-org/tiny-llama")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model_dir("tiny-org/tiny-llama") == snapshot
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model_dir("tiny-org/tiny-llama", revision=commit) == snapshot
    # What it resolves to is a model folder the policy and transformers load.
    policy = TorchPolicy(
        TorchPolicyConfig(model_dir=str(resolve_model_dir("tiny-org/tiny-llama")), parallel="none")
    )
    reference = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
    assert torch.equal(dict(policy.named_weights())["lm_head.weight"], reference.lm_head.weight)


def test_a_branch_other_than_main(tmp_path):
    snapshot, _ = _populate_cache(tmp_path, "org/model", ref="v1")
    assert resolve_model_dir("org/model", revision="v1", cache_dir=tmp_path) == snapshot
    with pytest.raises(ValueError, match="'org/model' is not a local folder"):
        resolve_model_dir("org/model", cache_dir=tmp_path)  # no refs/main


def test_an_id_missing_from_the_cache_says_how_to_fetch_it(tmp_path):
    with pytest.raises(ValueError, match=r"has no snapshot of it.*hf download org/absent"):
        resolve_model_dir("org/absent", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"hf download org/absent --revision v2"):
        resolve_model_dir("org/absent", revision="v2", cache_dir=tmp_path)


def test_an_interrupted_download_is_named(tmp_path):
    snapshot, _ = _populate_cache(tmp_path, "org/partial")
    (snapshot / "config.json").unlink()
    with pytest.raises(ValueError, match=r"has no config\.json \(an interrupted download"):
        resolve_model_dir("org/partial", cache_dir=tmp_path)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("./no/such/model", id="relative"),
        pytest.param("/no/such/model", id="absolute"),
        pytest.param("a/b/c", id="deep"),
    ],
)
def test_a_missing_folder_that_is_no_hub_id(path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_dir(path)


def test_a_file_is_refused(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_dir(tmp_path / "model.bin")
