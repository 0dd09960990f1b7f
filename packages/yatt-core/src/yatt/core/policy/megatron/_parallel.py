"""Preconditions of MegatronPolicy (CUDA, megatron-core) and Megatron's parallel_state setup."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from yatt.core.runtime._runtime import Runtime


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


def _init_megatron_parallel(runtime: Runtime, config: Any) -> None:
    """Megatron's TP x CP x PP x DP groups for a MegatronPolicyConfig, matching yatt's runtime.

    yatt's runtime mesh is (dp, tp): the "tp" ranks of a DP rank share its batch, adjacent. Here
    they are the model replica's tp x cp x pp ranks, so the runtime must be built with
    tp_size=config.model_parallel_size, and Megatron's order puts DP outermost ("tp-cp-ep-pp-dp").
    """
    replica = config.model_parallel_size
    world = dist.get_world_size() if dist.is_initialized() else 1
    if replica > world:
        raise ValueError(
            f"MegatronPolicyConfig: tp_size x pp_size x cp_size = {config.tp_size} x "
            f"{config.pp_size} x {config.cp_size} = {replica} ranks, more than the world's {world}"
        )
    if runtime.tp_size != replica:
        raise ValueError(
            f"MegatronPolicyConfig.tp_size x pp_size x cp_size = {replica} but the runtime has "
            f"tp_size={runtime.tp_size}; pass init_runtime(tp_size=config.model_parallel_size)"
        )
    order = megatron_rank_order(config.pp_size, config.cp_size, world // replica)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    sizes = (config.tp_size, config.pp_size, config.cp_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.tp_size,
            pipeline_model_parallel_size=config.pp_size,
            virtual_pipeline_model_parallel_size=config.virtual_pp_size,
            context_parallel_size=config.cp_size,
            order=order,
        )
        # Megatron keeps its groups in module globals: left set after the runtime's world is
        # destroyed, the next runtime's policy would reuse dead groups.
        runtime.on_shutdown(parallel_state.destroy_model_parallel)
    elif (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
    ) != sizes:
        raise ValueError(
            f"megatron parallel_state is already initialised with other (tp, pp, cp) sizes "
            f"than {sizes}"
        )
    model_parallel_cuda_manual_seed(config.seed)


def megatron_rank_order(pp_size: int, cp_size: int, dp_size: int) -> str:
    """Megatron's rank order with DP outermost, as yatt's runtime mesh has it.

    megatron-core (0.16) refuses a non-pp-last order when the expert DP size (dp x cp for a
    dense model) differs from DP, i.e. pp > 1 with cp > 1. Then only dp = 1 works: every order
    groups the ranks alike.
    """
    if pp_size > 1 and cp_size > 1:
        if dp_size > 1:
            raise ValueError(
                f"MegatronPolicyConfig: pp_size={pp_size} with cp_size={cp_size} needs one data-"
                f"parallel rank (got dp={dp_size}): Megatron-Core's rank order would interleave "
                "data-parallel ranks inside a model replica; use pp or cp alone, or dp=1"
            )
        return "tp-cp-ep-dp-pp"
    return "tp-cp-ep-pp-dp"
