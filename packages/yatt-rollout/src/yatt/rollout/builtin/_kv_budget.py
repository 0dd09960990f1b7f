"""How many KV-cache slots fit a share of device memory (partial colocation's memory split).

A placement plan gives the engine `fraction` of the device's memory for its weights and its KV
cache together, so the cache gets what the weights leave:

    kv_budget = fraction * device_total - weight_bytes
    num_slots = min(max_batch_size, (kv_budget - fixed_bytes) // slot_bytes), at least 1

slot_bytes counts everything allocated per slot in the "kv_cache" region: one row of keys and
values per layer ([H_kv, L, D] each) and the slot runner's per-slot buffers (response, token
history and logprob rows of L + 1, a few scalars). fixed_bytes is the part that does not scale
with slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from yatt.rollout.builtin._batcher import MAX_LABEL_TOKENS, MAX_STOP_TOKENS

# Per-slot scalars of the slot runner: eight int64 (rope_delta_S and the batch rows' slot index
# row_slot_S included), five float32 (temperature, top-p, min-p, repetition penalty, the LoRA
# adapter's gate adapter_on_S), one bool;
# plus one int64 row base per KV head in the cache's index table (in KVLayout.slot_bytes).
_RUNNER_SCALAR_BYTES = 8 * 8 + 5 * 4 + 1


@dataclass(kw_only=True, frozen=True)
class KVLayout:
    """Shape of the static KV cache, without the number of slots."""

    num_layers: int
    num_kv_heads: int
    max_seq_len: int
    head_dim: int
    dtype: torch.dtype

    @property
    def slot_bytes(self) -> int:
        """Bytes the "kv_cache" region holds per slot."""
        element = torch.empty((), dtype=self.dtype).element_size()
        kv_row = 2 * self.num_layers * self.num_kv_heads * self.max_seq_len * self.head_dim
        # Response ids and token history (int64), logprobs (float32).
        runner_rows = (self.max_seq_len + 1) * (8 + 8 + 4)
        runner_rows += MAX_LABEL_TOKENS * 4  # label logprobs float32
        return kv_row * element + runner_rows + _RUNNER_SCALAR_BYTES + self.num_kv_heads * 8

    @property
    def fixed_bytes(self) -> int:
        """Bytes the "kv_cache" region holds whatever the number of slots."""
        return (self.max_seq_len + MAX_STOP_TOKENS) * 8  # position table, stop-token table


def check_memory_fraction(fraction: float) -> float:
    """`fraction` as a float in (0, 1], or a ValueError naming the argument."""
    try:
        value = float(fraction)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"set_memory_fraction(fraction={fraction!r}): must be a number in (0, 1], e.g. 0.4"
        ) from exc
    if math.isnan(value) or not 0.0 < value <= 1.0:
        raise ValueError(
            f"set_memory_fraction(fraction={fraction!r}): must be in (0, 1] (the share of the "
            "device's memory for this engine's weights and KV cache), e.g. 0.4"
        )
    return value


def slots_for_fraction(
    *,
    fraction: float,
    device_total_bytes: int | None,
    weight_bytes: int,
    layout: KVLayout,
    max_batch_size: int,
) -> int:
    """Slots of `layout` that fit `fraction` of the device beside the weights (see module doc).

    device_total_bytes None means no limit: max_batch_size slots.
    """
    if device_total_bytes is None:
        return max_batch_size
    budget = int(fraction * device_total_bytes) - weight_bytes
    num_slots = (budget - layout.fixed_bytes) // layout.slot_bytes
    if num_slots < 1:
        raise ValueError(
            f"set_memory_fraction(fraction={fraction}): {fraction} of the device's "
            f"{device_total_bytes} bytes leaves {budget} bytes beside the weights "
            f"({weight_bytes} bytes), less than one KV slot of max_seq_len={layout.max_seq_len} "
            f"({layout.slot_bytes + layout.fixed_bytes} bytes); give the engine a larger "
            "fraction or lower EngineConfig.max_seq_len"
        )
    return min(num_slots, max_batch_size)
