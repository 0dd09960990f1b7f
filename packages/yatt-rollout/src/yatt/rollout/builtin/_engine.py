"""The built-in rollout engine: any Hugging Face causal LM, on CPU or CUDA, no extra install.

It serves one device (one GPU): a model sharded over GPUs (engine tensor parallelism) is vLLM's
or SGLang's job (issue #30); several GPUs run one engine each.

Each decode step runs only the running sequences, in the smallest batch bucket that holds them
(EngineConfig.decode_batch_buckets), so its cost follows the number of active sequences.

Memory lives in two placement regions, so `sleep()` gives it back on CUDA:
  "<prefix>/weights"  parameters and buffers (CPU backup: restored on wake-up; without it,
                      should_back_up_weights=False, refilled by update_weights after each wake)
  "<prefix>/kv_cache" the static KV cache and per-slot state (contents dropped on sleep)
CUDA graphs are freed on sleep and recaptured on the next call (EngineConfig.keep_graphs_asleep).

As a placement role it declares memory_tags ("weights", "kv_cache"), so a plan's weight-sync
phase wakes the weights alone, and set_memory_fraction(f) resizes the KV cache (number of slots)
at its next allocation: the next wake_up of "kv_cache", or the start of the next generate/stream.

Concurrency: on CUDA the engine's device work runs on its own stream (_device.py), so engines
sharing a GPU overlap; a call that samples like the running one joins its loop (_joining.py).

Multi-turn conversations (Request.session_id): a finished sample's KV stays in its slot, and
the session's next turn prefills only its new tokens (tool results, the template's tokens)
against it (_host_loop.py says when a kept slot is freed; release_sessions ends one).

A Qwen2-VL-family model takes Request.images: they go through its image processor and the
vision tower in the prefill, and decoding stays text-only (_vision.py).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
)

from yatt.placement import (
    HostNeed,
    backup_bytes,
    empty_cache,
    is_paused,
    may_sync,
    pause,
    region,
    region_tags,
    release,
    resume,
)
from yatt.rollout._keys import derive_key
from yatt.rollout._requests import max_new_tokens_of, request_id_of, validate_requests
from yatt.rollout._streaming import stream_from_thread
from yatt.rollout._types import DEFAULT_BUCKET_BYTES, Completion, Request, SamplingParams
from yatt.rollout._weights import (
    copy_bucket,
    iter_buckets,
    move_into_current_region,
    named_targets,
)
from yatt.rollout.builtin._adapter_binding import AdapterBinding
from yatt.rollout.builtin._base_view import BaseModelView
from yatt.rollout.builtin._batcher import MAX_LABEL_TOKENS, SlotRunner, WorkItem
from yatt.rollout.builtin._config import EngineConfig
from yatt.rollout.builtin._device import EngineDevice
from yatt.rollout.builtin._fused_projections import fuse_projections
from yatt.rollout.builtin._host_loop import Call, SlotLoop
from yatt.rollout.builtin._joining import CallScheduler
from yatt.rollout.builtin._kv_budget import KVLayout, check_memory_fraction, slots_for_fraction
from yatt.rollout.builtin._layer_compile import bind_layer_caches
from yatt.rollout.builtin._lora import AdapterMerger
from yatt.rollout.builtin._lora_beside import LowRankBeside
from yatt.rollout.builtin._static_kv import ATTN_IMPLEMENTATION, StaticKVCache, register_attention
from yatt.rollout.builtin._vision import VisionPrefill, is_vision_language_config

logger = logging.getLogger(__name__)

_TAGS = ("weights", "kv_cache")


class BuiltinEngine:
    """Batched generation with a static KV cache, continuous batching and on-device sampling.

    model: a local directory holding a Hugging Face causal LM (and usually its tokenizer), or a
        model object, which the engine takes over (its tensors move into the engine's regions
        and its attention implementation is switched). A Qwen2-VL-family model also takes images.
    image_processor: a vision-language model's image processor (default: the one saved in the
        model directory, preprocessor_config.json).
    should_back_up_weights: keep the weights in (pinned) host memory while asleep (default).
        False for a rollout engine whose weights the trainer's weight sync overwrites after
        every wake: its host copy (15 GB at 7B) is never read. Not for a step with several
        rollout phases (dynamic-sampling rounds under full colocation wake it again before any
        sync): generation refuses to run after a wake of the weights until update_weights has
        refilled them.
    """

    memory_tags: tuple[str, ...] = _TAGS
    # A new memory share resizes the KV cache at the next call, awake or not (placement's
    # offload="auto" need not put the engine to sleep for it).
    resizes_while_awake = True

    def __init__(
        self,
        model: str | Path | PreTrainedModel,
        *,
        config: EngineConfig | None = None,
        tokenizer: Any = None,
        image_processor: Any = None,
        should_back_up_weights: bool = True,
    ) -> None:
        self.config = config = config if config is not None else EngineConfig()
        register_attention()
        self._device = torch.device(config.device)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._dev = EngineDevice(self._device, priority=self.config.stream_priority)
        self._tags = {name: f"{config.region_prefix}/{name}" for name in _TAGS}
        if isinstance(model, (str, Path)):
            path = Path(model)
            if not (path / "config.json").is_file():
                raise ValueError(
                    f"model={str(model)!r} is not a directory with a config.json; pass a local "
                    "Hugging Face model directory or a PreTrainedModel"
                )
            if tokenizer is None and any(path.glob("tokenizer*")):
                tokenizer = AutoTokenizer.from_pretrained(path)
            # transformers maps Qwen2-VL to its image-text-to-text class only.
            is_vision = is_vision_language_config(AutoConfig.from_pretrained(path))
            if is_vision and image_processor is None:
                image_processor = VisionPrefill.load_image_processor(path)
            auto = AutoModelForImageTextToText if is_vision else AutoModelForCausalLM
            model = auto.from_pretrained(
                path, dtype=config.torch_dtype, attn_implementation=ATTN_IMPLEMENTATION
            )
        elif isinstance(model, PreTrainedModel):
            if config.dtype != "auto":
                model.to(config.torch_dtype)
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        else:
            raise ValueError(
                f"model={model!r}: pass a local model directory or a transformers PreTrainedModel"
            )
        self.tokenizer = tokenizer
        self.model = model.eval().requires_grad_(False)
        # The vision side of a vision-language model (None: text only, images refused).
        self._vision = (
            VisionPrefill(model, image_processor)
            if is_vision_language_config(model.config)
            else None
        )
        text_config = model.config.get_text_config()
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = _eos_ids(model)
        self._should_back_up_weights = should_back_up_weights
        self._are_weights_lost = False  # woken without backup, not refilled yet
        self._weights_version = 0  # update_weights calls so far (a binding's staleness)
        self._adapter = AdapterMerger()  # a LoRA adapter synced alone is merged in (_lora.py)
        # The engine's device selected first: a memory region (and its byte count) belongs to
        # the current device, which is the trainer's when the engine has a GPU of its own
        # (the reference trainer's placement=separate).
        weights_region = region(self._tags["weights"], enable_cpu_backup=should_back_up_weights)
        with self._dev.selected(), weights_region:
            self._weight_bytes = move_into_current_region(model, self._device)
            if config.fuse_projections:  # the fused weights belong to the region too
                fuse_projections(model)
        # Buffers (RoPE's inv_freq) are not in a weight sync: without the region's backup they
        # are restored from these host copies (a few KB) at each wake.
        self._buffer_copies = (
            []
            if should_back_up_weights
            else [(b, b.detach().to("cpu", copy=True)) for b in model.buffers()]
        )
        # lora_mode="beside": the adapter beside the base GEMMs, gated per row (_lora_beside.py).
        self._low_rank = None
        if config.lora_mode == "beside":
            if self._vision is not None:
                raise ValueError(
                    "EngineConfig.lora_mode='beside' with a vision-language model: the per-row "
                    "adapter gate does not cover the vision tower; use lora_mode='merge'"
                )
            self._low_rank = LowRankBeside(
                model,
                max_rows=config.max_batch_size,
                dtype=next(model.parameters()).dtype,
                device=self._device,
            )
            if config.max_lora_rank is not None or config.lora_modules_to_save:
                # Buffers and hooks before the first compile (EngineConfig.max_lora_rank,
                # lora_modules_to_save), in the weights' region like those a first sync makes.
                reserved_region = region(
                    self._tags["weights"], enable_cpu_backup=should_back_up_weights
                )
                with self._dev.selected(), reserved_region:
                    if config.max_lora_rank is not None:
                        self._low_rank.reserve(config.max_lora_rank, config.lora_target_modules)
                    if config.lora_modules_to_save:
                        self._low_rank.reserve_saved(config.lora_modules_to_save)
        num_heads = text_config.num_attention_heads
        self._kv_layout = KVLayout(
            num_layers=text_config.num_hidden_layers,
            num_kv_heads=getattr(text_config, "num_key_value_heads", None) or num_heads,
            max_seq_len=config.max_seq_len,
            head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads,
            dtype=next(model.parameters()).dtype,
        )
        # Slots the next KV-cache allocation should have; set_memory_fraction changes it from any
        # thread, the allocation happens while the engine is held, between loops.
        self._target_num_slots = config.max_batch_size
        self._allocate_kv_cache(config.max_batch_size)
        # One loop (shared by joined calls) or one update/sleep/wake-up at a time.
        self._scheduler = CallScheduler(should_join=config.should_join_calls)
        self._abort_event = threading.Event()
        self._is_running = False
        self._is_closed = False
        # Conversations kept between turns (Request.session_id): a kept KV unused this long is
        # freed (a tool that timed out, a trajectory that ended without release_sessions).
        self.kept_kv_ttl_s = 60.0
        self._released_sessions: set[str] = set()
        self._released_lock = threading.Lock()

    # -- generation -------------------------------------------------------------------------------

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Completion]:
        """All completions, ordered by (request_index, sample_index)."""
        items = self._work_items(requests, sampling)
        completions: list[Completion] = []
        self._run(items, sampling, completions.append)
        return sorted(completions, key=lambda c: (c.request_index, c.sample_index))

    def stream(
        self, requests: Sequence[Request], sampling: SamplingParams
    ) -> AsyncIterator[Completion]:
        """Each completion as it finishes; input is checked now, generation runs in a thread."""
        items = self._work_items(requests, sampling)
        # Closing the stream early cancels this call only (even while it waits for the engine);
        # the engine-wide abort() could hit another caller's generation.
        cancelled = threading.Event()

        def cancel() -> None:
            cancelled.set()
            self._scheduler.wake_waiters()

        return stream_from_thread(
            lambda emit: self._run(items, sampling, emit, cancelled=cancelled),
            abort=cancel,
            name="yatt-rollout-engine",
        )

    def abort(self) -> None:
        """Finish in-flight samples now (partial output) and queued ones empty, as "abort".

        Every call sharing the running loop (joined ones too) is aborted.
        """
        if self._is_running:
            self._abort_event.set()

    def release_sessions(self, session_ids: Iterable[str]) -> None:
        """Free the KV kept for these sessions (Request.session_id): their conversations ended.

        Takes effect at the engine loop's next host check; a kept KV is also freed when its
        slot is needed, after `kept_kv_ttl_s` unused, and by sleep or a KV-cache resize."""
        with self._released_lock:
            self._released_sessions.update(session_ids)

    @property
    def num_kept_sessions(self) -> int:
        """Conversations whose KV the engine keeps between turns now (a diagnostic)."""
        return len(self._runner.kept)

    @property
    def accepts_images(self) -> bool:
        """Whether the served model takes Request.images (a Qwen2-VL-family model)."""
        return self._vision is not None

    @property
    def supports_label_logprobs(self) -> bool:
        """Completions carry `label_logprobs` when SamplingParams.label_token_ids asks."""
        return True

    @property
    def num_joined_calls(self) -> int:
        """Calls so far that joined an already running loop instead of waiting for it."""
        return self._scheduler.num_joined_calls

    def _work_items(self, requests: Sequence[Request], sampling: SamplingParams) -> list[WorkItem]:
        self._check_open()
        validate_requests(
            requests,
            sampling,
            vocab_size=self.vocab_size,
            max_seq_len=self.config.max_seq_len,
            accepts_images=self.accepts_images,
            accepts_adapter_off=self._low_rank is not None,
        )
        labels = sampling.label_token_ids
        if len(labels) > MAX_LABEL_TOKENS or any(t >= self.vocab_size for t in labels):
            raise ValueError(
                f"SamplingParams.label_token_ids={labels!r}: the built-in engine takes at most "
                f"{MAX_LABEL_TOKENS} ids, each below the vocabulary size {self.vocab_size}"
            )
        # Each request's images through the image processor once (its n samples share them),
        # unless they came processed (Request.image_inputs).
        images = [
            self._vision.encode(i, request.prompt_ids, request.images, request.image_inputs)
            if self._vision is not None
            else None
            for i, request in enumerate(requests)
        ]
        # No seed: a fresh one per call, so repeated calls give fresh samples.
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        return [
            WorkItem(
                request_index=i,
                sample_index=j,
                request=request,
                request_id=request_id_of(request, i),
                key=derive_key(seed, i, j),
                max_new_tokens=max_new_tokens_of(request, sampling),
                images=images[i],
                label_token_ids=sampling.label_token_ids,
                use_adapter=request.use_adapter,
            )
            for i, request in enumerate(requests)
            for j in range(sampling.n)
        ]

    def _run(
        self,
        items: list[WorkItem],
        sampling: SamplingParams,
        emit,
        cancelled: threading.Event | None = None,
    ) -> None:
        stop_ids = list(dict.fromkeys(sampling.stop_token_ids))
        if not sampling.ignore_eos:
            stop_ids += [t for t in self.eos_token_ids if t not in stop_ids]
        call = Call(items=items, emit=emit, cancelled=cancelled or threading.Event())
        # What the runner sets once per loop; n, seed and max_new_tokens are per sample.
        signature = (
            sampling.temperature,
            sampling.top_p,
            sampling.top_k,
            sampling.min_p,
            sampling.repetition_penalty,
            frozenset(stop_ids),
        )

        def begin() -> SlotLoop:  # the engine is ours, inside its device scope
            self._check_open()
            self._check_awake()
            self._resize_kv_cache_if_asked()
            self._abort_event.clear()
            self._is_running = True
            flags = self._runner.begin(sampling, stop_ids)
            return SlotLoop(
                self._runner,
                flags=flags,
                stop_ids=stop_ids,
                abort=self._abort_event,
                kept_ttl_s=self.kept_kv_ttl_s,
                released=self._released_sessions,
                lock=self._released_lock,
            )

        self._scheduler.run(
            call, signature=signature, begin=begin, scope=self._dev.scope, end=self._end_loop
        )

    def _end_loop(self) -> None:
        # The loop's last work must be done before anything frees, pauses or resizes memory.
        self._dev.synchronize()
        self._is_running = False
        self._abort_event.clear()

    # -- weights and memory -----------------------------------------------------------------------

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        """Copy (Hugging Face name, tensor) pairs into the served weights, bucket by bucket.

        Copies are in place, so CUDA graphs stay valid. After each bucket the device is
        synchronised, so the sender may free or reuse that bucket's tensors. A LoRA adapter
        sent alone ("<m>.lora_A", "<m>.lora_B", "<m>.lora_scaling" per module, as
        TorchPolicy.named_adapter_weights() yields) is merged into "<m>.weight", replacing
        the adapter merged before (builtin/_lora.py), or with EngineConfig.lora_mode="beside"
        kept beside the untouched base (builtin/_lora_beside.py).
        """
        self._check_open()
        with self._scheduler.exclusive():
            self._update_weights_held(named_tensors, bucket_bytes)

    def _update_weights_held(self, named_tensors, bucket_bytes: int) -> None:
        """update_weights' work, the engine held by the caller."""
        if is_paused(self._tags["weights"]):
            raise RuntimeError(
                "update_weights while the weights are asleep; call wake_up(tags=('weights',)) first"
            )
        # KV kept between turns was computed with the old weights: drop it.
        self._runner.kept.clear()
        self._weights_version += 1  # adapters bound before are stale (bind_adapter)
        targets = named_targets(self.model)
        if self._low_rank is not None:
            self._update_beside(targets, named_tensors, bucket_bytes)
            return
        adapter = self._adapter.begin(targets, are_weights_lost=self._are_weights_lost)
        with self._dev.selected():  # the caller's stream: the sender's tensors live there
            for bucket in iter_buckets(named_tensors, bucket_bytes=bucket_bytes):
                adapter.copy_bucket(bucket)  # copy_bucket, LoRA adapters merged (_lora.py)
                if self._device.type == "cuda":
                    torch.cuda.synchronize(self._device)
        adapter.finish()
        self._are_weights_lost = False

    def _update_beside(self, targets, named_tensors, bucket_bytes: int) -> None:
        """update_weights with lora_mode="beside" (under the engine's lock): plain weights are
        copied, adapter pieces go into their buffers beside the base (_lora_beside.py)."""
        low_rank = self._low_rank
        low_rank.begin()
        is_new_layout = False
        # New adapter buffers belong to the weights' region (slept and woken with them).
        weights_region = region(
            self._tags["weights"], enable_cpu_backup=self._should_back_up_weights
        )
        with self._dev.selected(), weights_region:
            for bucket in iter_buckets(named_tensors, bucket_bytes=bucket_bytes):
                rest, is_new = low_rank.take(
                    bucket, targets, are_weights_lost=self._are_weights_lost
                )
                is_new_layout |= is_new
                copy_bucket(targets, rest)
                if self._device.type == "cuda":
                    torch.cuda.synchronize(self._device)
        low_rank.finish()
        if is_new_layout:
            # The captured decode graphs lack the new hooks or read the old buffers.
            self._runner.release_graphs()
        self._are_weights_lost = False

    def bind_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> AdapterBinding:
        """Load a LoRA adapter (as update_weights) and bind its tensors: the returned
        binding's refresh() is each later sync, a few multi-tensor copies of the tensors'
        current values with no per-tensor host work (_adapter_binding.py). For a trainer in
        this process whose adapter parameters live on this engine's device:

            binding = engine.bind_adapter(policy.named_adapter_weights(live=True))
            ... optimizer step ...; binding.refresh()

        EngineConfig.lora_mode="beside" only; the adapter alone (no full weights). Any
        update_weights call after it makes the binding stale (refresh raises: bind again)."""
        if self._low_rank is None:
            raise ValueError(
                f"bind_adapter with EngineConfig.lora_mode={self.config.lora_mode!r}: a merged "
                "adapter is re-merged through the weights at each sync; build the engine with "
                "lora_mode='beside' or sync with update_weights"
            )
        pairs = list(named_tensors)
        if not pairs:
            raise ValueError(
                "bind_adapter: no tensors; pass policy.named_adapter_weights(live=True)"
            )
        self._low_rank.check_bindable(pairs)
        self._check_open()
        with self._scheduler.exclusive():  # loaded and bound with no other call in between
            # every other check, the buffers (and any new layout) made
            self._update_weights_held(pairs, DEFAULT_BUCKET_BYTES)
            copies = self._low_rank.bound_copies(pairs)
            return AdapterBinding(self, copies, self._weights_version)

    def _refresh_binding(self, binding: AdapterBinding) -> None:
        self._check_open()
        with self._scheduler.exclusive():
            if binding.version != self._weights_version:
                raise ValueError(
                    "AdapterBinding.refresh: update_weights was called after bind_adapter, so "
                    "the bound buffers may be gone or no longer the adapter's; bind again"
                )
            if is_paused(self._tags["weights"]):
                raise RuntimeError(
                    "AdapterBinding.refresh while the weights are asleep; call "
                    "wake_up(tags=('weights',)) first"
                )
            if self._are_weights_lost:
                raise ValueError(
                    "AdapterBinding.refresh: the base weights were lost (woken with "
                    "should_back_up_weights=False); sync the full weights with update_weights, "
                    "then bind again"
                )
            self._runner.kept.clear()  # KV kept between turns came from the old adapter
            with self._dev.selected():  # the caller's stream: the trainer's tensors live there
                binding._copy()
                if self._device.type == "cuda":
                    torch.cuda.synchronize(self._device)

    def without_adapter(self) -> BaseModelView:
        """This engine's base model, its LoRA adapter off, as an engine of its own: a
        self-judging GenRM on the same resident weights and KV cache (_base_view.py). Needs
        EngineConfig.lora_mode="beside" (the per-row gate)."""
        if self._low_rank is None:
            raise ValueError(
                f"without_adapter() with EngineConfig.lora_mode={self.config.lora_mode!r}: "
                "the merged adapter cannot be off for some rows only; build the engine with "
                "lora_mode='beside'"
            )
        return BaseModelView(self)

    @property
    def lora_mode(self) -> str:
        """How a synced LoRA adapter is served: "merge" or "beside" (EngineConfig.lora_mode)."""
        return self.config.lora_mode

    def adapter_bytes(self) -> int:
        """Bytes the engine keeps on its device for a LoRA adapter besides the base weights:
        "beside", the factors and trained modules it serves; "merge", the float32 factors and
        base values it keeps to un-merge exactly (not the base kept aside for trained modules)."""
        if self._low_rank is not None:
            return self._low_rank.factor_bytes()
        return self._adapter.kept_bytes()

    def sleep(self) -> None:
        """Release the weights' and KV cache's memory (weights are backed up on the CPU)."""
        self._check_open()
        with self._scheduler.exclusive():
            awake = [self._tags[name] for name in _TAGS if not is_paused(self._tags[name])]
            if not (keep_graphs := self.config.keep_graphs_asleep):  # see EngineConfig
                self._runner.release_graphs()
            if awake:
                pause(*awake)
            if self._device.type == "cuda":
                # Memory outside the regions: graph pools, prefill activations, workspaces (one
                # captured in a graph pins its pool; a kept graph needs it).
                with may_sync():  # never inside another engine's capture (placement)
                    if not keep_graphs:
                        torch._C._cuda_clearCublasWorkspaces()
                    torch.cuda.empty_cache()

    def wake_up(self, tags: Sequence[str] | None = _TAGS) -> None:
        """Re-create the memory for `tags` ("weights", "kv_cache"; None for both), in that order."""
        self._check_open()
        names = _TAGS if tags is None else tuple(tags)
        unknown = [t for t in names if t not in _TAGS]
        if unknown or isinstance(tags, str):
            raise ValueError(f"wake_up(tags={tags!r}): use a sequence of {_TAGS} or None")
        with self._scheduler.exclusive():
            for name in _TAGS:  # weights before KV cache, whatever order was given
                if name in names and is_paused(self._tags[name]):
                    resume(self._tags[name])
                    if name == "weights" and not self._should_back_up_weights:
                        self._are_weights_lost = True
                        with self._dev.scope():
                            for buffer, copy in self._buffer_copies:
                                buffer.copy_(copy)
                    if name == "kv_cache" and not self._resize_kv_cache_if_asked():
                        with self._dev.scope():
                            self._runner.reset_state()
                elif name in names and name == "kv_cache":  # awake: resize now if asked
                    self._resize_kv_cache_if_asked()

    # -- KV-cache size (placement's memory split) -------------------------------------------------

    @property
    def num_slots(self) -> int:
        """Sequences decoded together: the KV cache's rows as allocated now."""
        return self._cache.num_slots

    def set_memory_fraction(self, fraction: float) -> None:
        """Give the engine `fraction` of the device's memory for its weights and KV cache.

        The KV cache gets `fraction * total - weight bytes` (total: EngineConfig.
        device_memory_bytes, else the CUDA device's total memory; no limit on CPU without it),
        as many slots of max_seq_len as fit, at most max_batch_size. Takes effect at the next
        KV-cache allocation (next wake_up of "kv_cache", or the start of the next generate or
        stream), never during a call. Fewer slots decode fewer sequences at once; samples stay
        the same, since each draws from its own (seed, request, sample) key.

        Raises ValueError for a fraction outside (0, 1] or too small for one slot.
        """
        value = check_memory_fraction(fraction)
        total = self.config.device_memory_bytes
        if total is None and self._device.type == "cuda":
            total = torch.cuda.mem_get_info(self._device)[1]
        self._target_num_slots = slots_for_fraction(
            fraction=value,
            device_total_bytes=total,
            weight_bytes=self._weight_bytes,
            layout=self._kv_layout,
            max_batch_size=self.config.max_batch_size,
        )

    @property
    def memory_regions(self) -> tuple[str, ...]:
        """The placement regions its memory lives in ("<region_prefix>/weights", ...)."""
        return tuple(self._tags.values())

    @property
    def image_processor(self) -> Any:
        """The image processor a vision-language model's prompts go through (None: text only);
        a GenRM judge on this engine takes it as `image_processor=`."""
        return None if self._vision is None else self._vision.image_processor

    @property
    def image_token_id(self) -> int | None:
        """The token a prompt holds once per merged patch group of an image (None: text only)."""
        return None if self._vision is None else self._vision.image_token_id

    def host_need(self) -> HostNeed:
        """Host memory while asleep, for a placement plan's host check: the weights' backup
        (none with should_back_up_weights=False; the KV cache is never backed up)."""
        buffers = sum(copy.nbytes for _, copy in self._buffer_copies)
        return HostNeed(
            parts={"weights backup": backup_bytes(self._tags["weights"]) + buffers},
            settings={
                "weights backup": "BuiltinEngine(should_back_up_weights=False) for an engine "
                "whose weights the trainer syncs after every wake (the rollout engine)"
            },
        )

    def resident_bytes(self) -> int:
        """Bytes of the engine's tensors on its device now (a sleeping part counts 0)."""
        weights = 0 if is_paused(self._tags["weights"]) else self._weight_bytes
        if is_paused(self._tags["kv_cache"]):
            return weights
        layout = self._kv_layout
        return weights + layout.fixed_bytes + self.num_slots * layout.slot_bytes

    # -- diagnostics (timing and profiling the decode step) ---------------------------------------

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache's keys and values as allocated now (awake or not)."""
        return self._cache.num_bytes

    @property
    def attention_spans(self) -> list[int]:
        """Cache positions a decode step may attend to, one CUDA graph each.

        At each host check the engine picks the smallest span that holds the longest running
        sequence for the next `steps_per_sync` steps, so short sequences read less of the cache.
        """
        return list(self._runner.spans)

    @property
    def decode_batch_buckets(self) -> list[int]:
        """Batch sizes a decode step runs, one CUDA graph each per span (the last: every slot).

        At each host check the engine picks the smallest that holds the running sequences.
        """
        return list(self._runner.batch_buckets)

    def run_decode_steps(
        self, *, span: int, num_steps: int, use_graph: bool = True, batch: int | None = None
    ) -> None:
        """Run `num_steps` decode steps attending to `span` positions, outside any call.

        For timing and profiling the step (bench/rollout/rollout_gpu.py does both): each of the `batch`
        rows (one of engine.decode_batch_buckets; None: every slot, what a step cost before the
        buckets) computes what a running one would (fixed shapes), idle slots write only where
        no call reads, and the sampling configuration is the last call's. `use_graph` replays
        its captured graphs (when the engine captures them: EngineConfig.use_cuda_graph on
        CUDA), else it runs eagerly. The work is queued on the engine's stream and ordered
        before the caller's later work, so CUDA events recorded on the caller's stream around
        this call time it.
        """
        self._check_open()
        if span not in self._runner.spans:
            raise ValueError(f"span={span}: use one of engine.attention_spans {self._runner.spans}")
        buckets = self._runner.batch_buckets
        if batch is None:
            batch = buckets[-1]
        if batch not in buckets:
            raise ValueError(f"batch={batch}: use one of engine.decode_batch_buckets {buckets}")
        with self._scheduler.exclusive():
            self._check_awake()
            flags = self._runner.last_flags
            if flags is None:
                raise RuntimeError(
                    "run_decode_steps replays the last call's decode step; call generate first"
                )
            with self._dev.scope():
                self._runner.set_decode_rows(range(batch))
                for _ in range(num_steps):
                    self._runner.run_decode_step(flags, span, use_graph=use_graph)

    def _resize_kv_cache_if_asked(self) -> bool:
        """Re-allocate the (awake) KV cache when its size is not the target; under the lock."""
        if self._target_num_slots == self._cache.num_slots:
            return False
        old, new = self._cache.num_slots, self._target_num_slots
        logger.info("KV cache %s: %d -> %d slots", self._tags["kv_cache"], old, new)
        self._allocate_kv_cache(self._target_num_slots)
        return True

    def _allocate_kv_cache(self, num_slots: int) -> None:
        """A fresh, zeroed KV cache and slot runner of `num_slots` (the old ones dropped first)."""
        if hasattr(self, "_runner"):
            # Graphs hold the old buffers; dropping everything first lets the region's pool
            # reuse that memory for the new cache.
            self._runner.release_graphs()
            del self._runner, self._cache
            # compile_scope="layers" binds the cache's buffers to the attention modules: let
            # them go too before the new cache is allocated.
            bind_layer_caches(self.model, None)
        layout = self._kv_layout
        with self._dev.selected(), region(self._tags["kv_cache"]), self._dev.scope():
            self._cache = StaticKVCache(
                num_layers=layout.num_layers,
                num_slots=num_slots,
                num_kv_heads=layout.num_kv_heads,
                max_seq_len=layout.max_seq_len,
                head_dim=layout.head_dim,
                dtype=layout.dtype,
                device=self._device,
            )
            self._runner = SlotRunner(
                self.model,
                self._cache,
                use_cuda_graph=self.config.use_cuda_graph,
                steps_per_sync=self.config.steps_per_sync,
                compile_decode=self.config.should_compile_decode,
                compile_prefill=self.config.should_compile_prefill,
                decode_attention=self.config.decode_attention_kernel,
                max_prefill_tokens=self.config.max_prefill_tokens,
                stream=self._dev.stream,
                vision=self._vision,
                decode_batch_buckets=self.config.decode_batch_buckets,
                low_rank=self._low_rank,
                compile_scope=self.config.compile_scope,
            )

    def close(self) -> None:
        """Abort any run, drop graphs and references, and release the region tags.

        On CUDA the regions' memory stays in their torch_memory_saver pools (reused by a later
        engine with the same region_prefix); call sleep() first to give it back to the device.
        A tag closed asleep stays paused until that later engine allocates in it.
        """
        if self._is_closed:
            return
        self.abort()
        with self._scheduler.exclusive():
            self._runner.release_graphs()
            self._is_closed = True
            del self._runner, self._cache
            bind_layer_caches(self.model, None)  # no reference to the cache outlives it
            self.model = None
        if owned := [tag for tag in self._tags.values() if tag in region_tags()]:
            release(*owned)
        if self._device.type == "cuda":
            empty_cache()  # placement's: never inside another engine's capture

    def _check_open(self) -> None:
        if self._is_closed:
            raise RuntimeError("the engine is closed; build a new one")

    def _check_awake(self) -> None:
        # Raise rather than wake: waking the KV cache here could take memory a placement plan
        # gave to another role (e.g. generate called in a weights-only "sync" phase).
        if asleep := tuple(name for name in _TAGS if is_paused(self._tags[name])):
            raise RuntimeError(
                f"generation needs the whole engine but its {list(asleep)} are asleep; call "
                f"wake_up(tags={asleep}) first (or generate inside a placement phase that names "
                "the engine whole, such as 'rollout')"
            )
        if self._are_weights_lost:
            raise RuntimeError(
                "generation after the weights woke without a backup "
                "(should_back_up_weights=False) and before update_weights refilled them; sync "
                "the trainer's weights first, or build the engine with should_back_up_weights=True"
            )


def _eos_ids(model: PreTrainedModel) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config.get_text_config(), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
