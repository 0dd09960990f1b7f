"""Tensor-parallel engine groups: the yatt ranks that serve one model together.

    check_engine_tp("VLLMConfig.tensor_parallel_size", 2, model_dir=..., policy_tp_size=2)
        -> ValueError naming the field, before any engine loads
    group = create_engine_tp_group(2)        # collective: every rank builds its engine
    seed = group.agree_on_call(requests, sampling, local_seed)
    should_abort = group.any(flag)           # once per engine step: every rank stops alike
    completions = group.broadcast(obj)       # from the group's first rank

Layout: the groups are blocks of `tp_size` consecutive global ranks, TP the fast dimension, as
yatt.core.init_runtime lays out the policy's (dp, tp) mesh and as vLLM lays out its
(external DP, DP, PP, TP) ranks under an external launcher. So an engine group is the policy's
TP group exactly when the two sizes are equal, which `check_engine_tp` requires.

The request stream: every rank of a group is given the SAME requests (the parallel controller
runs per data-parallel rank and TP peers share its batch); the group checks that (a digest of
each rank's requests and sampling, all-gathered once per call) and takes the first rank's seed,
so an unseeded call samples alike on every rank. A group of one runs the same code, without
collectives. Control messages go over a gloo group (CPU), apart from the engines' own NCCL.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from yatt.rollout._types import Request, SamplingParams


def world_size_of_launch() -> int:
    """The process group's size, else torchrun's WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_launched() -> bool:
    """True under torchrun (or another launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def attention_heads(model_dir: str | Path) -> tuple[int, int] | None:
    """(query heads, key/value heads) from a local config.json (a VLM's text_config); None when
    the folder is not local or names no heads."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    config = config.get("text_config") or config
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int):
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    return heads, int(kv_heads)


def check_engine_tp(
    field: str,
    tp_size: object,
    *,
    model_dir: str | Path | None = None,
    policy_tp_size: int | None = None,
    world_size: int | None = None,
) -> None:
    """ValueError naming `field` when an engine TP size cannot serve: not a positive int, more
    ranks than the world or not dividing it, another size than `policy_tp_size` (the ranks that
    share a batch, the runtime's tp dimension: a smaller engine group would leave several
    groups sampling one batch apart, a larger one would mix batches), or heads the size does
    not divide (vLLM and SGLang split query heads evenly, key/value heads evenly or
    replicated)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"{field}={tp_size!r}: must be an int >= 1 (1: one GPU per engine)")
    world = world_size_of_launch() if world_size is None else world_size
    if tp_size > world or world % tp_size:
        raise ValueError(
            f"{field}={tp_size} must divide the world size {world} (the ranks launched by "
            f"torchrun): launch a multiple of {tp_size} ranks, or lower {field}"
        )
    if policy_tp_size is not None and tp_size != policy_tp_size:
        raise ValueError(
            f"{field}={tp_size} differs from the policy's tp_size={policy_tp_size} (the ranks "
            "sharing a batch: the runtime's tp_size; tp x pp x cp for MegatronPolicy): an "
            "engine group serves the batch of one such group, so the two sizes must be equal; "
            f"set {field}={policy_tp_size}"
        )
    heads = attention_heads(model_dir) if model_dir is not None else None
    if heads is not None:
        num_heads, num_kv_heads = heads
        if num_heads % tp_size:
            raise ValueError(
                f"{field}={tp_size} does not divide the model's {num_heads} attention heads "
                f"({model_dir}): use a divisor of {num_heads}"
            )
        if num_kv_heads % tp_size and tp_size % num_kv_heads:
            raise ValueError(
                f"{field}={tp_size} and the model's {num_kv_heads} key/value heads: one must "
                "divide the other (the heads are split, or replicated over the ranks)"
            )


def request_digest(requests: Sequence[Request], sampling: SamplingParams) -> str:
    """What decides a call's samples, hashed: prompts, per-request limits, ids, images and the
    sampling parameters (metadata is echoed, not used, so it is left out)."""
    h = hashlib.sha256(repr(sampling).encode())
    for request in requests:
        h.update(repr((request.prompt_ids, request.max_new_tokens, request.request_id)).encode())
        for image in request.images or ():
            if isinstance(image, torch.Tensor):
                h.update(image.detach().cpu().contiguous().numpy().tobytes())
            elif hasattr(image, "tobytes"):  # a PIL image
                h.update(image.tobytes())
            else:
                h.update(repr(image).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class EngineTPGroup:
    """The ranks serving one engine: `rank` within the group, `ranks` global; `group` a gloo
    process group for control messages (None for a group of one)."""

    size: int
    rank: int
    ranks: tuple[int, ...]
    group: Any = None

    @property
    def is_first(self) -> bool:
        """The rank that talks to an engine held by one process (SGLang)."""
        return self.rank == 0

    def agree_on_call(
        self, requests: Sequence[Request], sampling: SamplingParams, local_seed: int
    ) -> int:
        """The call's seed (the first rank's), after checking every rank was given the same
        requests and sampling; ValueError on every rank otherwise."""
        if self.size == 1:
            return local_seed
        mine = (request_digest(requests, sampling), local_seed)
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, mine, group=self.group)
        digests = [digest for digest, _ in gathered]
        if len(set(digests)) > 1:
            differing = [self.ranks[i] for i, d in enumerate(digests) if d != digests[0]]
            raise ValueError(
                f"the ranks {list(self.ranks)} of one engine TP group were given different "
                f"requests or sampling (ranks {differing} differ from rank {self.ranks[0]}); "
                "every rank of the group must pass the same call (TP peers share a batch)"
            )
        return int(gathered[0][1])

    def differing_ranks(self, value: Any) -> list[int]:
        """The global ranks whose `value` (small, picklable) differs from the first rank's;
        the same list on every rank."""
        if self.size == 1:
            return []
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, value, group=self.group)
        return [self.ranks[i] for i, v in enumerate(gathered) if v != gathered[0]]

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank's flag is set (an abort every rank takes at the
        same engine step, so their schedules, and the engine's collectives, stay in step)."""
        if self.size == 1:
            return flag
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def broadcast(self, obj: Any = None) -> Any:
        """The first rank's `obj` on every rank."""
        if self.size == 1:
            return obj
        holder = [obj if self.is_first else None]
        dist.broadcast_object_list(holder, src=self.ranks[0], group=self.group)
        return holder[0]

    def gather_to_first(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in group order, on the first rank (None elsewhere)."""
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_first else None
        dist.gather_object(obj, out, dst=self.ranks[0], group=self.group)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


def create_engine_tp_group(tp_size: int) -> EngineTPGroup:
    """This rank's engine group (blocks of `tp_size` consecutive ranks). Collective over the
    whole world when tp_size > 1 (every rank creates its gloo group, in the same order)."""
    if tp_size == 1:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return EngineTPGroup(size=1, rank=0, ranks=(rank,))
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"an engine TP size of {tp_size} needs a process group: launch with torchrun and "
            "create the runtime (yatt.core.init_runtime) before the engine"
        )
    world, me = dist.get_world_size(), dist.get_rank()
    blocks = [list(range(start, start + tp_size)) for start in range(0, world, tp_size)]
    mine = None
    for block in blocks:  # new_group is collective: every rank creates every group
        group = dist.new_group(block, backend="gloo")
        if me in block:
            mine = EngineTPGroup(
                size=tp_size, rank=block.index(me), ranks=tuple(block), group=group
            )
    assert mine is not None
    return mine
