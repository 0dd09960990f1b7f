"""Configuration of the built-in engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True)
class EngineConfig:
    """How the built-in engine runs; the defaults run a tiny model on CPU."""

    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str = "auto"  # "auto" keeps the checkpoint's dtype; else float32/bfloat16/float16
    max_batch_size: int = 32  # slots decoded together (KV cache rows)
    max_seq_len: int = 2048  # prompt + response tokens per slot (KV cache length)
    max_prefill_tokens: int = 16384  # padded prompt tokens per prefill forward pass
    use_cuda_graph: bool = True  # capture the decode step in a CUDA graph (CUDA only)
    # Keep the captured graphs (and their memory pool, ~the decode step's activations and
    # logits) through sleep(): weights and KV cache come back at the same addresses, so the
    # graphs stay valid and wake-up skips the recapture (about a second per colocated engine
    # and step on an H200; test_kept_graphs_survive_sleep_and_wake passed there). False gives
    # back every byte at sleep, at the price of recapturing on the next call.
    keep_graphs_asleep: bool = True
    # Compile the decode step (model forward + sampling + slot bookkeeping) with torch.compile
    # (inductor), once per sampling mode and batch size, attention span dynamic; on CUDA it is
    # then captured in the engine's CUDA graphs as before. Fuses RMSNorm, residual adds, rotary,
    # SwiGLU, the KV write and the sampler's elementwise work (about 45 kernels a layer eager).
    # The first call pays the compile (tens of seconds); if compiling fails the engine logs it
    # once and decodes eagerly. None: on for CUDA, off for CPU.
    compile_decode: bool | None = None
    # Compile the text prefill forward (inductor, dynamic in batch, prompt length and kept
    # logits), so RMSNorm, rotary, SwiGLU and the residual adds fuse as in the compiled decode
    # step; each layer's KV write and causal attention stay one opaque op
    # (_static_kv.prefill_kv_attention), so attention keeps SDPA's flash kernel. Eager prefill
    # ran at 0.56x SGLang's on 1,024-token judge prompts; compiled, 1.03x at the 0.5B shape and
    # 0.96x at 1.5B (bench/results/engines_prefill_nvidia_h200.md; the profiles,
    # prefill_profile_*nvidia_h200.md, have eager against compiled: 1.71x and 1.46x). The first
    # prefill of each new specialisation pays a compile (tens of seconds); a failed compile is
    # logged once and prefill stays eager. Image prompts always prefill eagerly. None: on for
    # CUDA, off for CPU.
    compile_prefill: bool | None = None
    # What compile_decode and compile_prefill compile. "step": the decode step and the prefill
    # forward, each one graph over the whole model. "layers": each decoder layer, compiled
    # once and reused by every layer (the rest of the step eager, under the same CUDA graphs),
    # for every forward (decode, prefill, continuations) when either flag is on. The whole
    # model's graph is what makes the first step slow: on the CPU, the engine's first generate
    # of a 24-layer Qwen2 took 99.9 s, and 18.9 s by layer (bench/results/compile_time_cpu.md);
    # at 7B + 7B the trainer's first step took 337 s on an H200 (lora_nvidia_h200.md). Not
    # measured on a GPU yet (decode speed, first step): opt-in. Not with lora_mode="beside".
    compile_scope: str = "step"
    # Run each layer's q/k/v projections as one GEMM, and its gate/up projections as one
    # (_fused_projections.py): 3 GEMMs fewer per layer and decode step. Parameter names and
    # shapes are unchanged (weight syncs are not affected); GEMM rounding may differ.
    fuse_projections: bool = True
    # Decode attention over the static KV cache: "sdpa" (one SDPA call over the grouped query;
    # on CUDA a flash prefill kernel), "triton" (a split-K decode kernel, _decode_kernel.py;
    # CUDA only, SDPA elsewhere), "matmul" (q K^T, float32 softmax, P V), or "auto" ("triton"
    # on CUDA, "sdpa" on CPU). Prefill attention is SDPA whatever this says.
    decode_attention: str = "auto"
    steps_per_sync: int = 8  # decode steps between host checks for finished slots
    # Batch sizes a decode step may run (one CUDA graph each per attention span): each host
    # check decodes only the running slots, in the smallest size that holds them (the slot
    # count always closes the list), so a step's cost follows the number of active sequences.
    # None: powers of two from 8 below the slot count (256 slots: 8, 16, ..., 128, 256; six
    # graphs per span instead of one, captured at the first call, sharing one memory pool,
    # one compile: the compiled step is dynamic in the batch). (): every step runs every slot.
    decode_batch_buckets: tuple[int, ...] | None = None
    # A call that samples like the running one (same temperature, top-p, top-k, min-p,
    # repetition penalty, stop ids; n, seed and max_new_tokens may differ) joins its loop: its
    # samples take free slots at the next host check instead of waiting for the whole running
    # call. False: one call at a time.
    should_join_calls: bool = True
    # How a LoRA adapter synced alone ("<m>.lora_A"...) is served. "merge": into the resident
    # weights (_lora.py; the forward unchanged, a pass over the targets' weights per sync).
    # "beside": the low-rank product beside each base GEMM, gated per row (_lora_beside.py),
    # so rows with Request.use_adapter=False (a self-judging GenRM on the policy's engine)
    # read the untouched base in the same batch; two small GEMMs per target and layer.
    lora_mode: str = "merge"
    # lora_mode="beside": the adapter's rank, known before its first sync (the trainer fills
    # it from policy.lora). Its buffers (zeros: the output is the base's) and forward hooks
    # are then made with the engine, so its first compile already holds them and an adapter
    # of a rank <= max_lora_rank loads in place (a lower rank padded with zeros): no CUDA
    # graphs dropped, nothing compiled again (at 7B a second whole-model compile took ~5 min:
    # bench/results/lora_nvidia_h200_05e6ac0.md). None: the buffers are made at the first adapter.
    max_lora_rank: int | None = None
    # The modules given buffers under max_lora_rank, as PEFT's target_modules: "all-linear"
    # (every Linear but the output layer), a regular expression on the whole module name, or
    # a tuple of names (or their last dotted parts). The trainer fills it from policy.lora.
    lora_target_modules: str | tuple[str, ...] = "all-linear"
    # lora_mode="beside": the modules an adapter trains whole (PEFT's modules_to_save, e.g.
    # ("lm_head",); names or their last dotted parts; the trainer fills it from policy.lora).
    # Each gets its trained copy's buffer and hook with the engine, off until the first sync,
    # so that sync changes nothing the first compile holds (an LM head's copy: ~1 GB at 7B).
    lora_modules_to_save: tuple[str, ...] = ()
    region_prefix: str = "rollout"  # placement tags "<prefix>/weights", "<prefix>/kv_cache"
    # CUDA priority of the engine's stream: lower is more urgent (0 is the lowest; values past
    # the device's range map to its ends). Beside a colocated judge (partial colocation) give
    # the policy engine -1: its long tail is the step's critical path, so its kernels take the
    # SMs first and the judge's fill the gaps.
    stream_priority: int = 0
    # Total device memory that set_memory_fraction(f) takes a share of (the engine's weights and
    # KV cache get f times this). None: torch.cuda.mem_get_info's total on CUDA; no limit on CPU
    # (max_batch_size slots), so set it to give CPU runs and tests a notional device.
    device_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"EngineConfig.device={self.device!r} is not a device; use 'cpu' or 'cuda[:N]'"
            ) from exc
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"EngineConfig.device={self.device!r}: use 'cpu' or 'cuda[:N]'")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"EngineConfig.device={self.device!r} but CUDA is not available; use 'cpu'"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"EngineConfig.dtype={self.dtype!r}: use 'auto' or one of {sorted(_DTYPES)}"
            )
        for name in ("max_batch_size", "max_seq_len", "max_prefill_tokens", "steps_per_sync"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name}={value!r}: must be an int >= 1")
        if self.max_seq_len < 2:
            raise ValueError(
                f"EngineConfig.max_seq_len={self.max_seq_len}: must be >= 2 (a prompt token "
                "and a new one)"
            )
        if self.max_prefill_tokens < self.max_seq_len:
            raise ValueError(
                f"EngineConfig.max_prefill_tokens={self.max_prefill_tokens} is below "
                f"max_seq_len={self.max_seq_len}: the longest prompt would not fit one prefill; "
                "raise max_prefill_tokens"
            )
        if self.device_memory_bytes is not None and (
            not isinstance(self.device_memory_bytes, int) or self.device_memory_bytes < 1
        ):
            raise ValueError(
                f"EngineConfig.device_memory_bytes={self.device_memory_bytes!r}: must be an int "
                ">= 1 (bytes), or None for the device's own total"
            )
        if not isinstance(self.stream_priority, int) or isinstance(self.stream_priority, bool):
            raise ValueError(
                f"EngineConfig.stream_priority={self.stream_priority!r}: must be an int (0 = "
                "normal, negative = more urgent, e.g. -1 for the policy beside a judge)"
            )
        if self.compile_decode is not None and not isinstance(self.compile_decode, bool):
            raise ValueError(
                f"EngineConfig.compile_decode={self.compile_decode!r}: must be a bool or None "
                "(None: compile on CUDA only)"
            )
        if self.compile_prefill is not None and not isinstance(self.compile_prefill, bool):
            raise ValueError(
                f"EngineConfig.compile_prefill={self.compile_prefill!r}: must be a bool or None "
                "(None: compile on CUDA only)"
            )
        if self.compile_scope not in ("step", "layers"):
            raise ValueError(
                f"EngineConfig.compile_scope={self.compile_scope!r}: use 'step' (the decode "
                "step and the prefill, each compiled whole) or 'layers' (each decoder layer "
                "compiled once)"
            )
        if self.compile_scope == "layers" and self.lora_mode == "beside":
            raise ValueError(
                "EngineConfig.compile_scope='layers' with lora_mode='beside': the adapter's "
                "hooks would compile once per module; use compile_scope='step' or "
                "lora_mode='merge'"
            )
        if self.decode_attention not in ("auto", "sdpa", "triton", "matmul"):
            raise ValueError(
                f"EngineConfig.decode_attention={self.decode_attention!r}: use 'auto', 'sdpa', "
                "'triton' or 'matmul'"
            )
        buckets = self.decode_batch_buckets
        if buckets is not None and (
            not isinstance(buckets, (tuple, list))
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets)
        ):
            raise ValueError(
                f"EngineConfig.decode_batch_buckets={buckets!r}: must be a tuple of ints >= 1 "
                "(e.g. (8, 32, 128)), () for no buckets, or None for powers of two from 8"
            )
        if not isinstance(self.should_join_calls, bool):
            raise ValueError(
                f"EngineConfig.should_join_calls={self.should_join_calls!r}: must be a bool"
            )
        if self.lora_mode not in ("merge", "beside"):
            raise ValueError(
                f"EngineConfig.lora_mode={self.lora_mode!r}: use 'merge' (the adapter merged "
                "into the weights) or 'beside' (the low-rank product beside the base GEMMs; "
                "needed for Request.use_adapter=False)"
            )
        rank = self.max_lora_rank
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
                raise ValueError(
                    f"EngineConfig.max_lora_rank={rank!r}: must be an int >= 1 (the adapter's "
                    "rank) or None"
                )
            if self.lora_mode != "beside":
                raise ValueError(
                    f"EngineConfig.max_lora_rank={rank} with lora_mode={self.lora_mode!r}: "
                    "it reserves the buffers of lora_mode='beside'; drop it or set "
                    "lora_mode='beside'"
                )
        targets = self.lora_target_modules
        if isinstance(targets, list):
            self.lora_target_modules = targets = tuple(targets)
        if not (
            (isinstance(targets, str) and targets)
            or (isinstance(targets, tuple) and targets and all(isinstance(t, str) for t in targets))
        ):
            raise ValueError(
                f"EngineConfig.lora_target_modules={targets!r}: 'all-linear', a regular "
                "expression, or a tuple of module names (e.g. ('q_proj', 'v_proj'))"
            )
        saved = self.lora_modules_to_save
        if isinstance(saved, list):
            self.lora_modules_to_save = saved = tuple(saved)
        if not (isinstance(saved, tuple) and all(isinstance(t, str) and t for t in saved)):
            raise ValueError(
                f"EngineConfig.lora_modules_to_save={saved!r}: a tuple of module names "
                "(e.g. ('lm_head',)), or () for none"
            )
        if saved and self.lora_mode != "beside":
            raise ValueError(
                f"EngineConfig.lora_modules_to_save={saved!r} with lora_mode={self.lora_mode!r}: "
                "it reserves the trained copies of lora_mode='beside'; drop it or set "
                "lora_mode='beside'"
            )
        if not self.region_prefix or "/" in self.region_prefix:
            raise ValueError(
                f"EngineConfig.region_prefix={self.region_prefix!r}: must be a non-empty name "
                "without '/', unique per engine in the process (e.g. 'rollout', 'genrm')"
            )

    @property
    def should_compile_decode(self) -> bool:
        if self.compile_decode is None:
            return torch.device(self.device).type == "cuda"
        return self.compile_decode

    @property
    def should_compile_prefill(self) -> bool:
        if self.compile_prefill is None:
            return torch.device(self.device).type == "cuda"
        return self.compile_prefill

    @property
    def decode_attention_kernel(self) -> str:
        """ "sdpa", "triton" or "matmul": what `decode_attention` resolves to."""
        if self.decode_attention == "auto":
            return "triton" if torch.device(self.device).type == "cuda" else "sdpa"
        return self.decode_attention

    @property
    def torch_dtype(self) -> torch.dtype | str:
        return "auto" if self.dtype == "auto" else _DTYPES[self.dtype]
