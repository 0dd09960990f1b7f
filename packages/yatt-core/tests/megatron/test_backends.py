"""The policy factory (build_policy / policy_config_from_dict) and broadcast_to_tp_peers.

None of these need megatron-core: the megatron backend's errors on a CPU machine come before
it is imported, and a missing megatron-core is a clear ImportError, not a deep traceback.
"""

NUM_GPUS = 0

import sys

import pytest
import torch

from yatt.core import (
    MegatronPolicyConfig,
    TorchPolicy,
    TorchPolicyConfig,
    broadcast_to_tp_peers,
    build_policy,
    init_runtime,
    policy_config_from_dict,
)
from yatt.testing import run_ranks


@pytest.fixture
def cpu_runtime():
    with init_runtime(device="cpu") as rt:
        yield rt


def test_torch_backend_builds_a_torch_policy_from_fields(tiny_model_dir, cpu_runtime):
    policy = build_policy("torch", {"model_dir": tiny_model_dir, "lr": 1e-3}, cpu_runtime)
    assert isinstance(policy, TorchPolicy)
    assert policy.config.lr == 1e-3
    assert policy.model_config.hidden_size == 64


@pytest.mark.parametrize(
    ("backend", "fields", "match"),
    [
        ("jax", {}, r"backend='jax' is not a policy backend; use one of \['torch', 'megatron'\]"),
        (
            "megatron",
            {"tp_sise": 2},
            r"unknown config key 'policy\.tp_sise' for MegatronPolicyConfig; did you mean 'tp_size'",
        ),
        # tp_size is Megatron's: the torch backend rejects it instead of ignoring it.
        ("torch", {"tp_size": 2}, r"unknown config key 'policy\.tp_size' for TorchPolicyConfig"),
        ("megatron", {"tp_size": 0}, r"policy\.tp_size=0: must be an int >= 1"),  # the dotted path
    ],
    ids=["unknown-backend", "megatron-typo", "torch-tp", "megatron-bad-value"],
)
def test_bad_policy_config_is_a_clear_error(tiny_model_dir, backend, fields, match):
    with pytest.raises(ValueError, match=match):
        policy_config_from_dict(backend, {"model_dir": tiny_model_dir, **fields})


def test_config_class_must_match_the_backend(tiny_model_dir, cpu_runtime):
    config = TorchPolicyConfig(model_dir=tiny_model_dir)
    with pytest.raises(ValueError, match=r"takes a MegatronPolicyConfig.*pass backend='torch'"):
        build_policy("megatron", config, cpu_runtime)


def test_megatron_on_a_cpu_runtime_fails_before_importing_megatron(tiny_model_dir, cpu_runtime):
    config = policy_config_from_dict("megatron", {"model_dir": tiny_model_dir})
    assert isinstance(config, MegatronPolicyConfig)
    with pytest.raises(ValueError, match=r"MegatronPolicy needs CUDA .* use TorchPolicy on CPU"):
        build_policy("megatron", config, cpu_runtime)


def test_missing_megatron_core_is_a_clear_import_error(tiny_model_dir, cpu_runtime, monkeypatch):
    import yatt.core.policy.megatron._policy as megatron_policy

    monkeypatch.setattr(megatron_policy, "_require_cuda", lambda device: None)
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron.core -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'yatt-core\[megatron\]'"):
        build_policy("megatron", {"model_dir": tiny_model_dir}, cpu_runtime)


_BROADCAST = """
import sys, torch
from yatt.core import broadcast_to_tp_peers, init_runtime
with init_runtime(tp_size=2, device="cpu") as rt:
    got = broadcast_to_tp_peers({"from": rt.rank}, rt)
    torch.save(got, f"{sys.argv[1]}/rank{rt.rank}.pt")
"""


def test_broadcast_to_tp_peers_gives_every_peer_tp_rank_0s_object(tmp_path):
    """dp=2 x tp=2: ranks 0, 1 share rank 0's object and ranks 2, 3 rank 2's (TP peers only)."""
    args = [sys.executable, "-c", _BROADCAST, str(tmp_path)]
    run_ranks(args, 4, env={"CUDA_VISIBLE_DEVICES": ""})
    got = [torch.load(tmp_path / f"rank{r}.pt")["from"] for r in range(4)]
    assert got == [0, 0, 2, 2]


def test_broadcast_at_tp_size_1_returns_the_object_itself(cpu_runtime):
    samples = [{"input_ids": [1, 2]}]
    assert broadcast_to_tp_peers(samples, cpu_runtime) is samples
