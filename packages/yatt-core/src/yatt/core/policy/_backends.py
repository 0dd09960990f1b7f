"""Pick a policy backend by name: "torch" (TorchPolicy) or "megatron" (MegatronPolicy).

    config = policy_config_from_dict("megatron", {"model_dir": "./model", "tp_size": 2})
    policy = build_policy("megatron", config, runtime)   # runtime from init_runtime(tp_size=2)
    samples = broadcast_to_tp_peers(samples, runtime)    # before building each rank's Batch

The config is validated (unknown keys, bad values) before anything heavy is built, so a
misspelled field fails before training starts. megatron-core is imported only when a
MegatronPolicy is built: the torch backend never needs it.

Tensor-parallel ranks of one data-parallel rank must train on the same batch (their
collectives pair up micro-batch by micro-batch). Seeding their rollouts alike is not enough:
an engine's batching order or a sampled judge vote can still differ, so the samples of TP
rank 0 are what every peer trains on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch.distributed as dist

from yatt.core.config._from_dict import config_from_dict
from yatt.core.policy._policy import PolicyBackend, TorchPolicyConfig
from yatt.core.policy.megatron._policy_config import MegatronPolicyConfig
from yatt.core.runtime._runtime import Runtime

# megatron-core has no LoRA layers of its own: Megatron-Bridge's (megatron.bridge.peft) and
# NeMo's need their whole stack (Transformer Engine, NeMo-Run), a dependency yatt does not take.
_MEGATRON_LORA = (
    "{path}.lora: LoRA runs on the torch backend only (through PEFT); megatron-core has no "
    "LoRA of its own (Megatron-Bridge's needs Transformer Engine and its stack). Use "
    "backend='torch' (ddp or fsdp2), or drop {path}.lora"
)
BACKENDS: dict[str, type] = {"torch": TorchPolicyConfig, "megatron": MegatronPolicyConfig}
PolicyConfig = TorchPolicyConfig | MegatronPolicyConfig
T = TypeVar("T")


def _config_class(backend: str) -> type:
    if backend not in BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not a policy backend; use one of {list(BACKENDS)}"
        )
    return BACKENDS[backend]


def policy_config_from_dict(
    backend: str, values: Mapping[str, Any], *, path: str = "policy"
) -> PolicyConfig:
    """`values` as `backend`'s config class; unknown keys raise ValueError naming that class."""
    cls = _config_class(backend)
    if backend == "megatron" and values.get("lora") is not None:
        raise ValueError(_MEGATRON_LORA.format(path=path))
    return config_from_dict(cls, values, path=path)


def build_policy(
    backend: str, config: PolicyConfig | Mapping[str, Any], runtime: Runtime
) -> PolicyBackend:
    """The `backend` policy from its config (or a dict of its fields) on `runtime`.

    "megatron" needs CUDA and `runtime` built with init_runtime(tp_size=config.tp_size).
    """
    cls = _config_class(backend)
    if isinstance(config, Mapping):
        config = policy_config_from_dict(backend, config)
    if not isinstance(config, cls):
        raise ValueError(
            f"backend={backend!r} takes a {cls.__name__}, got a {type(config).__name__}; "
            f"pass backend={_backend_of(config)!r} or a {cls.__name__}"
        )
    if backend == "torch":
        from yatt.core.policy._torch_policy import TorchPolicy

        return TorchPolicy(config, runtime)
    from yatt.core.policy.megatron._policy import MegatronPolicy

    return MegatronPolicy(config, runtime)


def _backend_of(config: object) -> str | None:
    return next((name for name, cls in BACKENDS.items() if isinstance(config, cls)), None)


def broadcast_to_tp_peers(obj: T, runtime: Runtime) -> T:
    """TP rank 0's `obj` on each tensor-parallel peer (pickled; returned as is at tp_size 1).

    Collective over runtime.tp_group: every peer calls it, in the same order.
    """
    if runtime.tp_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=runtime.tp_group, group_src=0)
    return box[0]
