"""SGLang adapter (`pip install 'yatt-rollout[sglang]'`): `sglang.Engine` behind our protocol.

    requests -> one SGLang request per sample (seed from (seed, request, sample))
             -> Engine.async_generate, all awaited on the engine's own event loop in a worker
                thread -> Completion as each finishes

Memory: `release_memory_occupation` / `resume_memory_occupation` (the engine is built with
enable_memory_saver=True). Weights: `update_weights_from_tensor`, one bucket per call, then a
cache flush. Verified on SGLang 0.5.17 on an H100 (packages/yatt-rollout/tests/test_gpu_engines.py).
Where SGLang differs from our protocol, the adapter bridges it:
- seeds: SGLang reads `sampling_seed` only with enable_deterministic_inference (batch-invariant
  kernels, slower); `seed_each_sample=False` drops both for speed and loses reproducibility;
- context: SGLang 0.5.17 keeps prompt + new tokens <= context_length - 2 and prompts <=
  context_length - 6 (Scheduler and TpWorker reserve positions), refuses a request asking for
  more, and refuses a context beyond the model's positions; our engines stop at the context
  with reason "length". The adapter serves `context_length - 2` positions (its `max_seq_len`),
  caps each request's `max_new_tokens` there, and refuses a longer prompt itself;
- `ignore_eos=True` also disables SGLang's `stop_token_ids`; our protocol ignores only the
  model's EOS, so the stop tokens are then applied here, to the returned tokens;
- sleep drops the weights unless enable_weights_cpu_backup is set (`weights_cpu_backup`);
- failures come back as values, not exceptions: `update_weights_from_tensor` returns (success,
  message) and `flush_cache` a FlushCacheReqOutput(success, message), refused while requests
  are still pending. A failed bucket raises RuntimeError at once (the engine holds partly old
  weights: no rollout may follow); a refused flush is tried again briefly (aborted requests
  drain), then raises. `release_memory_occupation` and `resume_memory_occupation` return
  nothing to check.
- label logprobs (SamplingParams.label_token_ids): SGLang's `token_ids_logprob`, read from
  meta_info["output_token_ids_logprobs"][0]. Not yet run on a GPU; SGLang computes them from
  the logits it samples with, which may be temperature-scaled (our contract: unscaled), so a
  judge scored this way should sample greedily (the GenRM default for one vote).

Tensor parallelism (SGLangConfig.tp_size = N, `_engine_tp.py`), as verl and slime run SGLang per
TP group: the group's first rank builds `sglang.Engine(tp_size=N, base_gpu_id=<its GPU>)`,
which starts one SGLang TP worker per GPU of the group (N consecutive yatt ranks on one node:
the policy's TP group); the other ranks hold no engine. Every rank of the group is given the same
requests (TP peers share a batch; checked, and the first rank's seed taken); the first rank
runs them and broadcasts each completion as it finishes, so every rank streams the same results
in the same order. Weight sync: each rank passes FULL Hugging Face tensors on its own GPU (what
MegatronPolicy.named_weights gathers), serialized as CUDA IPC handles
(`MultiprocessingSerializer`); the first rank hands SGLang one `LocalSerializedTensor` per name
holding every rank's handle, so SGLang's TP worker r reads rank r's copy on its own GPU (no
cross-GPU copy) and its weight loaders cut its shard (Megatron's shards are not laid out like
SGLang's: full tensors let the engine shard its own way). Control calls (weights, flush, sleep,
wake) run on the first rank and their status is broadcast: every rank returns once the engine
is done on every GPU, and raises alike. Aborting is the first rank's call (its peers receive
the aborted completions). At N = 1 the same path runs without collectives.

LoRA (SGLangConfig.enable_lora, set by the trainer with policy.lora): a sync of the adapter's
tensors alone (yatt.core's wire format) is loaded from memory with
Engine.load_lora_adapter_from_tensors (PEFT names and config, `_engine_lora.py`) under a new
name per version, the old one unloaded first; every later request names it in `lora_path`
(Request.use_adapter=False: none, the base, in the same batch). Cost: a copy of the adapter
to this GPU, CUDA IPC handles, and each TP worker's copy to host then into its LoRA buffers
(under TP > 1 a worker on another GPU reads the first rank's copy across GPUs). Not yet run on
a GPU (tests/test_gpu_engines.py holds the check).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from yatt.placement import MemoryNeed
from yatt.rollout._adapter import ThreadedAdapter
from yatt.rollout._engine_deps import require_engine
from yatt.rollout._engine_lora import (
    AdapterFolders,
    check_adapter_dir,
    check_served_modules,
    peft_adapter,
)
from yatt.rollout._engine_memory import (
    CUDA_GRAPH_BYTES_ESTIMATE,
    engine_memory_need,
    served_weight_bytes,
)
from yatt.rollout._engine_tp import check_engine_tp, create_engine_tp_group
from yatt.rollout._keys import derive_key
from yatt.rollout._requests import request_id_of
from yatt.rollout._types import (
    DEFAULT_BUCKET_BYTES,
    Completion,
    FinishReason,
    Request,
    SamplingParams,
)
from yatt.rollout._weights import iter_buckets, peek_adapter_sync, refuse_adapter_tensors

# A refused cache flush (requests still pending, e.g. draining after an abort) is tried again
# after 0.05, 0.1, ... s: about 1.5 s in all before it raises.
FLUSH_TRIES = 5
FLUSH_FIRST_WAIT_S = 0.05


def sglang_status(result: Any) -> tuple[bool, str]:
    """(success, message) from what an SGLang 0.5.17 control call returns: a (success, message)
    tuple (update_weights_from_tensor) or an object with `success` and `message`
    (flush_cache's FlushCacheReqOutput) or `error_message` (the LoRA calls' LoadLoRAAdapterReqOutput,
    UnloadLoRAAdapterReqOutput). None (a call that reports nothing) counts as success."""
    if result is None:
        return True, ""
    if isinstance(result, tuple | list) and result and isinstance(result[0], bool):
        return result[0], str(result[1]) if len(result) > 1 else ""
    if isinstance(result, bool):
        return result, ""
    success = getattr(result, "success", None)
    if isinstance(success, bool):
        message = getattr(result, "message", None) or getattr(result, "error_message", None)
        return success, str(message or "")
    raise RuntimeError(f"SGLang answered {result!r:.200}, not a (success, message) status")


# Positions SGLang 0.5.17 keeps back from context_length: for prompt + new tokens (Scheduler:
# max_req_len - input_len - 1, max_req_len = context - 1) and for a prompt (TpWorker: - 5 more).
CONTEXT_RESERVED = 2
PROMPT_RESERVED = 6


@dataclass(kw_only=True)
class SGLangConfig:
    """How the SGLang engine is built; other `sglang.Engine` arguments go in `engine_kwargs`."""

    dtype: str = "auto"
    mem_fraction_static: float = 0.5  # leave room for a colocated trainer or GenRM
    context_length: int | None = None  # None: the model's own; serves 2 positions less
    seed_each_sample: bool = True  # reproducible samples (SGLang's deterministic mode)
    weights_cpu_backup: bool = True  # sleep keeps the weights on the host (else: sync on wake)
    # GPUs (yatt ranks, on one node) serving one model: the policy's TP size; 1: one per GPU.
    tp_size: int = 1
    # Serve a LoRA adapter synced alone (set by the trainer when policy.lora is set): SGLang
    # sizes its LoRA buffers at launch for ranks up to max_lora_rank on the module types in
    # lora_target_modules (["all"]: every one it adapts).
    enable_lora: bool = False
    max_lora_rank: int = 16
    lora_target_modules: tuple[str, ...] = ("all",)
    # Only for an SGLang without load_lora_adapter_from_tensors: the adapter is written there
    # as a PEFT folder (tmpfs: host memory, no disk) and loaded by path.
    lora_adapter_dir: str = "/dev/shm"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        taken = sorted(set(self.engine_kwargs) & {"tp_size", "base_gpu_id"})
        if taken:
            raise ValueError(
                f"SGLangConfig.engine_kwargs sets {taken}: the adapter sets them from "
                "SGLangConfig.tp_size and this rank's GPU; use that field"
            )
        lora_taken = sorted(
            set(self.engine_kwargs) & {"enable_lora", "max_lora_rank", "lora_target_modules"}
        )
        if lora_taken:
            raise ValueError(
                f"SGLangConfig.engine_kwargs sets {lora_taken}: use SGLangConfig's fields of "
                "those names"
            )
        if isinstance(self.lora_target_modules, list):  # YAML gives lists
            self.lora_target_modules = tuple(self.lora_target_modules)
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"SGLangConfig.enable_lora={self.enable_lora!r}: must be a bool")
        rank = self.max_lora_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"SGLangConfig.max_lora_rank={rank!r}: must be an int >= 1")
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) or self.tp_size < 1:
            raise ValueError(f"SGLangConfig.tp_size={self.tp_size!r}: must be an int >= 1")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(
                f"SGLangConfig.mem_fraction_static={self.mem_fraction_static!r}: must be in (0, 1]"
            )


def sglang_sampling_params(
    sampling: SamplingParams, *, sample_seed: int | None, max_new_tokens: int | None = None
) -> dict[str, Any]:
    """Our SamplingParams as one SGLang sampling-params dict (one sample per request).

    max_new_tokens: a request's own limit (Request.max_new_tokens), overriding the call's.
    sample_seed None: no per-sample seed (the engine is not in deterministic mode).
    """
    params = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # SGLang: -1 disables
        "min_p": sampling.min_p,  # 0 disables min-p in SGLang as here
        # SGLang's repetition penalizer (penaltylib) counts input and output tokens in the
        # releases read (0.4-0.5); not yet run with a penalty on a GPU.
        "repetition_penalty": sampling.repetition_penalty,
        "max_new_tokens": (
            max_new_tokens if max_new_tokens is not None else sampling.max_new_tokens
        ),
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "skip_special_tokens": False,
    }
    if sample_seed is not None:
        params["sampling_seed"] = sample_seed
    return params


def label_logprobs_from_sglang(
    meta: dict[str, Any], label_token_ids: Sequence[int]
) -> list[float] | None:
    """The first position's logprobs of `label_token_ids`, in their order, from SGLang's
    output_token_ids_logprobs ([logprob, token_id, text] per asked id); None if absent."""
    positions = meta.get("output_token_ids_logprobs") or []
    if not label_token_ids or not positions or not positions[0]:
        return None
    by_id = {int(entry[1]): float(entry[0]) for entry in positions[0]}
    if any(t not in by_id for t in label_token_ids):
        return None
    return [by_id[t] for t in label_token_ids]


def completion_from_sglang(
    output: dict[str, Any],
    *,
    request_index: int,
    sample_index: int,
    request: Request,
    stop_token_ids: Sequence[int] = (),
    label_token_ids: Sequence[int] = (),
) -> Completion:
    """One SGLang output dict (output_ids, meta_info) as a Completion.

    stop_token_ids: applied here (cut after the first one, reason "stop") when the request ran
    with ignore_eos, which makes SGLang skip them.
    """
    meta = output["meta_info"]
    tokens = list(output["output_ids"])
    logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(tokens):
        raise RuntimeError(
            f"SGLang returned {len(logprobs)} logprobs for {len(tokens)} tokens; the request "
            "must set return_logprob=True"
        )
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in ("stop", "length", "abort"):
        raise RuntimeError(f"SGLang finished a request with unknown reason {reason!r}")
    finish: FinishReason = reason
    stop_at = next((i for i, t in enumerate(tokens) if t in stop_token_ids), None)
    if stop_at is not None:
        tokens, logprobs, finish = tokens[: stop_at + 1], logprobs[: stop_at + 1], "stop"
    return Completion(
        request_index=request_index,
        sample_index=sample_index,
        prompt_ids=list(request.prompt_ids),
        response_ids=tokens,
        logprobs=logprobs,
        finish_reason=finish,
        request_id=request_id_of(request, request_index),
        metadata=dict(request.metadata),
        label_logprobs=label_logprobs_from_sglang(meta, label_token_ids) if tokens else None,
    )


def sglang_memory_tags(names: Sequence[str], *, has_cuda_graph_tag: bool) -> list[str]:
    """Our tags as SGLang's; its CUDA graphs (when tagged separately) follow the KV cache."""
    tags = [t for t in ("weights", "kv_cache") if t in names]
    if "kv_cache" in tags and has_cuda_graph_tag:
        tags.append("cuda_graph")
    return tags


@dataclass(frozen=True)
class _Call:
    """One generate/stream call, validated; its jobs are built once the TP group agreed."""

    requests: Sequence[Request]
    sampling: SamplingParams
    local_seed: int


_DONE = ("done", None)  # the end of a call's broadcast stream of completions


def _serialize_bucket(bucket: list[tuple[str, torch.Tensor]]) -> list[bytes]:
    """This rank's tensors as SGLang's MultiprocessingSerializer handles (CUDA IPC on a GPU:
    a pointer to the tensor, not its bytes)."""
    from sglang.srt.utils import MultiprocessingSerializer

    # SGLang's own patch, so a handle names its GPU by UUID (verl and slime apply it too); the
    # module moved between releases.
    for where in ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch"):
        try:
            importlib.import_module(where).monkey_patch_torch_reductions()
            break
        except (ImportError, AttributeError):
            continue
    return [MultiprocessingSerializer.serialize(tensor.detach()) for _, tensor in bucket]


def _on_this_gpu(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Host tensors copied to this rank's GPU, so the handles are CUDA IPC ones: SGLang 0.5.17's
    patched reduction (its device-UUID patch) fails on a CPU tensor with an IndexError. The
    copies are kept by the returned list until SGLang has loaded them. Without CUDA (the fakes)
    the bucket is returned as it is."""
    if not torch.cuda.is_available() or all(t.is_cuda for _, t in bucket):
        return bucket
    device = torch.device("cuda", torch.cuda.current_device())
    moved = [(name, t if t.is_cuda else t.to(device, non_blocking=True)) for name, t in bucket]
    torch.cuda.current_stream(device).synchronize()  # another process reads them next
    return moved


class SGLangEngine(ThreadedAdapter):
    """RolloutEngine over an in-process `sglang.Engine` with the memory saver enabled.

    policy_tp_size: the policy's TP size, when the caller knows it: SGLangConfig.tp_size must
        equal it (checked before anything loads).
    device_total_bytes: the GPU's memory, read at construction (None on a CPU-only host);
        `memory_need()` sizes the engine's pool from it.
    """

    _thread_name = "yatt-sglang"

    def __init__(
        self,
        model: str | Path,
        *,
        config: SGLangConfig | None = None,
        policy_tp_size: int | None = None,
    ) -> None:
        self.config = config = config if config is not None else SGLangConfig()
        tp_size = config.tp_size
        check_engine_tp(
            "SGLangConfig.tp_size", tp_size, model_dir=model, policy_tp_size=policy_tp_size
        )
        check_one_node("SGLangConfig.tp_size", tp_size)
        if config.enable_lora:
            check_adapter_dir("SGLangConfig.lora_adapter_dir", config.lora_adapter_dir)
        # Lazy: an optional, GPU-only dependency; checked before any GPU memory is taken.
        sglang = require_engine("sglang", model)
        self._model_dir = model
        self._group = group = create_engine_tp_group(tp_size)
        self._engine = None
        self._has_cuda_graph_tag = False
        facts = None
        if group.is_first:
            from sglang.srt import constants

            kwargs = {
                "model_path": str(model),
                "enable_memory_saver": True,
                "enable_weights_cpu_backup": config.weights_cpu_backup,
                # SGLang reads a request's sampling_seed only in deterministic mode (0.5.17:
                # SamplingBatchInfo.from_schedule_batch); without it every seed draws alike.
                "enable_deterministic_inference": config.seed_each_sample,
                "dtype": config.dtype,
                "mem_fraction_static": config.mem_fraction_static,
                # One TP worker per GPU of the group, from this rank's GPU on.
                "tp_size": tp_size,
                "base_gpu_id": local_gpu_index(),
                **({"context_length": config.context_length} if config.context_length else {}),
                **config.engine_kwargs,
            }
            if config.enable_lora:
                kwargs.update(
                    enable_lora=True,
                    max_lora_rank=config.max_lora_rank,
                    lora_target_modules=list(config.lora_target_modules),
                )
            self._engine = sglang.Engine(**kwargs)
            self._has_cuda_graph_tag = hasattr(constants, "GPU_MEMORY_TYPE_CUDA_GRAPH")
            manager = self._engine.tokenizer_manager
            facts = (
                manager.tokenizer,
                manager.context_len,
                manager.model_config.vocab_size,
                bool(getattr(manager.model_config, "is_multimodal", False)),
            )
        # The peers hold no engine: what they validate against comes from the first rank.
        self.tokenizer, context_len, self.vocab_size, self.is_multimodal = group.broadcast(facts)
        # SGLang reserves positions: prompt + new tokens <= context - 2, prompt <= context - 6.
        self.max_seq_len = context_len - CONTEXT_RESERVED
        self.max_prompt_len = context_len - PROMPT_RESERVED
        self._lock = threading.Lock()
        self.device_total_bytes: int | None = (
            torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else None
        )
        self.serves_lora = config.enable_lora
        # The loaded adapter's name (None: none synced yet, requests read the base), the
        # versions synced, and the folder of one loaded by path (the fallback).
        self._lora_name: str | None = None
        self._num_adapters = 0
        self._lora_folder: Path | None = None
        self._folders: AdapterFolders | None = None

    @property
    def tp_group(self):
        """The ranks serving this engine (`_engine_tp.EngineTPGroup`)."""
        return self._group

    @property
    def supports_label_logprobs(self) -> bool:
        """Completions carry `label_logprobs` (SGLang's token_ids_logprob)."""
        return True

    def memory_need(self) -> MemoryNeed | None:
        """This GPU's share (yatt.placement.MemoryNeed): the weights of one TP rank, the KV
        cache filling mem_fraction_static x the GPU's memory, and the CUDA graphs (an estimate;
        none with engine_kwargs disable_cuda_graph). Every rank of a group reports it: each GPU
        holds one SGLang TP worker. None when the GPU or the checkpoint is unknown."""
        config = self.config
        weights = served_weight_bytes(self._model_dir, config.dtype, tp_size=config.tp_size)
        if weights is None or self.device_total_bytes is None:
            return None
        is_eager = bool(config.engine_kwargs.get("disable_cuda_graph"))
        return engine_memory_need(
            weight_bytes=weights,
            pool_fraction=config.mem_fraction_static,
            device_total_bytes=self.device_total_bytes,
            graph_bytes=0 if is_eager else CUDA_GRAPH_BYTES_ESTIMATE,
            settings={
                "weights": "SGLangConfig.tp_size (more GPUs per engine)",
                "kv_cache": "SGLangConfig.mem_fraction_static (lower it)",
                "cuda_graph": "SGLangConfig.engine_kwargs['disable_cuda_graph']=True",
            },
        )

    def abort(self) -> None:
        if self._engine is not None and self._lock.locked():
            manager = self._engine.tokenizer_manager
            # The tokenizer manager belongs to the engine's loop: ask that loop to abort.
            self._engine.loop.call_soon_threadsafe(manager.abort_request, "", True)

    def _prepare(self, requests: Sequence[Request], sampling: SamplingParams) -> _Call:
        for i, request in enumerate(requests):
            if len(request.prompt_ids) > self.max_prompt_len:
                raise ValueError(
                    f"requests[{i}] has {len(request.prompt_ids)} prompt tokens; SGLang takes at "
                    f"most {self.max_prompt_len} (its context_length - {PROMPT_RESERVED}): "
                    "shorten the prompt or raise SGLangConfig.context_length"
                )
        return _Call(requests, sampling, self._validate_and_seed(requests, sampling))

    def _jobs(self, call: _Call, seed: int) -> list[tuple]:
        requests, sampling = call.requests, call.sampling
        is_seeded = self.config.seed_each_sample
        # With ignore_eos SGLang skips stop_token_ids: they are applied to the output instead.
        local_stops = tuple(sampling.stop_token_ids) if sampling.ignore_eos else ()
        jobs = []
        for i, request in enumerate(requests):
            wanted = request.max_new_tokens or sampling.max_new_tokens
            room = self.max_seq_len - len(request.prompt_ids)
            for j in range(sampling.n):
                params = sglang_sampling_params(
                    sampling,
                    sample_seed=derive_key(seed, i, j) if is_seeded else None,
                    max_new_tokens=min(wanted, room),
                )
                jobs.append(
                    (i, j, request, params, local_stops, sampling.label_token_ids, self._lora_name)
                )
        return jobs

    def _run(self, call: _Call, emit) -> None:
        with self._lock:
            # Collective (TP > 1): the group checks the call and takes its first rank's seed.
            seed = self._group.agree_on_call(call.requests, call.sampling, call.local_seed)
            if self._group.is_first:
                self._run_engine(self._jobs(call, seed), emit)
            else:
                self._receive(emit)

    def _run_engine(self, jobs: list[tuple], emit) -> None:
        """Drive the engine; each completion goes to this rank's caller and to its peers."""
        group = self._group

        def emit_everywhere(completion: Completion) -> None:
            group.broadcast(("completion", completion))
            emit(completion)

        async def one(
            i: int,
            j: int,
            request: Request,
            params: dict[str, Any],
            stops: tuple[int, ...],
            labels: tuple[int, ...],
            lora_name: str | None,
        ) -> None:
            # The synced adapter by name; use_adapter=False (or none synced): the base.
            lora = lora_name if request.use_adapter else None
            output = await self._engine.async_generate(
                input_ids=list(request.prompt_ids),
                sampling_params=params,
                image_data=list(request.images) if request.images else None,
                return_logprob=True,
                **({"token_ids_logprob": list(labels)} if labels else {}),
                **({"lora_path": lora} if lora is not None else {}),
            )
            emit_everywhere(
                completion_from_sglang(
                    output,
                    request_index=i,
                    sample_index=j,
                    request=request,
                    stop_token_ids=stops,
                    label_token_ids=labels,
                )
            )

        async def all_jobs() -> None:
            await asyncio.gather(*(one(*job) for job in jobs))

        try:
            self._engine.loop.run_until_complete(all_jobs())
        except BaseException as exc:
            # The peers wait for the stream's end: tell them it failed, then raise here.
            group.broadcast(("error", f"{type(exc).__name__}: {exc}"))
            raise
        group.broadcast(_DONE)

    def _receive(self, emit) -> None:
        """A peer's share of a call: the first rank's completions, in its order."""
        while True:
            kind, value = self._group.broadcast()
            if kind == "done":
                return
            if kind == "error":
                raise RuntimeError(
                    f"SGLang failed on rank {self._group.ranks[0]}, the first of this engine's "
                    f"TP group: {value}"
                )
            emit(value)

    def _on_first(self, what: str, action) -> tuple[bool, str]:
        """Run `action` (returning an SGLang status) on the first rank; its (success, message),
        or its exception, on every rank."""
        outcome = None
        if self._group.is_first:
            try:
                outcome = ("status", sglang_status(action()))
            except Exception as exc:
                outcome = ("error", f"{type(exc).__name__}: {exc}")
        kind, value = self._group.broadcast(outcome)
        if kind == "error":
            raise RuntimeError(f"SGLang {what} failed on rank {self._group.ranks[0]}: {value}")
        return value

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        """Load Hugging Face-named FULL tensors, bucket by bucket: every rank of a TP group
        passes the same names, each its own copy on its own GPU (module docstring). A LoRA
        adapter's tensors alone (the first one names it: "<m>.lora_A" ...) replace the served
        adapter instead (`_load_adapter`)."""
        is_adapter, named_tensors = peek_adapter_sync(named_tensors)
        if is_adapter and self.serves_lora:
            self._load_adapter(named_tensors)
            return
        LocalSerializedTensor = _local_serialized_tensor_class()

        with self._lock:
            for index, bucket in enumerate(iter_buckets(named_tensors, bucket_bytes=bucket_bytes)):
                refuse_adapter_tensors(bucket, "SGLang")
                # Every rank's handles on the first rank; the peers' tensors stay alive (held
                # by `bucket`) until the status broadcast says SGLang has loaded them.
                bucket = _on_this_gpu(bucket)
                names = [(name, tuple(tensor.shape)) for name, tensor in bucket]
                gathered = self._group.gather_to_first((names, _serialize_bucket(bucket)))

                def load(gathered=gathered, names=names):
                    differing = [
                        self._group.ranks[r] for r, (n, _) in enumerate(gathered) if n != names
                    ]
                    if differing:
                        raise ValueError(
                            f"ranks {differing} passed other tensors (names or shapes) than "
                            f"rank {self._group.ranks[0]}; every rank must pass the same full "
                            "tensors"
                        )
                    named = [
                        (name, LocalSerializedTensor(values=[h[k] for _, h in gathered]))
                        for k, (name, _) in enumerate(names)
                    ]
                    return self._engine.update_weights_from_tensor(
                        named_tensors=named, flush_cache=False
                    )

                success, message = self._on_first("update_weights_from_tensor", load)
                if not success:
                    names = [name for name, _ in bucket]
                    raise RuntimeError(
                        f"SGLang update_weights_from_tensor failed on bucket {index} "
                        f"({len(names)} tensors, from {names[0]!r}): {message or 'no message'}; "
                        "the engine holds partly old weights: do not roll out with it"
                    )
            # Cached prefixes hold keys/values computed with the old weights.
            self._flush_cache()

    def _load_adapter(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the served adapter, on the first rank (module docstring): the old one
        unloaded, the new one loaded from memory under a new name (SGLang's
        load_lora_adapter_from_tensors; the tensors on this GPU, so its workers get CUDA IPC
        handles), or from a tmpfs folder where that call is missing; later requests name it.
        The peers' copies are not read (they are the same full tensors)."""
        adapter = peft_adapter(pairs, "SGLang")
        check_served_modules(adapter, "SGLang", "sglang")
        if adapter.rank > self.config.max_lora_rank:
            raise ValueError(
                f"update_weights: the adapter's rank {adapter.rank} is over "
                f"SGLangConfig.max_lora_rank={self.config.max_lora_rank}; raise it"
            )
        with self._lock:
            self._num_adapters += 1
            name = f"yatt-lora-v{self._num_adapters}"
            old = self._lora_name
            self._lora_name = None  # nothing named until the new one loaded
            if old is not None:
                success, message = self._on_first(
                    "unload_lora_adapter", lambda: self._engine.unload_lora_adapter(old)
                )
                if not success:
                    raise RuntimeError(
                        f"SGLang unload_lora_adapter({old!r}) failed: {message or 'no message'}"
                        "; do not roll out with this engine"
                    )
                if self._lora_folder is not None:
                    self._folders.remove(self._lora_folder)
                    self._lora_folder = None
            success, message = self._on_first(
                "load_lora_adapter", lambda: self._load_on_first(adapter, name)
            )
            if not success:
                raise RuntimeError(
                    f"SGLang failed to load LoRA adapter {name!r}: {message or 'no message'}; "
                    "the engine serves no adapter: do not roll out with it"
                )
            self._lora_name = name
            # Cached prefixes hold keys/values computed with the old adapter.
            self._flush_cache()

    def _load_on_first(self, adapter, name: str) -> Any:
        """The first rank's load: from memory where the engine has the call, else by path."""
        load_from_tensors = getattr(self._engine, "load_lora_adapter_from_tensors", None)
        if load_from_tensors is not None:
            # On this GPU: SGLang's patched CPU-tensor reduction fails (see _on_this_gpu);
            # the copies live until the call returns (the workers have copied them by then).
            tensors = dict(_on_this_gpu(list(adapter.tensors.items())))
            return load_from_tensors(name, tensors, adapter.config)
        if self._folders is None:
            self._folders = AdapterFolders(self.config.lora_adapter_dir)
        self._lora_folder = self._folders.write(adapter, name)
        return self._engine.load_lora_adapter(name, str(self._lora_folder))

    def _flush_cache(self) -> None:
        """flush_cache, tried again while SGLang refuses it; RuntimeError after the last."""
        message = ""
        for attempt in range(FLUSH_TRIES):
            if attempt:
                time.sleep(FLUSH_FIRST_WAIT_S * 2 ** (attempt - 1))
            success, message = self._on_first("flush_cache", lambda: self._engine.flush_cache())
            if success:
                return
        raise RuntimeError(
            f"SGLang flush_cache failed {FLUSH_TRIES} times: {message or 'no message'} "
            "(SGLang refuses while requests are pending); cached prefixes hold keys/values of "
            "the old weights: do not roll out with it"
        )

    def sleep(self) -> None:
        """Release the engine's memory on every GPU of the group (returns on every rank once
        it is released)."""
        with self._lock:
            self._on_first(
                "release_memory_occupation", lambda: self._engine.release_memory_occupation()
            )

    def wake_up(self, tags: Sequence[str] | None = ("weights", "kv_cache")) -> None:
        names = ["weights", "kv_cache"] if tags is None else list(tags)
        if isinstance(tags, str) or any(t not in ("weights", "kv_cache") for t in names):
            raise ValueError(f"wake_up(tags={tags!r}): use a sequence of 'weights', 'kv_cache'")
        with self._lock:
            self._on_first(
                "resume_memory_occupation",
                lambda: self._engine.resume_memory_occupation(
                    tags=sglang_memory_tags(names, has_cuda_graph_tag=self._has_cuda_graph_tag)
                ),
            )

    def close(self) -> None:
        self.abort()
        with self._lock:
            if self._engine is not None:
                self._engine.shutdown()
            if self._folders is not None:
                self._folders.close()


def local_gpu_index() -> int:
    """This process's GPU among the visible ones (set by yatt.core.init_runtime), else its
    LOCAL_RANK: where an SGLang engine's first TP worker goes."""
    if torch.cuda.is_available():
        return torch.cuda.current_device()
    return int(os.environ.get("LOCAL_RANK", "0"))


def check_one_node(field: str, tp_size: int) -> None:
    """SGLang's Engine starts its TP workers on the GPUs of its own node: a group must not
    cross a node boundary (torchrun's LOCAL_WORLD_SIZE ranks per node)."""
    per_node = os.environ.get("LOCAL_WORLD_SIZE")
    if tp_size > 1 and per_node is not None and int(per_node) % tp_size:
        raise ValueError(
            f"{field}={tp_size} does not divide the {per_node} ranks per node: an SGLang "
            "engine's TP workers run on one node; use a divisor of the GPUs per node"
        )


def _local_serialized_tensor_class() -> type:
    """SGLang's per-TP-rank tensor handle: in `model_runner_components.weight_updater` since
    0.5.17 (the version yatt is verified with), in `model_runner` before."""
    try:
        from sglang.srt.model_executor.model_runner_components.weight_updater import (
            LocalSerializedTensor,
        )
    except ImportError:
        from sglang.srt.model_executor.model_runner import LocalSerializedTensor
    return LocalSerializedTensor
