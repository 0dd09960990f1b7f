"""Continuous batching over a fixed set of slots: the device side (state, steps, graphs).

    queue of samples --prefill (eager, chunked)--> slots 0..S-1 --decode step x k--> host check
          ^                                                                              |
          +------------- finished slots are harvested and refilled from the queue <------+

The host side (queue, admission, harvest, several calls sharing one loop) is in _host_loop.py.
Every tensor the decode step touches is preallocated with a fixed shape, so on CUDA the step
(model forward + sampling + bookkeeping) is captured in CUDA graphs and replayed. The host looks
at the slots only every `steps_per_sync` steps (one small device-to-host copy); finished slots
idle until then, which costs at most k-1 wasted steps per finished slot.

On CUDA every kernel and graph replay goes to the engine's own stream (the caller enters it, see
_device.py), so two engines on one GPU decode concurrently and each host check waits for its own
engine's work only. Graphs are captured on that same stream.

Attention reads cache positions [0, span) only. Spans are buckets (64, 128, ..., L), one graph
each; at every host check the smallest bucket that holds the longest active sequence for the
next k steps is chosen, so short sequences do not pay for a long max_seq_len.

A step decodes a batch of B rows, not every slot: B is the smallest batch bucket (by default
8, 16, 32, ... below S, then S) that holds the slots active at the host check, and
row_slot_S[:B] names the slot of each row (the active ones, then idle ones as padding; the full
bucket is the identity). The step gathers its rows' state through that index, reads and writes
their KV rows through it, and scatters the new state back, so the step's cost follows the
number of active sequences (the long tail of a rollout no longer pays for a full batch) and no
KV moves between slots. Each (span, batch bucket) pair is its own CUDA graph; the compiled step
is dynamic in both. A slot that finishes between host checks stays in the batch, idle.

Per slot s (S slots, L = max_seq_len):
  row_slot_S[b]   the slot that batch row b decodes (the first B entries are the step's batch)
  input_tok_S[s]  last token, whose key/value the next step writes at position pos_S[s]
  gen_len_S[s]    tokens generated so far; response g sits in response_SL[s, g]
  limit_S[s]      generation stops when gen_len reaches it: min(item's max_new_tokens, L - prompt)
  active_S[s]     still generating; idle slots compute garbage and write to column L (trash)
  rope_delta_S[s] a vision-language prompt's mrope offset: the token at cache position p has
                  text position p + rope_delta_S[s] (0 for text prompts; see _vision.py)
  adapter_on_S[s] 1 when the slot's request reads the LoRA adapter beside the base, 0 when it
                  reads the base (Request.use_adapter; EngineConfig.lora_mode="beside" only)
  history_SL[s, p] the token at cache position p (prompt, then response), written only while
                  a repetition penalty is on: the tokens it penalizes are history_SL[s, :pos+1]
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from yatt.placement import capturing, may_sync
from yatt.rollout._types import Request, SamplingParams
from yatt.rollout.builtin._device import to_device
from yatt.rollout.builtin._layer_compile import bind_layer_caches, compile_decoder_layers
from yatt.rollout.builtin._lora_beside import LowRankBeside
from yatt.rollout.builtin._sampling import sample_tokens, seen_tokens
from yatt.rollout.builtin._static_kv import (
    KV_WRITE_KWARG,
    ContinueWrite,
    DecodeWrite,
    PrefillWrite,
    StaticKVCache,
    writing_kv,
)
from yatt.rollout.builtin._vision import RequestImages, VisionPrefill

logger = logging.getLogger(__name__)

MAX_STOP_TOKENS = 32
MAX_LABEL_TOKENS = 16  # SamplingParams.label_token_ids per call
MIN_SPAN = 64  # smallest attention bucket; below this a step is bound by launches, not reads
# Smallest default batch bucket: below it a step is bound by launches and weight reads, so a
# smaller batch would save little and cost graphs.
MIN_BATCH_BUCKET = 8
# Compiled decode graphs one code object may hold: one per (sampling mode, batch size, dtype,
# model shape) met in the process; dynamo's default (8) would quietly fall back to eager.
_RECOMPILE_LIMIT = 64


def allow_compiled_calls_during_fx_traces() -> None:
    """Compiling FX-traces under a flag torch keeps per process, not per thread, and while it
    is set dynamo raises in every compiled call of any other thread ("Detected that you are
    using FX to symbolically trace a dynamo-optimized function"): a rollout engine's forward
    failed while a judge engine compiled in another thread (session 26, compile_scope
    "layers"), and a whole-step compile fell back to eager for good. With the error off, such
    a call runs its function eagerly (the same result) and the next call uses the graph.
    Set here for torch versions whose dynamo settings are process-wide (a per-call patch that
    restores another thread's value would race), and patched around every compiled call for
    those that keep them per thread (SlotRunner._compile_patch)."""
    torch._dynamo.config.error_on_nested_fx_trace = False


def span_buckets(max_seq_len: int) -> list[int]:
    """Attention spans with one decode graph each: powers of two from MIN_SPAN, then L."""
    spans = []
    span = MIN_SPAN
    while span < max_seq_len:
        spans.append(span)
        span *= 2
    return [*spans, max_seq_len]


def batch_buckets(num_slots: int, sizes: Sequence[int] | None = None) -> list[int]:
    """Batch sizes with one decode graph each (per span): `sizes` below num_slots, then
    num_slots. None: powers of two from MIN_BATCH_BUCKET; () : num_slots alone (no buckets)."""
    if sizes is None:
        sizes = []
        size = MIN_BATCH_BUCKET
        while size < num_slots:
            sizes.append(size)
            size *= 2
    return sorted({size for size in sizes if size < num_slots} | {num_slots})


@dataclass(kw_only=True)
class WorkItem:
    """One sample to generate."""

    request_index: int
    sample_index: int
    request: Request
    request_id: str
    key: int  # counter-based RNG key, from (its call's seed, request_index, sample_index)
    max_new_tokens: int  # the request's own limit if it sets one, else the call's
    owner: object = None  # the call it belongs to (several calls may share one loop)
    images: RequestImages | None = None  # the request's images, encoded (a vision model)
    label_token_ids: tuple[int, ...] = ()  # logprobs reported at the first response position
    use_adapter: bool = True  # Request.use_adapter (lora_mode="beside" gates the adapter per row)


@dataclass(kw_only=True)
class Kept:
    """A finished sample's KV kept in its slot for the conversation's next turn.

    ids: the tokens whose keys/values the slot holds, positions 0..len-1 (the prompt and the
    response but its last token, which was sampled and never fed back)."""

    session_id: str
    ids: list[int]
    last_used_s: float  # time.monotonic() when it was kept
    use_adapter: bool = True  # its KV was computed with the LoRA adapter (Request.use_adapter)
    images: RequestImages | None = None  # the images whose features its KV holds (in order)


@dataclass(kw_only=True)
class Flags:
    is_greedy: bool
    is_truncated: bool  # top-p, top-k or min-p on
    is_penalized: bool = False  # a repetition penalty on

    def as_key(self) -> tuple[bool, bool, bool]:
        return (self.is_greedy, self.is_truncated, self.is_penalized)


def _log_compile_fallback(what: str, doing: str, field: str, exc: Exception) -> None:
    logger.warning(
        "compiling %s failed (%s: %s); %s eagerly from now on (EngineConfig.%s=False skips the "
        "attempt)",
        what,
        type(exc).__name__,
        str(exc).splitlines()[0] if str(exc) else "",
        doing,
        field,
    )


class SlotRunner:
    """Owns the per-slot state and the device steps over it (a SlotLoop drives it)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: StaticKVCache,
        *,
        use_cuda_graph: bool,
        steps_per_sync: int,
        compile_decode: bool = False,
        compile_prefill: bool = False,
        decode_attention: str = "sdpa",
        max_prefill_tokens: int,
        stream: torch.cuda.Stream | None = None,
        vision: VisionPrefill | None = None,
        decode_batch_buckets: Sequence[int] | None = None,
        low_rank: LowRankBeside | None = None,
        compile_scope: str = "step",
    ) -> None:
        self.model = model
        # lora_mode="beside": the adapter's per-row gate, filled before every forward.
        self.low_rank = low_rank
        self.vision = vision
        self.cache = cache
        self.steps_per_sync = steps_per_sync
        self.max_prefill_tokens = max_prefill_tokens
        S, L = cache.num_slots, cache.max_seq_len
        device = cache.keys[0].device
        self.device = device
        self.use_cuda_graph = use_cuda_graph and device.type == "cuda"
        zeros = dict(device=device, dtype=torch.long)
        self.input_tok_S = torch.zeros(S, **zeros)
        self.pos_S = torch.zeros(S, **zeros)
        self.gen_len_S = torch.zeros(S, **zeros)
        self.limit_S = torch.ones(S, **zeros)
        self.key_S = torch.zeros(S, **zeros)
        self.rope_delta_S = torch.zeros(S, **zeros)
        self.top_k_S = torch.zeros(S, **zeros)
        self.active_S = torch.zeros(S, dtype=torch.bool, device=device)
        self.temperature_S = torch.ones(S, dtype=torch.float32, device=device)
        self.top_p_S = torch.ones(S, dtype=torch.float32, device=device)
        self.min_p_S = torch.zeros(S, dtype=torch.float32, device=device)
        self.repetition_penalty_S = torch.ones(S, dtype=torch.float32, device=device)
        self.adapter_on_S = torch.ones(S, dtype=torch.float32, device=device)
        self.stop_ids_K = torch.full((MAX_STOP_TOKENS,), -1, **zeros)
        self.response_SL = torch.zeros(S, L + 1, **zeros)
        self.history_SL = torch.zeros(S, L + 1, **zeros)  # column L: an idle slot's trash
        self.logprob_SL = torch.zeros(S, L + 1, dtype=torch.float32, device=device)
        # Per slot: the logprobs of its item's label_token_ids at the first response position,
        # written at prefill (eager, no graph) and read at harvest.
        self.label_logprob_SK = torch.zeros(S, MAX_LABEL_TOKENS, dtype=torch.float32, device=device)
        self.row_slot_S = torch.arange(S, device=device)
        self.arange_L = torch.arange(L, device=device)
        self.spans = span_buckets(L)
        self.batch_buckets = batch_buckets(S, decode_batch_buckets)
        # Decode steps run per batch bucket (a diagnostic: tests and benchmarks read it).
        self.bucket_steps: Counter[int] = Counter()
        self._rows: tuple[int, ...] | None = None  # what row_slot_S[:B] holds now
        self.batch = S  # the decode steps' batch bucket, as set_decode_rows set it
        self.last_flags: Flags | None = None  # of the last call begun (what a profile replays)
        self.reset_state()
        self._graphs: dict[tuple[bool, bool, bool, int, int], torch.cuda.CUDAGraph] = {}
        self._graph_pool = None
        # The engine's stream (None on CPU): graphs are captured on it, so the cuBLAS workspaces
        # baked into them belong to it, and replays on it never race another engine's.
        self.stream = stream
        self.decode_attention = decode_attention
        # compile_scope="layers" (EngineConfig): each decoder layer compiled once for every
        # layer and every forward; no whole-step graphs. The write then travels as a forward
        # kwarg everywhere (dynamo does not trace the ContextVar of writing_kv), and every
        # forward may compile (device synchronisations: inside may_sync).
        self._compile_layers = compile_scope == "layers" and (compile_decode or compile_prefill)
        if compile_decode or compile_prefill:
            allow_compiled_calls_during_fx_traces()
        should_compile_decode_ends = self._compile_layers and compile_decode
        if self._compile_layers:
            compile_decoder_layers(model)
            bind_layer_caches(model, cache)
            compile_decode = compile_prefill = False
        self._compile_decode = compile_decode
        # Dynamo's settings around each compiled call. With lora_mode="beside" the adapter's
        # forward hooks appear at its first sync, after a first compile: dynamo skips guards on
        # module hooks by default, and would replay the graph compiled without them.
        # error_on_nested_fx_trace: see allow_compiled_calls_during_fx_traces (per call too:
        # recent torch keeps dynamo's settings per thread, and the engine is driven from
        # whichever thread calls it).
        self._compile_patch = {
            "recompile_limit": _RECOMPILE_LIMIT,
            "error_on_nested_fx_trace": False,
        }
        if low_rank is not None:
            self._compile_patch["skip_nnmodule_hook_guards"] = False
        # One compiled function per runner; dynamo's cache (per code object) is shared, so a
        # new engine of the same shapes reuses an earlier engine's compiled graph.
        self._compiled_step = (
            torch.compile(self._decode_step_body, dynamic=False) if compile_decode else None
        )
        # Prefill shapes change with every chunk (rows, padded length, distinct last columns):
        # compiled dynamic, so a few specialisations (a size of 1, say) serve them all.
        self._compiled_prefill = (
            torch.compile(self._prefill_logits, dynamic=True) if compile_prefill else None
        )
        # compile_scope="layers": the decode step's two ends (the rows' state in; sampling and
        # the state out) compiled on their own, whatever the depth. Eager, sampling's passes
        # over the vocabulary made a 0.5B decode step 1.19x the whole-step compile's on an H200
        # (bench/results/compile_time_nvidia_h200.md, session 26).
        self._compiled_decode_ends = (
            (
                torch.compile(self._decode_inputs, dynamic=False),
                torch.compile(self._decode_outputs, dynamic=False),
            )
            if should_compile_decode_ends
            else None
        )

    # -- device steps -------------------------------------------------------------------------

    def _layers_call(self):
        """Around a forward whose decoder layers are compiled (compile_scope="layers"): a first
        call of a shape compiles and autotunes (device synchronisations), under dynamo's
        settings for this engine."""
        stack = contextlib.ExitStack()
        stack.enter_context(may_sync())
        stack.enter_context(torch._dynamo.config.patch(**self._compile_patch))
        return stack

    def _forward_last_logits(
        self, input_ids, mask, position_ids, write, inputs_embeds=None, *, as_kwarg=False
    ) -> torch.Tensor:
        kwargs = dict(
            input_ids=input_ids if inputs_embeds is None else None,
            inputs_embeds=inputs_embeds,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=1,
        )
        if self._compile_layers:
            with self._layers_call():
                return self.model(**kwargs, **{KV_WRITE_KWARG: write}).logits[:, -1]
        if as_kwarg:
            return self.model(**kwargs, **{KV_WRITE_KWARG: write}).logits[:, -1]
        with writing_kv(write):
            out = self.model(**kwargs)
        return out.logits[:, -1]

    def _decode_step(self, flags: Flags, span: int, batch: int) -> None:
        """One decode step over rows row_slot_S[:batch]: compiled when the engine compiles it,
        else eager."""
        arange_P = self.arange_L[:span]
        slot_B = self.row_slot_S[:batch]
        if self._compiled_step is not None or self._compiled_decode_ends is not None:
            # Dynamic in the span and the batch (one compiled graph for every span and batch
            # bucket), static in the rest. "maybe": a batch of 1 specialises instead of failing.
            torch._dynamo.mark_dynamic(arange_P, 0)
            torch._dynamo.maybe_mark_dynamic(slot_B, 0)
        if self._compiled_step is not None:
            try:
                # may_sync: a first call compiles and autotunes (device synchronisations)
                with may_sync(), torch._dynamo.config.patch(**self._compile_patch):
                    self._compiled_step(arange_P, slot_B, *flags.as_key())
                return
            except Exception as exc:
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise  # a broken capture: _capture reports it
                # Compiling happens before the step runs, so the state is untouched: redo the
                # step eagerly, and stay eager from now on.
                _log_compile_fallback("the decode step", "decoding", "compile_decode", exc)
                self._compiled_step = None
        if self._compiled_decode_ends is not None:
            compiled_inputs, compiled_outputs = self._compiled_decode_ends
            try:
                with may_sync(), torch._dynamo.config.patch(**self._compile_patch):
                    pos_B, gen_len_B, active_B, *model_in = compiled_inputs(arange_P, slot_B)
                    logits_BV = self._decode_forward(arange_P, slot_B, pos_B, *model_in)
                    state = (pos_B, gen_len_B, active_B)
                    for tensor in (logits_BV, *state):
                        torch._dynamo.maybe_mark_dynamic(tensor, 0)
                    compiled_outputs(logits_BV, slot_B, *state, *flags.as_key())
                return
            except Exception as exc:
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise
                # The rows' state is written last, by the outputs' graph, and a forward writes
                # the same KV again: redo the step eagerly, and stay eager from now on.
                _log_compile_fallback(
                    "the decode step's inputs and sampling", "decoding", "compile_decode", exc
                )
                self._compiled_decode_ends = None
        self._decode_step_body(arange_P, slot_B, *flags.as_key())

    def _decode_step_body(
        self,
        arange_P: torch.Tensor,
        slot_B: torch.Tensor,
        is_greedy: bool,
        is_truncated: bool,
        is_penalized: bool,
    ):
        """The decode step of the slots slot_B (distinct) over the cache positions arange_P =
        [0, span) (what gets compiled): gather their state, decode, scatter it back."""
        if self.low_rank is not None:  # the rows' adapter gate: a graph input, no host branch
            self.low_rank.set_rows(self.adapter_on_S.index_select(0, slot_B))
        pos_B, gen_len_B, active_B, *model_in = self._decode_inputs(arange_P, slot_B)
        logits_BV = self._decode_forward(arange_P, slot_B, pos_B, *model_in)
        self._decode_outputs(
            logits_BV, slot_B, pos_B, gen_len_B, active_B, is_greedy, is_truncated, is_penalized
        )

    def _decode_inputs(self, arange_P: torch.Tensor, slot_B: torch.Tensor):
        """The rows' state for a decode step: (pos_B, gen_len_B, active_B, input ids [B, 1],
        the additive mask [B, 1, 1, span], positions [B, 1])."""
        pos_B = self.pos_S.index_select(0, slot_B)
        gen_len_B = self.gen_len_S.index_select(0, slot_B)
        active_B = self.active_S.index_select(0, slot_B)
        visible_BP = arange_P[None, :] <= pos_B[:, None]
        # Additive, in the activations' dtype: what SDPA's fused kernels take without a
        # conversion per layer. Position 0 is always visible, so no softmax row is empty.
        mask = torch.where(visible_BP, 0.0, float("-inf")).to(self.cache.keys[0].dtype)
        return (
            pos_B,
            gen_len_B,
            active_B,
            self.input_tok_S.index_select(0, slot_B)[:, None],
            mask[:, None, None, :],
            # The cache position, shifted by a vision prompt's mrope offset (0 for text).
            (pos_B + self.rope_delta_S.index_select(0, slot_B))[:, None],
        )

    def _decode_forward(
        self, arange_P, slot_B, pos_B, ids_B1, mask_B11P, positions_B1
    ) -> torch.Tensor:
        """The model's last logits [B, V] for a decode step, each row writing its token's KV."""
        write = DecodeWrite(
            cache=self.cache,
            pos_B=pos_B,
            slot_B=slot_B,
            span=arange_P.shape[0],
            attention=self.decode_attention,
        )
        # Compiled: the write travels as a forward kwarg (dynamo does not trace the ContextVar
        # of writing_kv); eager keeps the ContextVar, as before.
        return self._forward_last_logits(
            ids_B1, mask_B11P, positions_B1, write, as_kwarg=self._compile_decode
        )

    def _decode_outputs(
        self,
        logits_BV: torch.Tensor,
        slot_B: torch.Tensor,
        pos_B: torch.Tensor,
        gen_len_B: torch.Tensor,
        active_B: torch.Tensor,
        is_greedy: bool,
        is_truncated: bool,
        is_penalized: bool,
    ) -> None:
        """Sample each row's token from its logits and scatter the rows' new state back."""
        L = self.cache.max_seq_len
        # Per row: its own slot's sampling state; the draw hashes (key, counter), so a sample's
        # tokens do not depend on its row, its bucket or its slot.
        seen_BV = None
        if is_penalized:
            # The fed token (position pos) and everything before it.
            history_BL = self.history_SL.index_select(0, slot_B)
            seen_BV = seen_tokens(history_BL, pos_B + 1, logits_BV.shape[-1])
        token_B, logprob_B = sample_tokens(
            logits_BV,
            temperature_S=self.temperature_S.index_select(0, slot_B),
            top_p_S=self.top_p_S.index_select(0, slot_B),
            top_k_S=self.top_k_S.index_select(0, slot_B),
            key_S=self.key_S.index_select(0, slot_B),
            counter_S=gen_len_B,
            is_greedy=is_greedy,
            is_truncated=is_truncated,
            min_p_S=self.min_p_S.index_select(0, slot_B),
            repetition_penalty_S=self.repetition_penalty_S.index_select(0, slot_B),
            seen_SV=seen_BV,
        )
        column_B = slot_B * (L + 1) + torch.where(active_B, gen_len_B, L)
        self.response_SL.view(-1).index_copy_(0, column_B, token_B)
        self.logprob_SL.view(-1).index_copy_(0, column_B, logprob_B)
        if is_penalized:
            # The new token sits at position pos + 1 (< L while active: see limit_S).
            position_B = slot_B * (L + 1) + torch.where(active_B, pos_B + 1, L)
            self.history_SL.view(-1).index_copy_(0, position_B, token_B)
        new_gen_len_B = gen_len_B + active_B.long()
        is_stop_B = (token_B[:, None] == self.stop_ids_K[None, :]).any(dim=-1)
        new_pos_B = torch.where(active_B, pos_B + 1, pos_B).clamp(max=L - 1)
        limit_B = self.limit_S.index_select(0, slot_B)
        new_active_B = active_B & ~is_stop_B & (new_gen_len_B < limit_B)
        # Every read of the slot buffers is above; the slots are distinct, so each scatter
        # writes each slot once (no order between duplicates to depend on).
        self.pos_S.index_copy_(0, slot_B, new_pos_B)
        self.gen_len_S.index_copy_(0, slot_B, new_gen_len_B)
        self.input_tok_S.index_copy_(0, slot_B, token_B)
        self.active_S.index_copy_(0, slot_B, new_active_B)

    def prefill(self, items: list[WorkItem], slots: list[int], flags: Flags) -> None:
        """Prompts of `items` into `slots`, and each slot's first token sampled."""
        device = self.device
        # Samples of one request are adjacent in the queue: prefill their prompt once. Joined
        # calls share the queue, so a request is its call (owner) and its index in that call.
        rows: list[list[int]] = []
        row_images: list[RequestImages | None] = []
        row_adapter: list[bool] = []
        row_of_item: list[int] = []
        for i, item in enumerate(items):
            previous = items[i - 1] if i else None
            if (
                previous is None
                or item.owner is not previous.owner
                or item.request_index != previous.request_index
            ):
                rows.append(item.request.prompt_ids)
                row_images.append(item.images)
                row_adapter.append(item.use_adapter)
            row_of_item.append(len(rows) - 1)
        lengths = [len(r) for r in rows]
        lengths_B = to_device(lengths, device)
        slot_J = to_device(slots, device)
        row_J = to_device(row_of_item, device)
        self._set_adapter_rows(row_adapter)
        if self.vision is not None and any(im is not None for im in row_images):
            logits_BV, delta_B = self._prefill_left_padded(
                rows, lengths_B, slot_J, row_J, row_images
            )
        else:
            logits_BV = self._prefill_right_padded(rows, lengths, slot_J, row_J)
            delta_B = torch.zeros_like(lengths_B)
        self._start_samples(
            items, slot_J, logits_BV[row_J], lengths_B[row_J], delta_B[row_J], flags
        )

    def prefill_continuations(
        self, items: list[WorkItem], slots: list[int], starts: list[int], flags: Flags
    ) -> None:
        """Continue kept sequences: slot slots[j] holds the KV of items[j]'s first starts[j]
        prompt tokens (a conversation's earlier turns); only the rest is prefilled, attending
        to the kept positions. Then each slot's first token is sampled, as `prefill` does.

        A vision-language model: a kept part's text positions are its cache positions plus
        the slot's rope_delta (a prompt with images); new tokens holding images (a tool's
        picture) are prefilled with their features, eager (see _vision.py)."""
        device = self.device
        new_rows = [
            item.request.prompt_ids[start:] for item, start in zip(items, starts, strict=True)
        ]
        lengths = [len(row) for row in new_rows]
        T = max(lengths)
        ids_BT = to_device(
            [[*[0] * (T - n), *row] for row, n in zip(new_rows, lengths, strict=True)], device
        )
        start_B = to_device(starts, device)
        pad_B = T - to_device(lengths, device)
        col_T = torch.arange(T, device=device)
        # Column c of row b is position start_b + c - pad_b (padding columns: start_b, unused).
        positions_BT = start_B[:, None] + (col_T[None, :] - pad_B[:, None]).clamp(min=0)
        span = max(start + n for start, n in zip(starts, lengths, strict=True))
        # ContinueWrite attends by each row's start and length (a lower-right causal mask per
        # row) and reads no mask; a 4D one only keeps HF from building its own [B, 1, T, T].
        mask = torch.zeros(len(items), 1, T, 1, dtype=self.cache.keys[0].dtype, device=device)
        slot_J = to_device(slots, device)
        self._set_adapter_rows([item.use_adapter for item in items])
        write = ContinueWrite(
            cache=self.cache, slots=list(slots), starts=list(starts), lengths=lengths, span=span
        )
        delta_J = torch.zeros_like(start_B)
        tails: list[RequestImages | None] = []
        if self.vision is not None:
            # The kept part's mrope offset (0 for a text prompt): its next text position is
            # start + delta, where the new tokens' positions start.
            delta_J = self.rope_delta_S.index_select(0, slot_J)
            tails = [
                self.vision.tail(item.images, item.request.prompt_ids, start)
                for item, start in zip(items, starts, strict=True)
            ]
        if any(tail is not None for tail in tails):
            # Eager, as a fresh prefill with images is: the vision tower's features at the new
            # image tokens, mrope positions of the new tokens as a sequence of their own,
            # shifted to follow the kept part.
            embeds_BTH, positions_3BT, new_delta_J = self.vision.embed(
                self.model, ids_BT, pad_B, tails
            )
            positions_3BT = positions_3BT + (start_B + delta_J)[None, :, None]
            logits_JV = self._forward_last_logits(
                ids_BT, mask, positions_3BT, write, inputs_embeds=embeds_BTH
            )
            delta_J = delta_J + new_delta_J
        else:
            logits_JV = self._continue_logits(ids_BT, mask, positions_BT + delta_J[:, None], write)
        prompt_len_J = start_B + to_device(lengths, device)
        self._start_samples(items, slot_J, logits_JV, prompt_len_J, delta_J, flags)

    # The continuation forward compiled (created at the first continuation, so an engine that
    # never continues a conversation compiles nothing), and whether compiling it failed.
    _compiled_continue = None
    _is_continue_eager = False

    def _continue_logits(self, ids_BT, mask, positions_BT, write: ContinueWrite) -> torch.Tensor:
        """A continuation's last-column logits [B, V]: compiled when the engine compiles its
        prefills (dynamic, as they are: rows, new tokens and packed lengths change every
        turn), else eager. Eager, its elementwise ops (norms, rotary, SiLU) read and write
        the activations several times over, which compiled fresh prefills fuse."""
        should_compile = self._compiled_prefill is not None and not self._is_continue_eager
        if self._compiled_continue is None and should_compile:
            self._compiled_continue = torch.compile(self._forward_last_logits, dynamic=True)
        if self._compiled_continue is not None:
            try:
                with may_sync(), torch._dynamo.config.patch(**self._compile_patch):
                    return self._compiled_continue(ids_BT, mask, positions_BT, write, as_kwarg=True)
            except Exception as exc:
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise
                # Compiling happens before the forward runs, and an eager continuation
                # rewrites every KV row it fills: redo it eagerly, and stay eager.
                _log_compile_fallback(
                    "the kept-KV continuation", "continuing", "compile_prefill", exc
                )
                self._compiled_continue, self._is_continue_eager = None, True
        return self._forward_last_logits(ids_BT, mask, positions_BT, write)

    def _set_adapter_rows(self, use_adapter: list[bool]) -> None:
        """The adapter gate of a prefill's rows (one per prompt row)."""
        if self.low_rank is not None:
            self.low_rank.set_rows(to_device(use_adapter, self.device, torch.float32))

    def _start_samples(
        self,
        items: list[WorkItem],
        slot_J: torch.Tensor,
        logits_JV: torch.Tensor,
        prompt_len_J: torch.Tensor,
        delta_J: torch.Tensor,
        flags: Flags,
    ) -> None:
        """Sample each item's first token from its last prompt position's logits and set its
        slot's state (a fresh or a continued prompt alike)."""
        device, L = self.device, self.cache.max_seq_len
        self.key_S[slot_J] = to_device([it.key for it in items], device)
        if self.low_rank is not None:
            use_adapter = [it.use_adapter for it in items]
            self.adapter_on_S[slot_J] = to_device(use_adapter, device, torch.float32)
        seen_JV = None
        if flags.is_penalized:
            # The whole prompt (a continuation's kept turns too) counts as seen, as in vLLM.
            prompts = [item.request.prompt_ids for item in items]
            T = max(len(ids) for ids in prompts)
            history_JT = to_device([[*ids, *[0] * (T - len(ids))] for ids in prompts], device)
            self.history_SL[slot_J, :T] = history_JT
            seen_JV = seen_tokens(history_JT, prompt_len_J, logits_JV.shape[-1])
        token_J, logprob_J = sample_tokens(
            logits_JV,
            temperature_S=self.temperature_S[slot_J],
            top_p_S=self.top_p_S[slot_J],
            top_k_S=self.top_k_S[slot_J],
            key_S=self.key_S[slot_J],
            counter_S=torch.zeros_like(slot_J),
            is_greedy=flags.is_greedy,
            is_truncated=flags.is_truncated,
            min_p_S=self.min_p_S[slot_J],
            repetition_penalty_S=self.repetition_penalty_S[slot_J],
            seen_SV=seen_JV,
        )
        if flags.is_penalized:
            # The first response token sits at position prompt_len (< L: prompts are shorter).
            self.history_SL[slot_J, prompt_len_J] = token_J
        if any(item.label_token_ids for item in items):
            self._write_label_logprobs(logits_JV, items, slot_J)
        max_new_J = to_device([item.max_new_tokens for item in items], device)
        limit_J = torch.minimum(L - prompt_len_J, max_new_J)
        self.response_SL[slot_J, 0] = token_J
        self.logprob_SL[slot_J, 0] = logprob_J
        # index_fill_, not `[slot_J] = 1`: a Python scalar assigned through a CUDA index is
        # copied from the host and waits for the stream (once per chunk, a CUDA test found).
        self.gen_len_S.index_fill_(0, slot_J, 1)
        self.pos_S[slot_J] = prompt_len_J
        self.rope_delta_S[slot_J] = delta_J
        self.input_tok_S[slot_J] = token_J
        self.limit_S[slot_J] = limit_J
        is_stop_J = (token_J[:, None] == self.stop_ids_K[None, :]).any(dim=-1)
        self.active_S[slot_J] = ~is_stop_J & (limit_J > 1)

    def _prefill_right_padded(
        self,
        rows: list[list[int]],
        lengths: list[int],
        slot_J: torch.Tensor,
        row_J: torch.Tensor,
    ) -> torch.Tensor:
        """Text prompts, right-padded: each row's last-token logits [B, V].

        Every prompt starts at column 0, so a causal mask alone is exact for its tokens (padding
        only ever follows them): no mask tensor goes to attention, and SDPA runs its flash
        kernel with is_causal (skipping the upper triangle) instead of a masked kernel that
        reads a [B, T, T] mask. Positions past a row's end are cache garbage that decode masks.
        """
        device = self.device
        T = max(lengths)
        ids_BT = to_device([[*row, *[0] * (T - len(row))] for row in rows], device)
        col_BT = torch.arange(T, device=device)[None, :].expand(len(rows), T)
        # Positions are 0..T-1, what HF uses when given none; a vision model's mrope positions
        # are its own, so it keeps them.
        positions_BT = col_BT if self.vision is not None else None
        write = PrefillWrite(
            cache=self.cache,
            slot_J=slot_J,
            row_J=row_J,
            source_col_BT=col_BT,
            is_causal_from_start=True,
            # Each row once, in order (rows are the distinct prompts of the items, in order).
            is_one_sample_per_row=len(slot_J) == len(rows),
        )
        # Logits at each distinct last column only (not [B, T, V]), then each row's own.
        last_cols = sorted({n - 1 for n in lengths})
        keep_K = to_device(last_cols, device)
        which_B = to_device([last_cols.index(n - 1) for n in lengths], device)
        logits_BKV = None
        if self._compiled_prefill is not None:
            try:
                # may_sync: a new shape compiles and autotunes (device synchronisations)
                with may_sync(), torch._dynamo.config.patch(**self._compile_patch):
                    logits_BKV = self._compiled_prefill(ids_BT, positions_BT, keep_K, write, True)
            except Exception as exc:
                # Compiling happens before the forward runs, and an eager prefill rewrites
                # every KV row it fills: redo it eagerly, and stay eager from now on.
                _log_compile_fallback("the prefill", "prefilling", "compile_prefill", exc)
                self._compiled_prefill = None
        if logits_BKV is None:
            logits_BKV = self._prefill_logits(ids_BT, positions_BT, keep_K, write)
        return logits_BKV[torch.arange(len(rows), device=device), which_B]

    def _prefill_logits(
        self,
        ids_BT: torch.Tensor,
        positions_BT: torch.Tensor | None,
        keep_K: torch.Tensor,
        write: PrefillWrite,
        as_kwarg: bool = False,
    ) -> torch.Tensor:
        """The text prefill forward (what `compile_prefill` compiles): logits [B, K, V] at the
        columns keep_K. Compiled, the write goes as a forward kwarg (torch.compile traces it,
        not the ContextVar of writing_kv); eager keeps the ContextVar, as before.

        A 4D mask goes in as a placeholder (an expanded scalar: no [T, T] in memory, which at
        a 32k context would be 1 GB a chunk): given none, transformers builds positions and
        checks them for packed sequences, a .all() on the device (a host sync a chunk)
        whenever the forward is not traced whole (eager, compile_scope="layers"); given a 4D
        one, it takes it as prepared. The attention never reads it: every row starts at
        column 0, so causal attention alone is exact (PrefillWrite.is_causal_from_start)."""
        T = ids_BT.shape[1]
        placeholder_11TT = torch.ones((), dtype=torch.bool, device=ids_BT.device).expand(1, 1, T, T)
        kwargs = dict(
            input_ids=ids_BT,
            attention_mask=placeholder_11TT,
            position_ids=positions_BT,
            use_cache=False,
            logits_to_keep=keep_K,
        )
        if self._compile_layers:
            with self._layers_call():
                return self.model(**kwargs, **{KV_WRITE_KWARG: write}).logits
        if as_kwarg:
            return self.model(**kwargs, **{KV_WRITE_KWARG: write}).logits
        with writing_kv(write):
            return self.model(**kwargs).logits

    def _prefill_left_padded(self, rows, lengths_B, slot_J, row_J, row_images):
        """Prompts with images, left-padded under an explicit mask (the vision prefill's mrope
        positions assume it): last-token logits [B, V] and each row's mrope offset [B]."""
        device = self.device
        T = max(len(r) for r in rows)
        # Left padding puts every row's last token in column T-1, so `logits_to_keep=1` works.
        ids_BT = to_device([[*[0] * (T - len(row)), *row] for row in rows], device)
        pad_B = T - lengths_B
        col_T = torch.arange(T, device=device)
        source_col_BT = (col_T[None, :] + pad_B[:, None]).clamp(max=T - 1)
        q, k = col_T[:, None], col_T[None, :]
        # Padding queries attend to themselves only, so no row of the softmax is empty (NaN).
        mask = (k <= q)[None] & ((k >= pad_B[:, None, None]) | (k == q)[None])
        write = PrefillWrite(
            cache=self.cache, slot_J=slot_J, row_J=row_J, source_col_BT=source_col_BT
        )
        # Eager, outside the KV write: the vision tower's attention is its own.
        embeds_BTH, positions_BT, delta_B = self.vision.embed(self.model, ids_BT, pad_B, row_images)
        logits_BV = self._forward_last_logits(
            ids_BT, mask[:, None], positions_BT, write, inputs_embeds=embeds_BTH
        )
        return logits_BV, delta_B

    def _write_label_logprobs(
        self, logits_JV: torch.Tensor, items: list[WorkItem], slot_J: torch.Tensor
    ) -> None:
        """log softmax of the unscaled logits at each item's label ids (0-padded to K)."""
        padded = [[*it.label_token_ids, *[0] * MAX_LABEL_TOKENS][:MAX_LABEL_TOKENS] for it in items]
        label_JK = to_device(padded, self.device)
        logprob_JV = torch.log_softmax(logits_JV.float(), dim=-1)
        self.label_logprob_SK[slot_J] = logprob_JV.gather(-1, label_JK)

    def read_label_logprobs(self, slots: list[int]) -> list[list[float]]:
        """Each slot's label logprobs row (MAX_LABEL_TOKENS; its item's ids come first)."""
        index = torch.tensor(slots, device=self.device)
        return self.label_logprob_SK[index].cpu().tolist()

    # -- CUDA graphs ----------------------------------------------------------------------------

    def set_decode_rows(self, slots: Sequence[int]) -> int:
        """Make the next decode steps' batch the smallest bucket that holds `slots` (distinct,
        e.g. the active ones), padded with other slots; returns the bucket (the batch size).

        Padding rows are slots outside `slots`, so a step never writes one slot twice; they
        compute what an idle slot does (trash column, KV rows nobody reads) when idle.
        """
        S = self.cache.num_slots
        batch = next(b for b in self.batch_buckets if b >= len(slots))
        if batch == S:
            rows = tuple(range(S))  # the identity: the fallbacks read the cache as it lies
        else:
            chosen = set(slots)
            padding = [s for s in range(S) if s not in chosen][: batch - len(slots)]
            rows = (*slots, *padding)
        if rows != self._rows:  # one small host-to-device copy, ordered on the engine's stream
            self.row_slot_S[:batch].copy_(to_device(rows, self.device))
            self._rows = rows
        self.batch = batch
        return batch

    def run_decode_step(self, flags: Flags, span: int, *, use_graph: bool = True) -> None:
        """One decode step over the rows set_decode_rows chose: the captured graph's replay, or
        eager without graphs (or asked)."""
        batch = self.batch
        self.bucket_steps[batch] += 1
        if not (use_graph and self.use_cuda_graph):
            self._decode_step(flags, span, batch)
            return
        self._graphs[(*flags.as_key(), span, batch)].replay()

    def _capture_all(self, flags: Flags) -> None:
        """One graph per (span, batch bucket) for these flags, if not captured yet."""
        missing = [
            (span, batch)
            for span in self.spans
            for batch in self.batch_buckets
            if (*flags.as_key(), span, batch) not in self._graphs
        ]
        if missing:
            # One capture at a time in the process, never beside another thread's device
            # synchronisation (a compile's autotuning, a placement switch, empty_cache): entering
            # torch.cuda.graph synchronises the device and empties the allocator's cache, which
            # asserts no capture is underway; a sync elsewhere invalidates ours.
            asked = time.perf_counter()
            with capturing():
                start = time.perf_counter()
                for span, batch in missing:
                    self._capture(flags, span, batch)
            # The first step's warm-up is minutes at real sizes: say where it goes.
            logger.info(
                "captured %d decode graphs (spans %s, batches %s) in %.1f s, after waiting "
                "%.1f s for other threads' device synchronisations",
                len(missing),
                sorted({span for span, _ in missing}),
                sorted({batch for _, batch in missing}),
                time.perf_counter() - start,
                start - asked,
            )

    def _capture(self, flags: Flags, span: int, batch: int) -> None:
        # Called with every slot idle (start of a run): warm-up steps then change nothing that
        # matters (idle slots write to the trash column and to KV rows no sequence owns).
        assert not bool(self.active_S.any()), "CUDA graph capture needs every slot idle"
        assert self.stream is not None, "CUDA graphs need the engine's stream"
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # lets cuBLAS and SDPA pick and allocate their workspaces
                self._decode_step(flags, span, batch)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread (a GenRM, a trainer) may use CUDA meanwhile. The
            # stream is ours: torch's default capture stream is one per process, which two
            # engines capturing in two threads would share.
            with torch.cuda.graph(
                graph, pool=self._graph_pool, stream=self.stream, capture_error_mode="thread_local"
            ):
                self._decode_step(flags, span, batch)
        except RuntimeError as exc:
            raise RuntimeError(
                "capturing the decode step in a CUDA graph failed (an op synchronised with the "
                "host or is not capturable for this model); pass EngineConfig(use_cuda_graph="
                f"False) to run it eagerly. Cause: {type(exc).__name__}: {exc}"
            ) from exc
        self._graphs[(*flags.as_key(), span, batch)] = graph

    def release_graphs(self) -> None:
        """Drop captured graphs and their memory pool (before sleep); recaptured on next use."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._graph_pool = None

    def reset_state(self) -> None:
        """Refill the KV cache and every slot buffer (after a wake-up they hold garbage).

        Zeroing the cache matters for correctness: masked-out cache positions still enter the
        attention product with weight 0, and 0 * NaN is NaN.
        """
        self.cache.reset()
        for buffer in (
            self.input_tok_S,
            self.pos_S,
            self.gen_len_S,
            self.key_S,
            self.top_k_S,
            self.rope_delta_S,
        ):
            buffer.zero_()
        for buffer in (
            self.limit_S,
            self.temperature_S,
            self.top_p_S,
            self.repetition_penalty_S,
            self.adapter_on_S,
        ):
            buffer.fill_(1)
        self.min_p_S.zero_()
        self.active_S.zero_()
        self.response_SL.zero_()
        self.history_SL.zero_()
        self.logprob_SL.zero_()
        # Slots holding a finished sample's KV for its conversation's next turn (host state;
        # the KV is gone with a reset). Read and written by the loop's thread only.
        self.kept: dict[int, Kept] = {}
        self.row_slot_S.copy_(torch.arange(self.cache.num_slots))
        self._rows, self.batch = None, self.cache.num_slots
        self.arange_L.copy_(torch.arange(self.cache.max_seq_len))

    # -- what the host loop calls ---------------------------------------------------------------

    def begin(self, sampling: SamplingParams, stop_ids: list[int]) -> Flags:
        """Set the sampling configuration every slot shares, idle all slots, capture graphs."""
        if len(stop_ids) > MAX_STOP_TOKENS:
            raise ValueError(
                f"SamplingParams.stop_token_ids has {len(stop_ids)} ids (EOS included); the "
                f"built-in engine supports at most {MAX_STOP_TOKENS}"
            )
        self.stop_ids_K.fill_(-1)
        if stop_ids:
            self.stop_ids_K[: len(stop_ids)] = to_device(stop_ids, self.device)
        self.temperature_S.fill_(sampling.temperature if sampling.temperature > 0 else 1.0)
        self.top_p_S.fill_(sampling.top_p)
        self.top_k_S.fill_(sampling.top_k)
        self.min_p_S.fill_(sampling.min_p)
        self.repetition_penalty_S.fill_(sampling.repetition_penalty)
        flags = Flags(
            is_greedy=sampling.temperature == 0,
            is_truncated=sampling.top_p < 1.0 or sampling.top_k > 0 or sampling.min_p > 0,
            is_penalized=sampling.repetition_penalty != 1.0,
        )
        self.active_S.zero_()
        # Distinct rows in every bucket's prefix (the captures' warm-up steps write their rows).
        self.set_decode_rows(range(self.cache.num_slots))
        if self.use_cuda_graph:
            self._capture_all(flags)
        self.last_flags = flags
        return flags

    def read_slots(self) -> tuple[list[int], list[int], list[int]]:
        """(active, gen_len, pos) per slot: the host sync, one small device-to-host copy."""
        state = torch.stack([self.active_S.long(), self.gen_len_S, self.pos_S]).cpu()
        return state[0].tolist(), state[1].tolist(), state[2].tolist()

    def read_responses(self, slots: list[int], width: int) -> tuple[list, list]:
        """Tokens and logprobs of `slots`, the first `width` columns each (host lists)."""
        index = torch.tensor(slots, device=self.device)
        tokens = self.response_SL[index, :width].cpu().tolist()
        return tokens, self.logprob_SL[index, :width].cpu().tolist()

    def deactivate(self, slots: list[int] | None = None) -> None:
        """Stop generating in `slots` (all when None); their state stays until refilled."""
        if slots is None:
            self.active_S.zero_()
        elif slots:
            self.active_S.index_fill_(0, to_device(slots, self.device), False)
