"""What the vLLM and SGLang adapters share: generate/stream over one blocking `_run(jobs, emit)`.

An adapter implements `_prepare(requests, sampling) -> jobs` and `_run(jobs, emit)`, which drives
its engine and calls `emit(completion)` as each one finishes; `generate` collects them and
`stream` runs `_run` on a worker thread feeding an async iterator.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence

from yatt.rollout._requests import validate_requests
from yatt.rollout._streaming import stream_from_thread
from yatt.rollout._types import Completion, Request, SamplingParams


class ThreadedAdapter:
    _thread_name = "yatt-adapter"
    vocab_size: int
    max_seq_len: int
    is_multimodal: bool
    # Serves a synced LoRA adapter (its config's enable_lora): then a request may turn it off
    # (Request.use_adapter=False), which both engines take per request in one batch.
    serves_lora: bool = False

    @property
    def accepts_images(self) -> bool:
        """Whether the served model takes Request.images (its engine says it is multimodal)."""
        return self.is_multimodal

    def generate(self, requests: Sequence[Request], sampling: SamplingParams) -> list[Completion]:
        out: list[Completion] = []
        self._run(self._prepare(requests, sampling), out.append)
        return sorted(out, key=lambda c: (c.request_index, c.sample_index))

    def stream(
        self, requests: Sequence[Request], sampling: SamplingParams
    ) -> AsyncIterator[Completion]:
        jobs = self._prepare(requests, sampling)
        return stream_from_thread(
            lambda emit: self._run(jobs, emit), abort=self.abort, name=self._thread_name
        )

    def _validate_and_seed(self, requests: Sequence[Request], sampling: SamplingParams) -> int:
        """Validate the call against the served model; the base seed of its samples."""
        validate_requests(
            requests,
            sampling,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            accepts_images=self.is_multimodal,
            accepts_adapter_off=self.serves_lora,
        )
        return sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(7))
