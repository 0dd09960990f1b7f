"""Fakes of vLLM 0.26.0 and SGLang 0.5.17, as far as yatt's adapters use them (no GPU, no install).

    sys.modules.update(vllm_modules())      # or monkeypatch.setitem per name in a test
    sys.modules.update(sglang_modules())

They mirror the engines' public signatures and the behaviours the adapters must bridge:
- vLLM: `LLM(**kwargs)`; under `distributed_executor_backend="external_launcher"` (its torchrun
  mode) it needs VLLM_ENABLE_V1_MULTIPROCESSING=0 and RANK/LOCAL_RANK, lays out the world as
  (external DP, TP) with TP the fast dimension, and every rank of a TP group must run the same
  schedule: each `step()` all-gathers the batch over the group and fails when the ranks
  differ (a real engine's forward would hang or mix ranks' tensors). Without it, one GPU only.
  `LLMEngine.add_request/step/abort_request` emit one token per step (id prompt[0] + step) as
  DELTA outputs; `collective_rpc("yatt_load_weights")` keeps this rank's slice (dim 0) of each
  full tensor, as vLLM's column-parallel weight loaders do.
- SGLang: `Engine(**kwargs)` with `tp_size` TP workers (in-process here; SGLang starts one
  process per GPU from `base_gpu_id`), `async_generate`, `update_weights_from_tensor` whose
  worker r unwraps `LocalSerializedTensor.values[r]`, the memory-saver calls, flush_cache.
  `MultiprocessingSerializer` pickles the tensor here (the real one sends a CUDA IPC handle).
- LoRA (both): vLLM's LoRARequest / LLMEngine.add_lora / remove_lora (an adapter read from its
  PEFT folder, a rank over max_lora_rank refused, max_loras adapters held) and add_request's
  lora_request; SGLang's Engine.load_lora_adapter_from_tensors / load_lora_adapter /
  unload_lora_adapter (LoadLoRAAdapterReqOutput-like answers) and async_generate's lora_path
  (a name not loaded is refused, as SGLang's tokenizer manager does).
Each fake records what it was asked (`calls`, `seen_seeds`, `worker_weights`, `seen_loras`,
`loras`) for the tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

VLLM_VERSION = "0.26.0"
SGLANG_VERSION = "0.5.17"
# What the fakes' model registries list (both engines serve these families).
SUPPORTED_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2VLForConditionalGeneration"}
)


def _tp_blocks(tp_size: int) -> tuple[int, Any]:
    """(this rank's TP rank, its gloo group) with TP the fast dimension; collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, tp_size):
        group = dist.new_group(list(range(start, start + tp_size)), backend="gloo")
        if start <= rank < start + tp_size:
            mine = group
    return rank % tp_size, mine


def _shard(tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a full tensor along dim 0 (replicated if it does not split)."""
    if tp_size == 1 or tensor.dim() == 0 or tensor.shape[0] % tp_size:
        return tensor.clone()
    return tensor.chunk(tp_size, dim=0)[tp_rank].clone()


# -- vLLM 0.26.0 ------------------------------------------------------------------------------


@dataclass
class VLLMLogprob:
    logprob: float


@dataclass
class VLLMCompletionOutput:
    token_ids: list
    logprobs: list
    finish_reason: str | None


@dataclass
class VLLMRequestOutput:
    request_id: str
    outputs: list
    finished: bool


@dataclass
class FakeLLMEngine:
    """vllm.v1.engine.llm_engine.LLMEngine: one token per request and step, as a DELTA."""

    tp_group: Any = None
    generator: torch.Generator | None = None
    requests: dict = field(default_factory=dict)
    aborted: list = field(default_factory=list)
    seen_seeds: dict = field(default_factory=dict)  # request id -> seed (None: global draw)
    global_draws: list = field(default_factory=list)  # the engine generator's draws
    num_steps: int = 0
    lora_config: dict | None = None  # enable_lora's max_lora_rank and max_loras; None: off
    loras: dict = field(default_factory=dict)  # lora_int_id -> (request, {name: tensor}, config)
    seen_loras: dict = field(default_factory=dict)  # request id -> its LoRARequest (or None)
    lazy_loads: list = field(default_factory=list)  # adapters a request loaded from their path

    # vllm/v1/engine/llm_engine.py (0.26.0): add_request(request_id, prompt, params,
    # arrival_time=None, lora_request=None, ...); the tail (tokenization_kwargs, trace_headers,
    # priority) is not used by yatt.
    def add_request(self, rid, prompt, params, arrival_time=None, lora_request=None, **kwargs):
        if lora_request is not None and lora_request.lora_int_id not in self.loras:
            # The worker loads an adapter it does not hold from its path (an LRU cache miss).
            self.lazy_loads.append(lora_request.lora_name)
            self.add_lora(lora_request)
        self.seen_loras[rid] = lora_request
        self.requests[rid] = {"prompt": prompt, "params": params, "n": 0}
        seed = getattr(params, "seed", None)
        self.seen_seeds[rid] = seed
        if seed is None and self.generator is not None:  # vLLM's global sampler generator
            draw = int(torch.randint(0, 1 << 30, (1,), generator=self.generator))
            self.global_draws.append(draw)

    def _check_lockstep(self) -> None:
        if self.tp_group is None:
            return
        batch = sorted((rid, r["n"]) for rid, r in self.requests.items())
        size = dist.get_world_size(self.tp_group)
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, batch, group=self.tp_group)
        if any(other != gathered[0] for other in gathered):
            raise AssertionError(
                f"TP ranks stepped different batches at step {self.num_steps}: {gathered}"
            )

    def step(self):
        self._check_lockstep()
        self.num_steps += 1
        out = []
        for rid, r in list(self.requests.items()):
            allowed = getattr(r["params"], "allowed_token_ids", None)
            if allowed is not None:  # a label probe: one token, every allowed id's logprob
                lp = [{t: VLLMLogprob(-t / 10) for t in allowed}]
                out.append(
                    VLLMRequestOutput(rid, [VLLMCompletionOutput([allowed[0]], lp, "length")], True)
                )
                del self.requests[rid]
                continue
            token = r["prompt"]["prompt_token_ids"][0] + r["n"]
            r["n"] += 1
            stop = token in r["params"].stop_token_ids
            done = stop or r["n"] >= r["params"].max_tokens
            reason = ("stop" if stop else "length") if done else None
            lp = [{token: VLLMLogprob(-0.5 - r["n"])}]
            out.append(VLLMRequestOutput(rid, [VLLMCompletionOutput([token], lp, reason)], done))
            if done:
                del self.requests[rid]
        return out

    def abort_request(self, rids):
        self.aborted += rids
        for rid in rids:
            self.requests.pop(rid, None)

    # LLMEngine.add_lora(lora_request) -> bool / remove_lora(lora_id) -> bool / list_loras().
    def add_lora(self, lora_request) -> bool:
        if self.lora_config is None:
            raise ValueError("LoRA is not enabled (LLM(enable_lora=True))")
        if lora_request.lora_int_id in self.loras:
            return False  # already loaded: vLLM only touches its cache entry
        from safetensors.torch import load_file

        # LoRAModel.from_local_checkpoint: adapter_config.json and adapter_model.safetensors.
        folder = lora_request.lora_path
        config = json.loads(Path(folder, "adapter_config.json").read_text())
        tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
        if config["r"] > self.lora_config["max_lora_rank"]:
            raise ValueError(
                f"LoRA rank {config['r']} is greater than max_lora_rank "
                f"{self.lora_config['max_lora_rank']}."
            )
        if len(self.loras) >= self.lora_config["max_loras"]:  # LRU: the oldest is evicted
            del self.loras[next(iter(self.loras))]
        self.loras[lora_request.lora_int_id] = (lora_request, tensors, config)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.loras.pop(lora_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.loras)


class FakeLLM:
    """vllm.LLM: the uniprocess executor (one GPU), or the external launcher under torchrun."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.tp_size = tp_size = kwargs.get("tensor_parallel_size", 1)
        tp_group = None
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            # ExecutorWithExternalLauncher: deterministic in-process engine core, env:// ranks.
            assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "multiprocessing"
            rank, _ = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
            world = dist.get_world_size() if dist.is_initialized() else 1
            assert world % tp_size == 0, f"world {world} is not a multiple of TP {tp_size}"
            self.tp_rank = rank % tp_size
            if tp_size > 1:
                self.tp_rank, tp_group = _tp_blocks(tp_size)
        else:
            assert tp_size == 1, "tensor parallelism needs an executor backend"
            self.tp_rank = 0
        generator = torch.Generator().manual_seed(kwargs.get("seed") or 0)
        self.llm_engine = FakeLLMEngine(tp_group=tp_group, generator=generator)
        if kwargs.get("enable_lora"):
            # vllm/config/lora.py (0.26.0): max_lora_rank in a closed set, max_loras >= 1.
            rank = kwargs.get("max_lora_rank", 16)
            assert rank in (1, 8, 16, 32, 64, 128, 256, 320, 512), f"max_lora_rank {rank}"
            self.llm_engine.lora_config = {
                "max_lora_rank": rank,
                "max_loras": kwargs.get("max_loras", 1),
            }
        self.llm_engine.model_config = types.SimpleNamespace(
            max_model_len=64, get_vocab_size=lambda: 100, is_multimodal_model=False
        )
        self.calls = []
        self.rpc_results = []  # queued answers of collective_rpc (then: all loaded)
        self.reset_results = []  # queued answers of reset_prefix_cache (then: True)
        self.worker_weights: dict[str, torch.Tensor] = {}  # this rank's worker's shards

    def get_tokenizer(self):
        return "tok"

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, [n for n, _ in args[0]]))
        if self.rpc_results:
            return self.rpc_results.pop(0)
        # The worker extension's yatt_load_weights: each layer keeps its slice; one answer per
        # worker of this process (one under the external launcher).
        for name, tensor in args[0]:
            self.worker_weights[name] = _shard(tensor, self.tp_rank, self.tp_size)
        return [len(args[0])]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache",))
        # False while KV blocks are still held (vLLM 0.26.0 BlockPool.reset_prefix_cache).
        return self.reset_results.pop(0) if self.reset_results else True

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


class FakeVLLMSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


@dataclass
class FakeLoRARequest:
    """vllm.lora.request.LoRARequest (0.26.0; a msgspec Struct there): an adapter by path."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        assert self.lora_path, "lora_path cannot be empty"


def vllm_modules() -> dict[str, types.ModuleType]:
    """The fake `vllm` modules, by name, for sys.modules."""
    module = types.ModuleType("vllm")
    module.__version__ = VLLM_VERSION
    module.LLM = FakeLLM
    module.SamplingParams = FakeVLLMSamplingParams
    module.ModelRegistry = types.SimpleNamespace(
        get_supported_archs=lambda: set(SUPPORTED_ARCHITECTURES)
    )
    module.sampling_params = types.SimpleNamespace(
        RequestOutputKind=types.SimpleNamespace(DELTA="delta")
    )
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest
    return {"vllm": module, "vllm.lora": lora, "vllm.lora.request": request}


# -- SGLang 0.5.17 ----------------------------------------------------------------------------


class MultiprocessingSerializer:
    """sglang.srt.utils.MultiprocessingSerializer (the real one: a CUDA IPC handle)."""

    @staticmethod
    def serialize(obj, output_str: bool = False):
        return pickle.dumps(obj)

    @staticmethod
    def deserialize(data):
        return pickle.loads(data)


@dataclass
class LocalSerializedTensor:
    """sglang.srt.model_executor.model_runner_components.weight_updater.LocalSerializedTensor
    (0.5.17): values[r] is TP rank r's."""

    values: list

    def get(self, rank: int):
        return MultiprocessingSerializer.deserialize(self.values[rank])


class FakeTokenizerManager:
    def __init__(self):
        self.tokenizer = "tok"
        self.context_len = 32
        self.model_config = types.SimpleNamespace(vocab_size=100, is_multimodal=False)
        self.aborted = []

    def abort_request(self, rid="", abort_all=False):
        self.aborted.append(abort_all)


class FakeSGLEngine:
    """sglang.Engine: emits tokens 0, 1, 2, ... (a stop token ends it unless ignore_eos)."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.tp_size = kwargs.get("tp_size", 1)
        self.tokenizer_manager = FakeTokenizerManager()
        if kwargs.get("context_length"):
            self.tokenizer_manager.context_len = kwargs["context_length"]
        self.max_req_len = self.tokenizer_manager.context_len - 1  # TpWorker
        self.loop = asyncio.new_event_loop()
        self.calls = []
        self.seen_params = []
        self.update_results = []  # queued answers of update_weights_from_tensor
        self.flush_results = []  # queued answers of flush_cache
        self.generate_error: Exception | None = None  # raised by the next async_generate
        # TP worker r's shards (SGLang: one scheduler process per GPU of the group).
        self.worker_weights: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp_size)]
        self.loras: dict[str, tuple[dict, dict]] = {}  # name -> (tensors, config), per engine
        self.seen_loras: list = []  # each request's lora_path

    async def async_generate(
        self, prompt=None, sampling_params=None, input_ids=None, image_data=None,
        return_logprob=False, lora_path=None, **kwargs,
    ):  # fmt: skip
        await asyncio.sleep(0.001 * input_ids[0])
        if self.generate_error is not None:
            raise self.generate_error
        if lora_path is not None and lora_path not in self.loras:
            # TokenizerManager: a request naming an adapter that is not loaded is refused.
            raise ValueError(f"The following requested LoRA adapters are not loaded: {lora_path}")
        self.seen_loras.append(lora_path)
        self.seen_params.append(sampling_params)
        n = sampling_params["max_new_tokens"]
        context = self.tokenizer_manager.context_len
        if len(input_ids) + n > context:  # TokenizerManager._validate_one_request
            raise ValueError("Requested token count exceeds the model's maximum context length")
        if len(input_ids) > self.max_req_len - 5:  # TpWorker's max_req_input_len
            raise ValueError("Input length exceeds the maximum allowed length")
        n = min(n, self.max_req_len - len(input_ids) - 1)  # Scheduler
        tokens, reason = list(range(n)), "length"
        stops = sampling_params.get("stop_token_ids") or []
        if not sampling_params.get("ignore_eos"):  # Req._check_token_based_finish
            cut = next((i for i, t in enumerate(tokens) if t in stops), None)
            if cut is not None:
                tokens, reason = tokens[: cut + 1], "stop"
        meta = {
            "output_token_logprobs": [(-1.0, t, None) for t in tokens],
            "finish_reason": {"type": reason},
        }
        if kwargs.get("token_ids_logprob"):  # asked ids, listed in reverse: mapped by id
            ids = kwargs["token_ids_logprob"]
            meta["output_token_ids_logprobs"] = [
                [[-t / 10, t, None] for t in reversed(ids)] for _ in tokens
            ]
        return {"output_ids": tokens, "meta_info": meta}

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", [n for n, _ in named_tensors], flush_cache))
        # (success, message), as TokenizerManager.update_weights_from_tensor returns.
        if self.update_results:
            return self.update_results.pop(0)
        # ModelRunner.update_weights_from_tensor on each TP worker: _unwrap_tensor(tp_rank).
        for tp_rank, weights in enumerate(self.worker_weights):
            for name, tensor in named_tensors:
                if isinstance(tensor, LocalSerializedTensor):
                    tensor = tensor.get(tp_rank)
                weights[name] = _shard(tensor, tp_rank, self.tp_size)
        return True, "Succeeded to update model weights."

    # sglang/srt/entrypoints/engine.py: load_lora_adapter_from_tensors(lora_name, tensors,
    # config_dict), load_lora_adapter(lora_name, lora_path, pinned=False),
    # unload_lora_adapter(lora_name); each answers a LoadLoRAAdapterReqOutput /
    # UnloadLoRAAdapterReqOutput (success, error_message, loaded_adapters).
    def _lora_answer(self, success: bool, error_message: str = ""):
        return types.SimpleNamespace(
            success=success, error_message=error_message, loaded_adapters=dict(self.loras)
        )

    def _add_lora(self, name: str, tensors: dict, config: dict):
        if not self.kwargs.get("enable_lora"):
            return self._lora_answer(False, "LoRA is not enabled. Please set `--enable-lora`")
        if name in self.loras:
            return self._lora_answer(False, f"LoRA adapter {name} is already loaded")
        if config["r"] > self.kwargs["max_lora_rank"]:
            return self._lora_answer(
                False,
                f"LoRA rank {config['r']} exceeds max_lora_rank {self.kwargs['max_lora_rank']}",
            )
        # Every TP worker copies the tensors to host (LoRAAdapter._process_weight: .cpu()).
        self.loras[name] = ({k: t.cpu().clone() for k, t in tensors.items()}, dict(config))
        return self._lora_answer(True)

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict):
        self.calls.append(("load_lora_from_tensors", lora_name))
        # The real one serializes `tensors` (MultiprocessingSerializer) for the workers.
        tensors = MultiprocessingSerializer.deserialize(
            MultiprocessingSerializer.serialize(tensors)
        )
        return self._add_lora(lora_name, dict(tensors), config_dict)

    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        from safetensors.torch import load_file

        self.calls.append(("load_lora", lora_name, lora_path))
        config = json.loads(Path(lora_path, "adapter_config.json").read_text())
        tensors = load_file(os.path.join(lora_path, "adapter_model.safetensors"))
        return self._add_lora(lora_name, tensors, config)

    def unload_lora_adapter(self, lora_name):
        self.calls.append(("unload_lora", lora_name))
        if self.loras.pop(lora_name, None) is None:
            return self._lora_answer(False, f"LoRA adapter {lora_name} is not loaded")
        return self._lora_answer(True)

    def flush_cache(self):
        self.calls.append(("flush",))
        # A FlushCacheReqOutput; refused (success=False) while requests are pending.
        if self.flush_results:
            return self.flush_results.pop(0)
        return types.SimpleNamespace(success=True, message="")

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release",))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def shutdown(self):
        self.loop.close()


def sglang_modules() -> dict[str, types.ModuleType]:
    """The fake `sglang` modules the adapter imports, by name, for sys.modules."""
    module = types.ModuleType("sglang")
    module.__version__ = SGLANG_VERSION
    module.Engine = FakeSGLEngine
    srt = types.ModuleType("sglang.srt")
    srt.constants = types.SimpleNamespace(GPU_MEMORY_TYPE_CUDA_GRAPH="cuda_graph")
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = MultiprocessingSerializer
    executor = types.ModuleType("sglang.srt.model_executor")
    # 0.5.17 keeps the handle in model_runner_components.weight_updater (not model_runner).
    components = types.ModuleType("sglang.srt.model_executor.model_runner_components")
    updater = types.ModuleType("sglang.srt.model_executor.model_runner_components.weight_updater")
    updater.LocalSerializedTensor = LocalSerializedTensor
    models = types.ModuleType("sglang.srt.models")
    registry = types.ModuleType("sglang.srt.models.registry")
    registry.ModelRegistry = types.SimpleNamespace(
        get_supported_archs=lambda: set(SUPPORTED_ARCHITECTURES)
    )
    return {
        "sglang.srt.models": models,
        "sglang.srt.models.registry": registry,
        "sglang": module,
        "sglang.srt": srt,
        "sglang.srt.utils": utils,
        "sglang.srt.model_executor": executor,
        "sglang.srt.model_executor.model_runner_components": components,
        "sglang.srt.model_executor.model_runner_components.weight_updater": updater,
    }
