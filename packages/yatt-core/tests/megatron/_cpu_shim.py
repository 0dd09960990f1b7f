"""Run megatron-core's GPTModel forward on CPU, for tests only.

megatron-core calls CUDA directly in a few places that a CPU forward reaches: the rotary
embedding moves its frequencies to `torch.cuda.current_device()`, and attention forks the
CUDA RNG tracker around dropout. The shim points the first at "cpu" and makes the tracker
fork a no-op (dropout is 0 in our configs, so no random state is consumed). Everything else
(linear layers, TP collectives over gloo, vocab-parallel cross entropy) is megatron's own code.
"""

from __future__ import annotations

import torch


def install() -> None:
    from megatron.core.tensor_parallel import random as mpu_random

    torch.cuda.current_device = lambda: "cpu"
    mpu_random.initialize_rng_tracker()
    tracker = mpu_random.get_cuda_rng_tracker()
    mpu_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mpu_random._set_cuda_rng_state = lambda *args, **kwargs: None
    for name in ("model-parallel-rng", "data-parallel-rng", "expert-parallel-rng"):
        tracker.states_[name] = torch.get_rng_state()


class _CpuTorch:
    """`torch` as megatron's optimizer modules see it: device="cuda" allocations land on CPU."""

    def __getattr__(self, name: str):
        fn = getattr(torch, name)
        if name not in ("tensor", "zeros", "ones", "empty"):
            return fn

        def on_cpu(*args, **kwargs):
            if str(kwargs.get("device")) == "cuda":
                kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)  # no pinned allocator without an accelerator
            return fn(*args, **kwargs)

        return on_cpu


def install_for_policy() -> None:
    """Also let MegatronPolicy train on CPU: float32 and the non-distributed optimizer only
    (the distributed one insists on CUDA tensors), and no grad clipping (it asserts CUDA).
    The pipeline schedule's device="cuda" counters land on CPU too, and context parallelism's
    rope index (pinned) in plain memory.
    sleep()/wake_up() run, but the optimizer state stays where it is: in host memory already
    (Megatron's restore_from_cpu would call .cuda() on it)."""
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.utils as utils

    import yatt.core.policy.megatron._model as model_builder
    import yatt.core.policy.megatron._policy as policy

    install()
    # Gloo matches point-to-point messages by (peer, tag): at pp=2 the interleaved schedule's
    # batched send/receive pairs an activation and a gradient from the same peer in either
    # order. Megatron's unbatched path posts them in a fixed even/odd order that pairs right.
    kwargs_of = model_builder.transformer_config_kwargs
    model_builder.transformer_config_kwargs = lambda *a, **k: {
        **kwargs_of(*a, **k),
        "batch_p2p_comm": False,
    }
    for module in (optimizer, clip_grads, utils, schedules, p2p, rope_utils):
        module.torch = _CpuTorch()
    tensor_parallel.model_parallel_cuda_manual_seed = lambda *args, **kwargs: None
    # Context parallelism's rope index and a pipeline's tied output layer call .cuda().
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    policy._require_cuda = lambda device: None
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda *args, **kwargs: None
    # 0.19 reads the current stream before a grad sync, only to wait on CUDA-graph events.
    torch.cuda.current_stream = lambda *args, **kwargs: None
    optimizer.MegatronOptimizer.offload_to_cpu = lambda self: None
    optimizer.MegatronOptimizer.restore_from_cpu = lambda self: None
