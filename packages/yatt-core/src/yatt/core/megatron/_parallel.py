"""Preconditions of MegatronPolicy (CUDA, megatron-core) and Megatron's parallel_state setup."""

from __future__ import annotations

import torch

from yatt.core._runtime import Runtime


def _require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(
            f"MegatronPolicy needs CUDA (megatron-core calls CUDA directly), got device={device}; "
            "use TorchPolicy on CPU"
        )


def _require_megatron() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"MegatronPolicy needs megatron-core ({err}); pip install 'yatt-core[megatron]'"
        ) from err


def _init_megatron_parallel(runtime: Runtime, tp_size: int, seed: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if runtime.tp_size != tp_size:
        raise ValueError(
            f"MegatronPolicyConfig.tp_size={tp_size} but the runtime has tp_size={runtime.tp_size}; "
            "pass the same value to init_runtime(tp_size=...)"
        )
    if not parallel_state.model_parallel_is_initialized():
        # Megatron's default order puts TP ranks adjacent, as yatt's (dp, tp) mesh does, so
        # both agree on who shares a batch.
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    elif parallel_state.get_tensor_model_parallel_world_size() != tp_size:
        raise ValueError("megatron parallel_state is already initialised with another tp size")
    model_parallel_cuda_manual_seed(seed)
