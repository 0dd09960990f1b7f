"""The host side of continuous batching: one loop over the slots, fed by one or more calls.

    call A items --+                                                   +--> A's emit
    call B items --+--> queue --admit (prefill)--> slots --decode x k--+--> B's emit
       (joined at a host check)                        host check: harvest finished slots

Each `step()` is one host check: take the items of calls that joined since the last check,
drop those of cancelled calls, admit queued items into free slots, read which slots finished
(the one small device-to-host copy), hand each finished sample to its own call, then run
`steps_per_sync` decode steps. Every sample carries its own call (`WorkItem.owner`), key and
limit, so a sample is the same whichever calls shared its loop. The decode steps run over the
running slots only (the smallest batch bucket that holds them; see _batcher.py).

Conversations kept between turns (Request.session_id): a finished sample of a session leaves
its KV in its slot (runner.kept), and the slot is not free. The session's next request, if its
prompt extends the kept tokens, is admitted into that slot and prefills only the new tokens
(the tool results, which may hold images: builtin/_vision.py). A kept slot is freed when a queued sample needs a slot and none is free
(oldest first), after `kept_ttl_s` unused (a tool that timed out, a trajectory that ended
without release), when its session is released, or when the KV cache is reset.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from yatt.rollout._types import Completion, FinishReason
from yatt.rollout.builtin._batcher import Flags, Kept, SlotRunner, WorkItem

Emit = Callable[[Completion], None]


@dataclass(eq=False, kw_only=True)
class Call:
    """One generate() or stream() call: its samples and where its completions go."""

    items: list[WorkItem]
    emit: Emit
    cancelled: threading.Event = field(default_factory=threading.Event)  # the caller left
    num_left: int = 0  # samples not yet emitted (the loop's thread only)
    is_dropped: bool = False  # cancelled, and its samples removed from the loop
    is_done: bool = False  # nothing more will be emitted; set under the scheduler's lock
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.num_left = len(self.items)
        for item in self.items:
            item.owner = self


class SlotLoop:
    """The state of one run of the slot loop: the queue and which sample holds each slot."""

    def __init__(
        self,
        runner: SlotRunner,
        *,
        flags: Flags,
        stop_ids: Collection[int],
        abort: threading.Event,
        kept_ttl_s: float = 60.0,
        released: set[str] | None = None,
        lock: threading.Lock | None = None,
    ) -> None:
        self.runner = runner
        self.kept_ttl_s = kept_ttl_s
        # Sessions whose kept KV the engine was asked to drop (any thread adds, under `lock`).
        self.released = released if released is not None else set()
        self.lock = lock if lock is not None else threading.Lock()
        self.flags = flags
        self.stop_set = set(stop_ids)
        self.abort = abort  # the engine-wide abort(): every call's samples end now
        self.queue: deque[WorkItem] = deque()
        self.occupant: list[WorkItem | None] = [None] * runner.cache.num_slots

    def has_work(self) -> bool:
        return bool(self.queue) or any(item is not None for item in self.occupant)

    def step(self, new_items: list[WorkItem], dropped: Collection[Call]) -> None:
        """One host check (see the module docstring) and, if slots run, k decode steps."""
        runner, occupant = self.runner, self.occupant
        S, L = len(occupant), runner.cache.max_seq_len
        self.queue.extend(new_items)
        if dropped:
            # A cancelled call's queued samples go, and its running ones stop without output.
            self.queue = deque(item for item in self.queue if item.owner not in dropped)
            stale = [
                s for s in range(S) if occupant[s] is not None and occupant[s].owner in dropped
            ]
            for s in stale:
                occupant[s] = None
            runner.deactivate(stale)
        is_aborting = self.abort.is_set()
        self._expire_kept()
        if self.queue and not is_aborting:
            self._continue_kept()
        free = [s for s in range(S) if occupant[s] is None and s not in runner.kept]
        if len(free) < len(self.queue) and runner.kept and not is_aborting:
            free += self._evict_kept(len(self.queue) - len(free))
        if free and self.queue and not is_aborting:
            self._admit(free)
        # Host sync: one small copy tells which slots finished and how long they are.
        active, gen_len, pos = runner.read_slots()
        done = [s for s in range(S) if occupant[s] is not None and not active[s]]
        if is_aborting:
            done = [s for s in range(S) if occupant[s] is not None]
        if done:
            self._harvest(done, gen_len, active)
        if is_aborting:
            runner.deactivate()
            while self.queue:
                item = self.queue.popleft()
                _deliver(item, _completion(item, [], [], "abort"))
            return
        running = [s for s in range(S) if occupant[s] is not None and active[s]]
        if running:
            # The k steps until the next check write positions up to max(pos) + k - 1.
            needed = min(max(pos[s] for s in running) + runner.steps_per_sync, L)
            span = next(span for span in runner.spans if span >= needed)
            # Only the running slots decode (in the smallest batch bucket that holds them):
            # between checks slots only finish, never start, so the bucket stays big enough.
            runner.set_decode_rows(running)
            for _ in range(runner.steps_per_sync):
                runner.run_decode_step(self.flags, span)

    def _expire_kept(self) -> None:
        kept = self.runner.kept
        with self.lock:
            released = set(self.released)
            self.released.clear()  # in place: the engine holds this set
        if not kept:
            return
        now = time.monotonic()
        for slot in [
            s
            for s, k in kept.items()
            if k.session_id in released or now - k.last_used_s > self.kept_ttl_s
        ]:
            del kept[slot]

    def _continue_kept(self) -> None:
        """Queued samples of kept sessions into their slots, prefilling their new tokens."""
        kept = self.runner.kept
        by_session = {k.session_id: slot for slot, k in kept.items()}
        items, slots, starts = [], [], []
        for item in list(self.queue):
            slot = by_session.get(item.request.session_id)
            if slot is None or slot in slots:
                continue
            ids, prompt = kept[slot].ids, item.request.prompt_ids
            # The kept KV was computed with (or without) the LoRA adapter: a turn that asks
            # otherwise prefills whole (lora_mode="beside" serves both from one cache).
            is_same_model = kept[slot].use_adapter == item.use_adapter
            kept_images = kept[slot].images
            del kept[slot]  # continued or stale: either way the slot is this item's now
            if (
                len(prompt) > len(ids)
                and prompt[: len(ids)] == ids
                and is_same_model
                and self._same_kept_images(kept_images, item, ids)
            ):
                items.append(item)
                slots.append(slot)
                starts.append(len(ids))
        if not items:
            return
        chosen = set(map(id, items))
        self.queue = deque(item for item in self.queue if id(item) not in chosen)
        # Every waiting continuation in as few forwards as max_prefill_tokens allows (padded
        # tokens per forward, as fresh prompts are chunked: 64 rows of 1k new tokens were one
        # 65k-token forward), fewest new tokens first so each chunk pads to a similar length.
        new_tokens = [
            len(item.request.prompt_ids) - start for item, start in zip(items, starts, strict=True)
        ]
        chunk: list[int] = []
        for j in sorted(range(len(items)), key=new_tokens.__getitem__):
            # Ascending: row j is the longest of the chunk it joins.
            if chunk and (len(chunk) + 1) * new_tokens[j] > self.runner.max_prefill_tokens:
                self._continue_into(chunk, items, slots, starts)
                chunk = []
            chunk.append(j)
        self._continue_into(chunk, items, slots, starts)

    def _same_kept_images(self, kept_images, item: WorkItem, kept_ids: list[int]) -> bool:
        """Whether the item's images begin with those whose features the kept KV holds."""
        vision = self.runner.vision
        if vision is None:
            return item.images is None and kept_images is None
        return vision.head_matches(kept_images, item.images, kept_ids)

    def _continue_into(self, chunk: list[int], items, slots, starts) -> None:
        """One continuation forward: items[j] into slots[j] from starts[j], for j in chunk."""
        self.runner.prefill_continuations(
            [items[j] for j in chunk],
            [slots[j] for j in chunk],
            [starts[j] for j in chunk],
            self.flags,
        )
        for j in chunk:
            self.occupant[slots[j]] = items[j]

    def _evict_kept(self, num_needed: int) -> list[int]:
        """Free up to `num_needed` kept slots, the longest unused first."""
        kept = self.runner.kept
        oldest = sorted(kept, key=lambda s: kept[s].last_used_s)[:num_needed]
        for slot in oldest:
            del kept[slot]
        return oldest

    def _admit(self, free: list[int]) -> None:
        queue, max_tokens = self.queue, self.runner.max_prefill_tokens
        admitted = [queue.popleft() for _ in range(min(len(free), len(queue)))]
        # Shortest prompts first, so each prefill chunk pads to a similar length (mixed
        # 300-1,300-token judge prompts padded to the chunk's longest wasted about a third).
        # Stable: a request's samples (adjacent, equal lengths) stay adjacent, prefilled once.
        admitted.sort(key=lambda item: len(item.request.prompt_ids))
        num_admitted = 0
        chunk: list[WorkItem] = []
        longest = 0
        for item in admitted:
            n = len(item.request.prompt_ids)
            # Chunk prefills so one forward pass stays within max_prefill_tokens.
            if chunk and (len(chunk) + 1) * max(longest, n) > max_tokens:
                num_admitted += self._prefill_into(chunk, free[num_admitted:])
                chunk, longest = [], 0
            chunk.append(item)
            longest = max(longest, n)
        if chunk:
            self._prefill_into(chunk, free[num_admitted:])

    def _prefill_into(self, chunk: list[WorkItem], free: list[int]) -> int:
        slots = free[: len(chunk)]
        self.runner.prefill(chunk, slots, self.flags)
        for item, slot in zip(chunk, slots, strict=True):
            self.occupant[slot] = item
        return len(chunk)

    def _harvest(self, done: list[int], gen_len: list[int], active: list[int]) -> None:
        tokens, logprobs = self.runner.read_responses(done, max(gen_len[s] for s in done))
        labels = None
        if any(self.occupant[s].label_token_ids for s in done):  # type: ignore[union-attr]
            labels = self.runner.read_label_logprobs(done)
        for row, s in enumerate(done):
            item, n = self.occupant[s], gen_len[s]
            assert item is not None
            response = tokens[row][:n]
            if n and response[-1] in self.stop_set:
                reason: FinishReason = "stop"
            elif active[s]:
                reason = "abort"
            else:
                reason = "length"
            completion = _completion(item, response, logprobs[row][:n], reason)
            if labels is not None and item.label_token_ids and n:
                completion.label_logprobs = labels[row][: len(item.label_token_ids)]
            self.occupant[s] = None
            session = item.request.session_id
            if session is not None and reason != "abort" and n:
                # Its KV holds the prompt and the response but its last token (never fed), and
                # the features of the prompt's images (a vision prompt's rope offset stays in
                # the slot's rope_delta_S).
                held = [*item.request.prompt_ids, *response[:-1]]
                self.runner.kept[s] = Kept(
                    session_id=session,
                    ids=held,
                    last_used_s=time.monotonic(),
                    use_adapter=item.use_adapter,
                    images=item.images,
                )
            _deliver(item, completion)


def _deliver(item: WorkItem, completion: Completion) -> None:
    call = item.owner
    assert isinstance(call, Call)
    call.num_left -= 1
    if call.cancelled.is_set():
        return  # the caller left: nobody reads it
    try:
        call.emit(completion)
    except Exception as exc:
        # One caller's broken sink (e.g. its event loop closed) ends that call only.
        call.error = exc
        call.cancelled.set()


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
