"""Continuous batching over a fixed set of slots: prefill into free slots, decode all slots.

    queue of samples --prefill (eager, chunked)--> slots 0..S-1 --decode step x k--> host check
          ^                                                                              |
          +------------- finished slots are harvested and refilled from the queue <------+

Every tensor the decode step touches is preallocated with a fixed shape, so on CUDA the step
(model forward + sampling + bookkeeping) is captured in CUDA graphs and replayed. The host looks
at the slots only every `steps_per_sync` steps (one small device-to-host copy); finished slots
idle until then, which costs at most k-1 wasted steps per finished slot.

Attention reads cache positions [0, span) only. Spans are buckets (64, 128, ..., L), one graph
each; at every host check the smallest bucket that holds the longest active sequence for the
next k steps is chosen, so short sequences do not pay for a long max_seq_len.

Per slot s (S slots, L = max_seq_len):
  input_tok_S[s]  last token, whose key/value the next step writes at position pos_S[s]
  gen_len_S[s]    tokens generated so far; response g sits in response_SL[s, g]
  limit_S[s]      generation stops when gen_len reaches it: min(item's max_new_tokens, L - prompt)
  active_S[s]     still generating; idle slots compute garbage and write to column L (trash)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from yatt.rollout._sampling import sample_tokens
from yatt.rollout._static_kv import DecodeWrite, PrefillWrite, StaticKVCache, writing_kv
from yatt.rollout._types import Completion, FinishReason, Request, SamplingParams

MAX_STOP_TOKENS = 32
MIN_SPAN = 64  # smallest attention bucket; below this a step is bound by launches, not reads


def span_buckets(max_seq_len: int) -> list[int]:
    """Attention spans with one decode graph each: powers of two from MIN_SPAN, then L."""
    spans = []
    span = MIN_SPAN
    while span < max_seq_len:
        spans.append(span)
        span *= 2
    return [*spans, max_seq_len]


class StopSignal(Protocol):
    """Anything with `is_set()`: a threading.Event, or several combined."""

    def is_set(self) -> bool: ...


@dataclass(kw_only=True)
class WorkItem:
    """One sample to generate."""

    request_index: int
    sample_index: int
    request: Request
    request_id: str
    key: int  # counter-based RNG key, from (seed, request_index, sample_index)
    max_new_tokens: int  # the request's own limit if it sets one, else the call's


@dataclass(kw_only=True)
class _Flags:
    is_greedy: bool
    is_truncated: bool

    def as_key(self) -> tuple[bool, bool]:
        return (self.is_greedy, self.is_truncated)


class SlotRunner:
    """Owns the per-slot state and runs one generate call at a time over it."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: StaticKVCache,
        *,
        use_cuda_graph: bool,
        steps_per_sync: int,
        max_prefill_tokens: int,
    ) -> None:
        self.model = model
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
        self.top_k_S = torch.zeros(S, **zeros)
        self.active_S = torch.zeros(S, dtype=torch.bool, device=device)
        self.temperature_S = torch.ones(S, dtype=torch.float32, device=device)
        self.top_p_S = torch.ones(S, dtype=torch.float32, device=device)
        self.stop_ids_K = torch.full((MAX_STOP_TOKENS,), -1, **zeros)
        self.response_SL = torch.zeros(S, L + 1, **zeros)
        self.logprob_SL = torch.zeros(S, L + 1, dtype=torch.float32, device=device)
        self.slot_ids_S = torch.arange(S, device=device)
        self.arange_L = torch.arange(L, device=device)
        self.spans = span_buckets(L)
        self.reset_state()
        self._graphs: dict[tuple[bool, bool, int], torch.cuda.CUDAGraph] = {}
        self._graph_pool = None
        # One side stream for every capture's warm-up: each new stream would get its own cuBLAS
        # workspace, which lives until the workspaces are cleared at sleep.
        self._side_stream = None

    # -- device steps -------------------------------------------------------------------------

    def _forward_last_logits(self, input_ids, mask, position_ids, write) -> torch.Tensor:
        with writing_kv(write):
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=1,
            )
        return out.logits[:, -1]

    def _decode_step(self, flags: _Flags, span: int) -> None:
        L = self.cache.max_seq_len
        visible_SP = self.arange_L[None, :span] <= self.pos_S[:, None]
        # Additive, in the activations' dtype: what SDPA's fused kernels take without a
        # conversion per layer. Position 0 is always visible, so no softmax row is empty.
        mask = torch.where(visible_SP, 0.0, float("-inf")).to(self.cache.keys[0].dtype)
        logits_SV = self._forward_last_logits(
            self.input_tok_S[:, None],
            mask[:, None, None, :],
            self.pos_S[:, None],
            DecodeWrite(cache=self.cache, pos_S=self.pos_S, span=span),
        )
        token_S, logprob_S = sample_tokens(
            logits_SV,
            temperature_S=self.temperature_S,
            top_p_S=self.top_p_S,
            top_k_S=self.top_k_S,
            key_S=self.key_S,
            counter_S=self.gen_len_S,
            is_greedy=flags.is_greedy,
            is_truncated=flags.is_truncated,
        )
        active_S = self.active_S
        column_S = self.slot_ids_S * (L + 1) + torch.where(active_S, self.gen_len_S, L)
        self.response_SL.view(-1).index_copy_(0, column_S, token_S)
        self.logprob_SL.view(-1).index_copy_(0, column_S, logprob_S)
        gen_len_S = self.gen_len_S + active_S.long()
        is_stop_S = (token_S[:, None] == self.stop_ids_K[None, :]).any(dim=-1)
        # active_S aliases the buffer: every read of it comes before it is overwritten (last).
        self.pos_S.copy_(torch.where(active_S, self.pos_S + 1, self.pos_S).clamp(max=L - 1))
        self.gen_len_S.copy_(gen_len_S)
        self.input_tok_S.copy_(token_S)
        self.active_S.copy_(active_S & ~is_stop_S & (gen_len_S < self.limit_S))

    def _prefill(self, items: list[WorkItem], slots: list[int], flags: _Flags) -> None:
        """Prompts of `items` into `slots`, and each slot's first token sampled."""
        device, L = self.device, self.cache.max_seq_len
        # Samples of one request are adjacent in the queue: prefill their prompt once.
        rows: list[list[int]] = []
        row_of_item: list[int] = []
        for i, item in enumerate(items):
            if i == 0 or item.request_index != items[i - 1].request_index:
                rows.append(item.request.prompt_ids)
            row_of_item.append(len(rows) - 1)
        lengths_B = torch.tensor([len(r) for r in rows], device=device)
        T = max(len(r) for r in rows)
        # Left padding puts every row's last token in column T-1, so `logits_to_keep=1` works.
        ids_BT = torch.zeros(len(rows), T, dtype=torch.long)
        for b, row in enumerate(rows):
            ids_BT[b, T - len(row) :] = torch.tensor(row)
        ids_BT = ids_BT.to(device)
        pad_B = T - lengths_B
        col_T = torch.arange(T, device=device)
        positions_BT = (col_T[None, :] - pad_B[:, None]).clamp(min=0)
        source_col_BT = (col_T[None, :] + pad_B[:, None]).clamp(max=T - 1)
        q, k = col_T[:, None], col_T[None, :]
        # Padding queries attend to themselves only, so no row of the softmax is empty (NaN).
        mask = (k <= q)[None] & ((k >= pad_B[:, None, None]) | (k == q)[None])
        slot_J = torch.tensor(slots, device=device)
        row_J = torch.tensor(row_of_item, device=device)
        write = PrefillWrite(
            cache=self.cache, slot_J=slot_J, row_J=row_J, source_col_BT=source_col_BT
        )
        logits_JV = self._forward_last_logits(ids_BT, mask[:, None], positions_BT, write)[row_J]
        self.key_S[slot_J] = torch.tensor([it.key for it in items], device=device)
        token_J, logprob_J = sample_tokens(
            logits_JV,
            temperature_S=self.temperature_S[slot_J],
            top_p_S=self.top_p_S[slot_J],
            top_k_S=self.top_k_S[slot_J],
            key_S=self.key_S[slot_J],
            counter_S=torch.zeros_like(slot_J),
            is_greedy=flags.is_greedy,
            is_truncated=flags.is_truncated,
        )
        prompt_len_J = lengths_B[row_J]
        max_new_J = torch.tensor([item.max_new_tokens for item in items], device=device)
        limit_J = torch.minimum(L - prompt_len_J, max_new_J)
        self.response_SL[slot_J, 0] = token_J
        self.logprob_SL[slot_J, 0] = logprob_J
        self.gen_len_S[slot_J] = 1
        self.pos_S[slot_J] = prompt_len_J
        self.input_tok_S[slot_J] = token_J
        self.limit_S[slot_J] = limit_J
        is_stop_J = (token_J[:, None] == self.stop_ids_K[None, :]).any(dim=-1)
        self.active_S[slot_J] = ~is_stop_J & (limit_J > 1)

    # -- CUDA graphs ----------------------------------------------------------------------------

    def _run_decode_step(self, flags: _Flags, span: int) -> None:
        if not self.use_cuda_graph:
            self._decode_step(flags, span)
            return
        self._graphs[(*flags.as_key(), span)].replay()

    def _capture_all(self, flags: _Flags) -> None:
        """One graph per span bucket for these flags, if not captured yet."""
        for span in self.spans:
            if (*flags.as_key(), span) not in self._graphs:
                self._capture(flags, span)

    def _capture(self, flags: _Flags, span: int) -> None:
        # Called with every slot idle (start of a call): warm-up steps then change nothing that
        # matters (idle slots write to the trash column and to KV rows no sequence owns).
        assert not bool(self.active_S.any()), "CUDA graph capture needs every slot idle"
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.device)
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # lets cuBLAS and SDPA pick and allocate their workspaces
                self._decode_step(flags, span)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread (a GenRM, a trainer) may use CUDA meanwhile.
            with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
                self._decode_step(flags, span)
        except RuntimeError as exc:
            raise RuntimeError(
                "capturing the decode step in a CUDA graph failed (an op synchronised with the "
                "host or is not capturable for this model); pass EngineConfig(use_cuda_graph="
                "False) to run it eagerly"
            ) from exc
        self._graphs[(*flags.as_key(), span)] = graph

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
        for buffer in (self.input_tok_S, self.pos_S, self.gen_len_S, self.key_S, self.top_k_S):
            buffer.zero_()
        for buffer in (self.limit_S, self.temperature_S, self.top_p_S):
            buffer.fill_(1)
        self.active_S.zero_()
        self.response_SL.zero_()
        self.logprob_SL.zero_()
        self.slot_ids_S.copy_(torch.arange(self.cache.num_slots))
        self.arange_L.copy_(torch.arange(self.cache.max_seq_len))

    # -- host loop ------------------------------------------------------------------------------

    def _configure(self, sampling: SamplingParams, stop_ids: list[int]) -> _Flags:
        if len(stop_ids) > MAX_STOP_TOKENS:
            raise ValueError(
                f"SamplingParams.stop_token_ids has {len(stop_ids)} ids (EOS included); the "
                f"built-in engine supports at most {MAX_STOP_TOKENS}"
            )
        self.stop_ids_K.fill_(-1)
        if stop_ids:
            self.stop_ids_K[: len(stop_ids)] = torch.tensor(stop_ids, device=self.device)
        self.temperature_S.fill_(sampling.temperature if sampling.temperature > 0 else 1.0)
        self.top_p_S.fill_(sampling.top_p)
        self.top_k_S.fill_(sampling.top_k)
        return _Flags(
            is_greedy=sampling.temperature == 0,
            is_truncated=sampling.top_p < 1.0 or sampling.top_k > 0,
        )

    def run(
        self,
        items: list[WorkItem],
        sampling: SamplingParams,
        stop_ids: list[int],
        emit: Callable[[Completion], None],
        should_stop: StopSignal,
    ) -> None:
        """Generate every item, calling `emit` once per item as it finishes."""
        flags = self._configure(sampling, stop_ids)
        stop_set = set(stop_ids)
        self.active_S.zero_()
        if self.use_cuda_graph:
            self._capture_all(flags)
        S, L = self.cache.num_slots, self.cache.max_seq_len
        queue = deque(items)
        occupant: list[WorkItem | None] = [None] * S
        while True:
            is_aborting = should_stop.is_set()
            free = [s for s in range(S) if occupant[s] is None]
            if free and queue and not is_aborting:
                self._admit(queue, free, occupant, flags)
            # Host sync: one small copy tells which slots finished and how long they are.
            state = torch.stack([self.active_S.long(), self.gen_len_S, self.pos_S]).cpu()
            active, gen_len, pos = state[0].tolist(), state[1].tolist(), state[2].tolist()
            done = [s for s in range(S) if occupant[s] is not None and not active[s]]
            if is_aborting:
                done = [s for s in range(S) if occupant[s] is not None]
            if done:
                self._harvest(done, occupant, gen_len, active, stop_set, emit)
            if is_aborting:
                self.active_S.zero_()
                for item in queue:
                    emit(_completion(item, [], [], "abort"))
                return
            if not queue and all(o is None for o in occupant):
                return
            running = [pos[s] for s in range(S) if occupant[s] is not None and active[s]]
            if running:
                # The k steps until the next check write positions up to max(pos) + k - 1.
                needed = min(max(running) + self.steps_per_sync, L)
                span = next(span for span in self.spans if span >= needed)
                for _ in range(self.steps_per_sync):
                    self._run_decode_step(flags, span)

    def _admit(self, queue, free: list[int], occupant, flags: _Flags) -> None:
        num_admitted = 0
        chunk: list[WorkItem] = []
        longest = 0
        while queue and num_admitted + len(chunk) < len(free):
            n = len(queue[0].request.prompt_ids)
            # Chunk prefills so one forward pass stays within max_prefill_tokens.
            if chunk and (len(chunk) + 1) * max(longest, n) > self.max_prefill_tokens:
                num_admitted += self._prefill_into(chunk, free[num_admitted:], occupant, flags)
                chunk, longest = [], 0
                continue
            chunk.append(queue.popleft())
            longest = max(longest, n)
        if chunk:
            self._prefill_into(chunk, free[num_admitted:], occupant, flags)

    def _prefill_into(self, chunk: list[WorkItem], free: list[int], occupant, flags) -> int:
        slots = free[: len(chunk)]
        self._prefill(chunk, slots, flags)
        for item, slot in zip(chunk, slots, strict=True):
            occupant[slot] = item
        return len(chunk)

    def _harvest(self, done, occupant, gen_len, active, stop_set, emit) -> None:
        index = torch.tensor(done, device=self.device)
        width = max(gen_len[s] for s in done)
        tokens = self.response_SL[index, :width].cpu().tolist()
        logprobs = self.logprob_SL[index, :width].cpu().tolist()
        for row, s in enumerate(done):
            item, n = occupant[s], gen_len[s]
            response = tokens[row][:n]
            if n and response[-1] in stop_set:
                reason: FinishReason = "stop"
            elif active[s]:
                reason = "abort"
            else:
                reason = "length"
            emit(_completion(item, response, logprobs[row][:n], reason))
            occupant[s] = None


def _completion(item: WorkItem, response, logprobs, reason: FinishReason) -> Completion:
    return Completion(
        request_index=item.request_index,
        sample_index=item.sample_index,
        prompt_ids=list(item.request.prompt_ids),
        response_ids=response,
        logprobs=logprobs,
        finish_reason=reason,
        request_id=item.request_id,
        metadata=dict(item.request.metadata),
    )
