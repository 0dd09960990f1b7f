"""vLLM adapter (`pip install 'yatt-rollout[vllm]'`): an in-process `vllm.LLM` behind our protocol.

    requests -> one vLLM request per sample (n=1, seed from (seed, request, sample))
             -> LLMEngine.add_request / step() loop (DELTA outputs, so an abort keeps partials)
             -> Completion as each request finishes

Weights load through a worker extension (`_vllm_worker.WeightLoaderExtension`) called with
`collective_rpc`, one bucket at a time. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so buckets pass by reference, not through a pipe.
Logprobs are vLLM's "processed_logprobs": log softmax(logits / T) after the repetition penalty
and top-k/top-p/min-p, which is our definition (the model's own tempered logprobs) when
top_p == 1, top_k == 0, min_p == 0 and repetition_penalty == 1 (vLLM has no unprocessed
tempered mode); with a knob on, the gap shows as engine-vs-trainer mismatch.
Label logprobs (SamplingParams.label_token_ids) come from one extra 1-token request per
request (its prompt is prefix-cached): `allowed_token_ids` = the labels, `logprobs` = their
number, so with processed logprobs they are log softmax over the LABELS ONLY (renormalized:
their ratios, which a verdict's P(yes) uses, equal the full vocabulary's; their values do not).
vLLM has no per-request "logprobs of these ids". Not yet run on a GPU.
Verified on vLLM 0.26.0 on an H100 (packages/yatt-rollout/tests/test_gpu_engines.py). A seed per
sample sends vLLM's sampler down its per-request-generator path, one kernel per request and
step: `seed_each_sample=False` trades reproducibility for speed (bench/rollout/engines.py measures it).
Status: `collective_rpc` returns each worker's answer (the extension's count of tensors loaded,
checked against the bucket) and raises a worker's exception; `reset_prefix_cache` returns False
while blocks are still held (requests draining after an abort): it is tried again briefly, then
RuntimeError, as is a short count. `sleep` and `wake_up` return nothing to check.

Tensor parallelism (VLLMConfig.tensor_parallel_size = N, `_engine_tp.py`): under torchrun every
rank builds `LLM(..., tensor_parallel_size=N, distributed_executor_backend="external_launcher")`,
vLLM's documented way of running under an external launcher: one worker per process, the ranks
of a TP group (N consecutive ranks, the policy's TP group) serving one model, further groups
vLLM's "external DP" ranks, each generating on its own. Every rank of a group is given the same
requests (TP peers share a batch) and must step its engine alike: the group checks the call,
takes its first rank's seed, seeds the engine alike (VLLMConfig.seed) and agrees on an abort
once per step, so results are identical on every rank. Weight sync: each rank passes FULL
Hugging Face tensors (what MegatronPolicy.named_weights gathers on every rank) and vLLM's own
weight loaders cut this rank's shard (fused QKV and gate/up, padded vocabulary): mapping
Megatron's shards onto vLLM's directly would need their layouts to agree, which they do not
(Megatron interleaves QKV per group). Sleep, wake and the weight load are per rank. Under
torchrun the external launcher is used at N = 1 too (each rank its own engine); a process not
launched by torchrun serves N = 1 with vLLM's default executor.

LoRA (VLLMConfig.enable_lora, set by the trainer with policy.lora): a sync of the adapter's
tensors alone (yatt.core's wire format) becomes a PEFT folder on tmpfs, registered with
LLMEngine.add_lora under a new name and int id per version, the old one removed first; every
later request carries its LoRARequest (Request.use_adapter=False: none, the base, in the same
batch). vLLM 0.26.0 has no from-memory adapter load (LoRARequest takes a path), so the cost is
a safetensors write to host memory and vLLM's read back, per sync (`_engine_lora.py`).
Not yet run on a GPU (tests/test_gpu_engines.py holds the check).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from yatt.placement import MemoryNeed
from yatt.rollout._adapter import ThreadedAdapter
from yatt.rollout._engine_deps import require_engine
from yatt.rollout._engine_lora import (
    VLLM_MAX_LORA_RANKS,
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
from yatt.rollout._engine_tp import check_engine_tp, create_engine_tp_group, is_launched
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

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "yatt.rollout._vllm_worker.WeightLoaderExtension"
# A refused prefix-cache reset (blocks still held, e.g. draining after an abort) is tried again
# after 0.05, 0.1, ... s: about 1.5 s in all before it raises.
RESET_TRIES = 5
RESET_FIRST_WAIT_S = 0.05


@dataclass(kw_only=True)
class VLLMConfig:
    """How the vLLM engine is built; other `vllm.LLM` arguments go in `llm_kwargs`."""

    dtype: str = "auto"
    gpu_memory_utilization: float = 0.5  # leave room for a colocated trainer or GenRM
    max_model_len: int | None = None  # None: the model's own
    sleep_level: int = 1  # 1: weights to CPU, KV dropped; 2: both dropped (sync weights on wake)
    enforce_eager: bool = False  # True disables vLLM's CUDA graphs
    seed_each_sample: bool = True  # reproducible samples (vLLM's per-request generators)
    # GPUs (yatt ranks) serving one model: the policy's TP size; 1 serves a model per GPU.
    tensor_parallel_size: int = 1
    seed: int = 0  # the engine's global seed: the same on every rank of a TP group
    # Serve a LoRA adapter synced alone (set by the trainer when policy.lora is set): vLLM's
    # LoRA layers wrap its supported linear layers, sized for ranks up to max_lora_rank (one
    # of vLLM's 1, 8, 16, 32, 64, 128, 256, 320, 512); one adapter at a time (max_loras=1).
    enable_lora: bool = False
    max_lora_rank: int = 16
    # Where each synced adapter is written as a PEFT folder for vLLM to read (its LoRA API
    # loads from a path only): tmpfs, so host memory and no disk.
    lora_adapter_dir: str = "/dev/shm"
    llm_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        taken = sorted(
            set(self.llm_kwargs) & {"tensor_parallel_size", "distributed_executor_backend"}
        )
        if taken:
            raise ValueError(
                f"VLLMConfig.llm_kwargs sets {taken}: the adapter sets them from "
                "VLLMConfig.tensor_parallel_size (and torchrun); use that field"
            )
        lora_taken = sorted(set(self.llm_kwargs) & {"enable_lora", "max_lora_rank", "max_loras"})
        if lora_taken:
            raise ValueError(
                f"VLLMConfig.llm_kwargs sets {lora_taken}: use VLLMConfig.enable_lora and "
                "max_lora_rank (the adapter serves one adapter at a time)"
            )
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"VLLMConfig.enable_lora={self.enable_lora!r}: must be a bool")
        if self.max_lora_rank not in VLLM_MAX_LORA_RANKS:
            raise ValueError(
                f"VLLMConfig.max_lora_rank={self.max_lora_rank!r}: vLLM takes one of "
                f"{list(VLLM_MAX_LORA_RANKS)}"
            )
        if (
            not isinstance(self.tensor_parallel_size, int)
            or isinstance(self.tensor_parallel_size, bool)
            or self.tensor_parallel_size < 1
        ):
            raise ValueError(
                f"VLLMConfig.tensor_parallel_size={self.tensor_parallel_size!r}: must be an "
                "int >= 1"
            )
        if self.sleep_level not in (1, 2):
            raise ValueError(f"VLLMConfig.sleep_level={self.sleep_level!r}: use 1 or 2")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"VLLMConfig.gpu_memory_utilization={self.gpu_memory_utilization!r}: "
                "must be in (0, 1]"
            )


def vllm_sampling_kwargs(
    sampling: SamplingParams, *, sample_seed: int | None, max_new_tokens: int | None = None
) -> dict[str, Any]:
    """Our SamplingParams as keyword arguments of one n=1 `vllm.SamplingParams`.

    max_new_tokens: a request's own limit (Request.max_new_tokens), overriding the call's.
    sample_seed None: drawn from the engine's global generator (not reproducible per sample).
    """
    return {
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # 0 disables top-k in vLLM as here
        "min_p": sampling.min_p,  # 0 disables min-p in vLLM as here
        # vLLM penalizes tokens of the prompt and the output, as the built-in engine does.
        "repetition_penalty": sampling.repetition_penalty,
        "max_tokens": max_new_tokens if max_new_tokens is not None else sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "seed": sample_seed,
        "logprobs": 0,  # the sampled token's logprob only
        "detokenize": False,
        "skip_special_tokens": False,
    }


def vllm_label_probe_kwargs(label_token_ids: Sequence[int]) -> dict[str, Any]:
    """A one-token vLLM request whose first-position logprobs are the labels' (module docstring):
    only the labels may be sampled, so the top len(labels) logprobs are exactly theirs."""
    return {
        "n": 1,
        "temperature": 1.0,  # the model's own distribution
        "max_tokens": 1,
        "allowed_token_ids": list(label_token_ids),
        "logprobs": len(label_token_ids),
        "detokenize": False,
        "skip_special_tokens": False,
    }


def label_logprobs_from_vllm(
    logprobs: Sequence[Any] | None, label_token_ids: Sequence[int]
) -> list[float] | None:
    """The labels' logprobs, in their order, from a probe's first {token_id: Logprob}."""
    if not logprobs or any(t not in logprobs[0] for t in label_token_ids):
        return None
    return [float(logprobs[0][t].logprob) for t in label_token_ids]


def vllm_prompt(request: Request) -> dict[str, Any]:
    """A `TokensPrompt` (a TypedDict, so a plain dict) with images as multi-modal data."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_ids)}
    if request.images:
        prompt["multi_modal_data"] = {"image": list(request.images)}
    return prompt


def sampled_logprobs(token_ids: Sequence[int], logprobs: Sequence[Any] | None) -> list[float]:
    """The sampled tokens' logprobs from vLLM's per-position {token_id: Logprob} entries."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; the request must set logprobs=0")
    return [float(entry[token].logprob) for token, entry in zip(token_ids, logprobs, strict=True)]


def finish_reason_of(vllm_reason: str | None) -> FinishReason:
    if vllm_reason in ("stop", "length", "abort"):
        return vllm_reason
    raise RuntimeError(f"vLLM finished a request with unknown reason {vllm_reason!r}")


@dataclass(frozen=True)
class _Call:
    """One generate/stream call, validated; its jobs are built once the TP group agreed."""

    requests: Sequence[Request]
    sampling: SamplingParams
    local_seed: int


class VLLMEngine(ThreadedAdapter):
    """RolloutEngine over an in-process `vllm.LLM` with sleep mode enabled.

    policy_tp_size: the policy's TP size, when the caller knows it: the engine's
        VLLMConfig.tensor_parallel_size must equal it (checked before anything loads).
    device_total_bytes: the GPU's memory, read at construction (None on a CPU-only host);
        `memory_need()` sizes the engine's pool from it.
    """

    _thread_name = "yatt-vllm"

    def __init__(
        self,
        model: str | Path,
        *,
        config: VLLMConfig | None = None,
        policy_tp_size: int | None = None,
    ) -> None:
        self.config = config = config if config is not None else VLLMConfig()
        tp_size = config.tensor_parallel_size
        check_engine_tp(
            "VLLMConfig.tensor_parallel_size",
            tp_size,
            model_dir=model,
            policy_tp_size=policy_tp_size,
        )
        if tp_size > 1 and not is_launched():
            raise ValueError(
                f"VLLMConfig.tensor_parallel_size={tp_size} runs vLLM under torchrun (its "
                "external launcher): launch with torchrun, or set it to 1"
            )
        mode = os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if mode != "0":
            raise ValueError(
                "VLLM_ENABLE_V1_MULTIPROCESSING is set to 1: the engine core would run in "
                "another process and weight buckets would be copied through a pipe; unset it"
            )
        if config.enable_lora:
            check_adapter_dir("VLLMConfig.lora_adapter_dir", config.lora_adapter_dir)
        # Lazy: an optional, GPU-only dependency; checked before any GPU memory is taken.
        vllm = require_engine("vllm", model)
        self._vllm = vllm
        self._model_dir = model
        self._group = create_engine_tp_group(tp_size)
        # Under torchrun every rank builds its engine; vLLM's external launcher then makes
        # blocks of tp_size ranks one model (the policy's TP groups), the rest its external DP.
        executor = {"distributed_executor_backend": "external_launcher"} if is_launched() else {}
        kwargs = {
            "model": str(model),
            "tensor_parallel_size": tp_size,
            "seed": config.seed,
            **executor,
            "enable_sleep_mode": True,
            "worker_extension_cls": WORKER_EXTENSION,
            "logprobs_mode": "processed_logprobs",
            "dtype": config.dtype,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "enforce_eager": config.enforce_eager,
            **({"max_model_len": config.max_model_len} if config.max_model_len else {}),
            **config.llm_kwargs,
        }
        if config.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=config.max_lora_rank, max_loras=1)
        self._llm = vllm.LLM(**kwargs)
        model_config = self._llm.llm_engine.model_config
        self.tokenizer = self._llm.get_tokenizer()
        self.max_seq_len = model_config.max_model_len
        self.vocab_size = model_config.get_vocab_size()
        self.is_multimodal = bool(getattr(model_config, "is_multimodal_model", False))
        self._lock = threading.Lock()
        self._abort_event = threading.Event()
        self._num_calls = 0
        # Distinguishes two engines' requests in logs; the group's first rank's, on every rank.
        self._engine_tag = self._group.broadcast(uuid.uuid4().hex[:6])
        self.device_total_bytes: int | None = (
            torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else None
        )
        self.serves_lora = config.enable_lora
        # The adapter every request with use_adapter=True runs with (None: none synced yet,
        # the base), its folder, and the versions synced (vLLM's adapter ids count from 1).
        self._lora: Any = None
        self._lora_folder: Path | None = None
        self._num_adapters = 0
        self._folders = AdapterFolders(config.lora_adapter_dir) if config.enable_lora else None

    @property
    def tp_group(self):
        """The ranks serving this engine (`_engine_tp.EngineTPGroup`)."""
        return self._group

    def memory_need(self) -> MemoryNeed | None:
        """This GPU's share (yatt.placement.MemoryNeed): the weights of one TP rank, the KV
        cache filling gpu_memory_utilization x the GPU's memory, and the CUDA graphs (an
        estimate; none with enforce_eager). None when the GPU or the checkpoint is unknown."""
        config = self.config
        weights = served_weight_bytes(
            self._model_dir, config.dtype, tp_size=config.tensor_parallel_size
        )
        if weights is None or self.device_total_bytes is None:
            return None
        return engine_memory_need(
            weight_bytes=weights,
            pool_fraction=config.gpu_memory_utilization,
            device_total_bytes=self.device_total_bytes,
            graph_bytes=0 if config.enforce_eager else CUDA_GRAPH_BYTES_ESTIMATE,
            settings={
                "weights": "VLLMConfig.tensor_parallel_size (more GPUs per engine)",
                "kv_cache": "VLLMConfig.gpu_memory_utilization (lower it)",
                "cuda_graph": "VLLMConfig.enforce_eager=True",
            },
        )

    @property
    def supports_label_logprobs(self) -> bool:
        """Completions carry `label_logprobs` (through one probe request per request)."""
        return True

    def abort(self) -> None:
        if self._lock.locked():
            self._abort_event.set()

    def _prepare(self, requests: Sequence[Request], sampling: SamplingParams) -> _Call:
        return _Call(requests, sampling, self._validate_and_seed(requests, sampling))

    def _jobs(self, call: _Call, seed: int) -> list[tuple]:
        requests, sampling = call.requests, call.sampling
        config = self.config
        output_kind = self._vllm.sampling_params.RequestOutputKind.DELTA
        jobs = []
        for i, request in enumerate(requests):
            for j in range(sampling.n):
                kwargs = vllm_sampling_kwargs(
                    sampling,
                    sample_seed=derive_key(seed, i, j) if config.seed_each_sample else None,
                    max_new_tokens=request.max_new_tokens,
                )
                params = self._vllm.SamplingParams(**kwargs, output_kind=output_kind)
                jobs.append((i, j, request, vllm_prompt(request), params))
            if sampling.label_token_ids:  # sample index -1: the request's label probe
                probe = vllm_label_probe_kwargs(sampling.label_token_ids)
                params = self._vllm.SamplingParams(**probe, output_kind=output_kind)
                jobs.append((i, -1, request, vllm_prompt(request), params))
        return jobs

    def _should_abort(self) -> bool:
        """An abort asked on any rank of the group, taken by all at the same step."""
        return self._group.any(self._abort_event.is_set())

    def _run(self, call: _Call, emit) -> None:
        with self._lock:
            # Collective (TP > 1): the group checks the call and takes its first rank's seed.
            self._abort_event.clear()
            seed = self._group.agree_on_call(call.requests, call.sampling, call.local_seed)
            jobs = self._jobs(call, seed)
            engine = self._llm.llm_engine
            # The same ids on every rank of a TP group (their engines schedule alike).
            self._num_calls += 1
            tag = f"{self._engine_tag}{self._num_calls}"
            pending: dict[str, tuple[int, int, Request, list[int], list[float]]] = {}
            labels = self._run_label_probes([job for job in jobs if job[1] < 0], tag)
            for i, j, request, prompt, params in jobs:
                if j < 0:
                    continue
                rid = f"yatt-{tag}-{i}-{j}"
                engine.add_request(rid, prompt, params, **self._lora_of(request))
                pending[rid] = (i, j, request, [], [])
            while pending:
                if self._should_abort():
                    engine.abort_request(list(pending))
                    for rid in list(pending):
                        emit(self._completion(pending.pop(rid), "abort"))
                    break
                for output in engine.step():
                    if output.request_id not in pending:
                        continue
                    sample = output.outputs[0]
                    entry = pending[output.request_id]
                    entry[3].extend(sample.token_ids)
                    entry[4].extend(sampled_logprobs(sample.token_ids, sample.logprobs))
                    if output.finished:
                        reason = finish_reason_of(sample.finish_reason)
                        completion = self._completion(pending.pop(output.request_id), reason)
                        if completion.response_ids:
                            completion.label_logprobs = labels.get(completion.request_index)
                        emit(completion)
            self._abort_event.clear()

    def _run_label_probes(self, probes: list[tuple], call: str) -> dict[int, list[float] | None]:
        """Each probe's label logprobs by request index, before the samples run (one token
        each; an abort leaves the rest None)."""
        engine = self._llm.llm_engine
        pending: dict[str, tuple[int, Sequence[int]]] = {}
        for i, _, request, prompt, params in probes:
            rid = f"yatt-{call}-{i}-labels"
            engine.add_request(rid, prompt, params, **self._lora_of(request))
            pending[rid] = (i, params.allowed_token_ids)
        found: dict[int, list[float] | None] = {}
        while pending and not self._should_abort():
            for output in engine.step():
                if output.request_id in pending and output.finished:
                    i, label_ids = pending.pop(output.request_id)
                    found[i] = label_logprobs_from_vllm(output.outputs[0].logprobs, label_ids)
        if pending:
            engine.abort_request(list(pending))
        return found

    def _lora_of(self, request: Request) -> dict[str, Any]:
        """add_request's lora_request for a request: the synced adapter, or None (the base);
        nothing when the engine serves no LoRA."""
        if not self.serves_lora:
            return {}
        return {"lora_request": self._lora if request.use_adapter else None}

    @staticmethod
    def _completion(entry: tuple, reason: FinishReason) -> Completion:
        i, j, request, tokens, logprobs = entry
        return Completion(
            request_index=i,
            sample_index=j,
            prompt_ids=list(request.prompt_ids),
            response_ids=list(tokens),
            logprobs=list(logprobs),
            finish_reason=reason,
            request_id=request_id_of(request, i),
            metadata=dict(request.metadata),
        )

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        """Load Hugging Face-named FULL tensors, bucket by bucket; every rank of a TP group
        passes the same names (its worker keeps its own shard). A bucket that failed on any rank
        raises on every rank (the group agrees after each bucket), so none rolls out on a
        partly old model while its peers wait. A LoRA adapter's tensors alone (the first one
        names it: "<m>.lora_A" ...) replace the served adapter instead (`_load_adapter`)."""
        is_adapter, named_tensors = peek_adapter_sync(named_tensors)
        if is_adapter and self.serves_lora:
            self._load_adapter(named_tensors)
            return
        with self._lock:
            synced = hashlib.sha256()  # names and shapes loaded, compared across the group
            for index, bucket in enumerate(iter_buckets(named_tensors, bucket_bytes=bucket_bytes)):
                refuse_adapter_tensors(bucket, "vLLM")
                synced.update(repr([(n, tuple(t.shape)) for n, t in bucket]).encode())
                error: BaseException | None = None
                try:
                    loaded = self._llm.collective_rpc("yatt_load_weights", args=(bucket,))
                except Exception as exc:  # raised below, once the group knows
                    loaded, error = None, exc
                # One count per worker; a worker that loaded fewer (or answered nothing) left
                # old weights behind.
                is_short = not loaded or any(count != len(bucket) for count in loaded)
                if self._group.any(is_short):
                    where = f"bucket {index} (from {bucket[0][0]!r})"
                    if error is not None:
                        raise RuntimeError(
                            f"vLLM failed to load {where}: {error!r}; the engine holds partly "
                            "old weights: do not roll out with it"
                        ) from error
                    raise RuntimeError(
                        f"vLLM workers loaded {loaded!r} of the {len(bucket)} tensors of "
                        f"{where}"
                        + ("" if is_short else " on this rank, but not on a TP peer")
                        + "; the engine holds partly old weights: do not roll out with it"
                    )
            differing = self._group.differing_ranks(synced.hexdigest())
            if differing:
                raise RuntimeError(
                    f"update_weights: ranks {differing} of this engine's TP group loaded other "
                    f"tensors (names or shapes) than rank {self._group.ranks[0]}; every rank "
                    "must pass the same full tensors: do not roll out with this engine"
                )
            # Cached prefixes hold keys/values computed with the old weights.
            self._reset_prefix_cache()

    def _load_adapter(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the served adapter: a PEFT folder on tmpfs (vLLM 0.26.0 loads an adapter
        from a path only), registered under a new name and id (vLLM keys its caches by them)
        after the old one is removed; later requests name the new one. Every rank of a TP group
        loads its own engine's copy and the group agrees on the outcome."""
        adapter = peft_adapter(pairs, "vLLM")
        check_served_modules(adapter, "vLLM", "vllm")
        if adapter.rank > self.config.max_lora_rank:
            raise ValueError(
                f"update_weights: the adapter's rank {adapter.rank} is over "
                f"VLLMConfig.max_lora_rank={self.config.max_lora_rank}; raise it"
            )
        lora_request_class = importlib.import_module("vllm.lora.request").LoRARequest
        engine = self._llm.llm_engine
        with self._lock:
            self._num_adapters += 1
            name = f"yatt-{self._engine_tag}-v{self._num_adapters}"
            old, old_folder = self._lora, self._lora_folder
            self._lora = self._lora_folder = None  # nothing named until the new one loaded
            error: BaseException | None = None
            try:
                folder = self._folders.write(adapter, name)
                request = lora_request_class(
                    lora_name=name, lora_int_id=self._num_adapters, lora_path=str(folder)
                )
                # The old one first: max_loras=1 holds one adapter on the GPU.
                if old is not None:
                    engine.remove_lora(old.lora_int_id)
                is_loaded = bool(engine.add_lora(request))
            except Exception as exc:  # raised below, once the group knows
                is_loaded, error = False, exc
            if old_folder is not None:
                self._folders.remove(old_folder)
            if self._group.any(not is_loaded):
                where = "on this rank" if not is_loaded else "on a TP peer"
                why = repr(error) if error is not None else "add_lora returned False"
                raise RuntimeError(
                    f"vLLM failed to load LoRA adapter {name!r} {where}: {why}; the engine "
                    "serves no adapter: do not roll out with it"
                ) from error
            self._lora, self._lora_folder = request, folder
            # Cached prefixes hold keys/values computed with the old adapter.
            self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        """reset_prefix_cache, tried again while vLLM refuses it; RuntimeError after the last."""
        for attempt in range(RESET_TRIES):
            if attempt:
                time.sleep(RESET_FIRST_WAIT_S * 2 ** (attempt - 1))
            # None: a version that reports nothing (0.26.0 returns a bool).
            if self._llm.reset_prefix_cache() is not False:
                return
        raise RuntimeError(
            f"vLLM reset_prefix_cache failed {RESET_TRIES} times (it refuses while KV blocks "
            "are still held; its log names how many); cached prefixes hold keys/values of the "
            "old weights: do not roll out with it"
        )

    def sleep(self) -> None:
        with self._lock:
            self._llm.sleep(level=self.config.sleep_level)

    def wake_up(self, tags: Sequence[str] | None = ("weights", "kv_cache")) -> None:
        names = ["weights", "kv_cache"] if tags is None else list(tags)
        if isinstance(tags, str) or any(t not in ("weights", "kv_cache") for t in names):
            raise ValueError(f"wake_up(tags={tags!r}): use a sequence of 'weights', 'kv_cache'")
        with self._lock:
            self._llm.wake_up(tags=[t for t in ("weights", "kv_cache") if t in names])
            if "kv_cache" in names:
                self._reset_prefix_cache()

    def close(self) -> None:
        self.abort()
        with self._lock:
            llm, self._llm = self._llm, None
            shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            if self._folders is not None:
                self._folders.close()
