"""A torch policy's memory model: what it asks of a device beyond its activations, the
micro-batch cap chosen from free memory, the settings that lower each part, and its need when
the optimizer state waits on the host. TorchPolicy measures (free bytes, parameter counts,
its role's need) and calls these; they compute and decide, on plain numbers.

    free, total  --choose_policy_max_tokens-->  cap (activations in what is left after the
                                               gradients, casts, first optimizer state, margin)
    cap          --estimate_activation_peak_bytes-->  the train step's activation peak
    need         --with_optimizer_on_host-->  resident without the optimizer, the state in the
                                              peak (in place of the activations when larger)

Beside the activation model (_activation_memory) and the cost model (_cost_model): the cost
family imports no other of yatt.core's.
"""

from __future__ import annotations

from yatt.core.cost._activation_memory import choose_max_tokens, estimate_activation_bytes
from yatt.placement import MemoryNeed

# max_tokens_per_microbatch=None: the cap without CUDA (nothing to measure), and the one whose
# activations the policy reports before the first train step chooses its own.
DEFAULT_MAX_TOKENS = 8192
MIN_MARGIN_BYTES = 2 << 30  # left free when choosing a cap: max(2 GiB, 5% of the device)
MARGIN_FRACTION = 0.05


def estimate_autocast_copy_bytes(num_cast: int, *, is_float32: bool, is_fsdp2: bool) -> int:
    """Autocast's 16-bit copies of the `num_cast` parameters it casts, kept for the whole
    forward (2 bytes each); none when computing in float32, nor under FSDP2 (it casts per
    layer)."""
    if is_float32 or is_fsdp2:
        return 0
    return 2 * num_cast


def choose_policy_max_tokens(
    free_bytes: int,
    total_bytes: int,
    to_come_bytes: int,
    shape: dict,
    *,
    is_checkpointed: bool,
    is_head_logprobs: bool,
) -> tuple[int, int]:
    """(the micro-batch token cap, the margin left free): the largest cap whose activations fit
    in `free_bytes` less what the step still allocates besides activations (`to_come_bytes`:
    gradients, autocast copies, a first optimizer state) and a margin of max(MIN_MARGIN_BYTES,
    MARGIN_FRACTION of `total_bytes`). ValueError (choose_max_tokens's) when none fits."""
    margin = max(MIN_MARGIN_BYTES, int(MARGIN_FRACTION * total_bytes))
    cap = choose_max_tokens(
        free_bytes - to_come_bytes - margin,
        shape,
        is_checkpointed=is_checkpointed,
        is_head_logprobs=is_head_logprobs,
    )
    return cap, margin


def estimate_activation_peak_bytes(
    max_tokens: int | None,
    shape: dict | None,
    *,
    is_checkpointed: bool,
    is_head_logprobs: bool,
    autocast_copy_bytes: int,
) -> int:
    """The train step's activations at the micro-batch cap (DEFAULT_MAX_TOKENS before one is
    chosen), by estimate_activation_bytes, plus autocast's copies; 0 for an unknown shape."""
    if shape is None:
        return 0
    activations = estimate_activation_bytes(
        max_tokens or DEFAULT_MAX_TOKENS,
        shape,
        is_checkpointed=is_checkpointed,
        is_head_logprobs=is_head_logprobs,
    )
    return activations + autocast_copy_bytes


def describe_memory_settings(max_tokens: int | None, *, is_checkpointed: bool) -> dict[str, str]:
    """For each part of a torch policy's need, the setting that lowers it (a fit report's
    advice, placement.MemoryNeed.settings)."""
    how = "lower TorchPolicyConfig.max_tokens_per_microbatch" + (
        f" (now {max_tokens})" if max_tokens is not None else ""
    )
    if not is_checkpointed:
        how += " or set TorchPolicyConfig.gradient_checkpointing=True"
    return {
        "activations": how,
        "weights": "a smaller policy, or parallel='fsdp2' over more GPUs",
        "optimizer": "parallel='fsdp2' over more GPUs (shards the AdamW state)",
        "gradients": "parallel='fsdp2' over more GPUs",
    }


def with_optimizer_on_host(need: MemoryNeed) -> MemoryNeed:
    """`need` when the optimizer state waits on the host between steps
    (should_offload_optimizer): not resident, onloaded for the optimizer step when the
    activations are gone, so the peak holds the larger of the two (and no separate
    "optimizer step" part)."""
    state = need.resident.get("optimizer", 0)
    peak = {k: v for k, v in need.peak.items() if k != "optimizer step"}
    activations = peak.pop("activations", 0)
    peak |= {"activations": activations} if activations >= state else {"optimizer": state}
    return MemoryNeed(resident={**need.resident, "optimizer": 0}, peak=peak, settings=need.settings)
