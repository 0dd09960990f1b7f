NUM_GPUS = 0

"""MegatronPolicy's model-parallel state ends with the runtime it was built on (megatron-core on
CPU, one gloo rank; see _cpu_shim.py). Skipped without megatron-core."""

import torch


def test_a_second_runtime_in_the_process_builds_a_working_policy(
    megatron_sequential_runtimes_result,
):
    result = megatron_sequential_runtimes_result
    # Megatron's groups went with each runtime's world...
    assert result["is_initialized_after"] == [False, False]
    # ...so the second policy ran on its own world's groups: the same model, the same logprobs.
    first, second = result["logprobs"]
    assert first.abs().sum() > 0
    torch.testing.assert_close(second, first, atol=0, rtol=0)
