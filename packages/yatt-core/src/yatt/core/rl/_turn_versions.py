"""The policy version of each token of a multi-turn trajectory (off-policy steps).

A trajectory's turns are separate engine calls, and the weights may change between them (a
push while its tools run), so one version per trajectory would be wrong for the later turns.
VersionRecordingEngine wraps a rollout engine: each call reads version() when it starts and
notes, per conversation (Request.session_id: a trajectory's turns share one), that version and
how many tokens the call sampled. token_versions then spreads them over the response:

    response_ids  [turn 1 sampled][tool / template ids][turn 2 sampled]
    loss_mask     [1 ...        1][0 ...             0][1 ...        1]
    calls noted   (v1, n1)                             (v2, n2)          v1 <= v2
    versions      [v1 ...      v1][v1 ...           v1][v2 ...      v2]

The ids between turns take the version of the turn before them: no loss or metric reads them
(mask 0), and the versions stay non-decreasing, as yatt.core.rollout_samples requires.

Why the version read at a call's start never under-states a token's age: the trainer moves the
version only after a push has finished, so the engine holds that version's weights or newer
ones when the call starts (the built-in engine runs a push alone, between its calls; an engine
that takes new weights mid-call only makes the tokens after the push newer than noted).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any


class VersionRecordingEngine:
    """A rollout engine that notes, per conversation (Request.session_id), the policy version
    each call started under and the tokens it sampled; every other attribute is the wrapped
    engine's. Requests without a session id are not noted. One per rollout call: the notes are
    written from that call's event loop (not thread-safe) and read once (token_versions)."""

    def __init__(self, engine: Any, version: Callable[[], int]) -> None:
        self._engine = engine
        self._version = version
        self._calls: dict[str, list[tuple[int, int]]] = {}  # session -> [(version, n)] in order

    def __getattr__(self, name: str) -> Any:  # tokenizer, config, release_sessions, ...
        if name.startswith("__") or name in ("_engine", "_version", "_calls"):
            raise AttributeError(name)  # not set yet (copy, pickle): no recursion
        return getattr(self._engine, name)

    def generate(self, requests: Sequence[Any], sampling: Any) -> list[Any]:
        version = self._version()
        completions = self._engine.generate(requests, sampling)
        for completion in completions:
            self._note(requests, completion, version)
        return completions

    def stream(self, requests: Sequence[Any], sampling: Any) -> AsyncIterator[Any]:
        version = self._version()  # now, before the engine takes the call
        return self._noted(self._engine.stream(requests, sampling), requests, version)

    async def _noted(
        self, completions: AsyncIterator[Any], requests: Sequence[Any], version: int
    ) -> AsyncIterator[Any]:
        try:
            async for completion in completions:
                self._note(requests, completion, version)
                yield completion
        finally:  # closed early (a cancelled trajectory): the engine's call ends now too
            aclose = getattr(completions, "aclose", None)
            if aclose is not None:
                await aclose()

    def _note(self, requests: Sequence[Any], completion: Any, version: int) -> None:
        session_id = requests[completion.request_index].session_id
        if session_id is not None:
            num_tokens = len(completion.response_ids)
            self._calls.setdefault(session_id, []).append((version, num_tokens))

    def token_versions(self, trajectory: Any) -> list[int]:
        """One version per token of `trajectory.response_ids` (the layout in the module
        docstring), from the calls noted under its session_id (forgotten here). A
        RuntimeError when those calls sampled other than the trajectory's mask-1 tokens (a
        turn that did not go through this engine)."""
        calls = self._calls.pop(trajectory.session_id, [])
        mask = list(trajectory.loss_mask)
        if sum(num_tokens for _, num_tokens in calls) != sum(mask):
            raise RuntimeError(
                f"trajectory of session {trajectory.session_id!r}: {sum(mask)} sampled tokens, "
                f"but the calls noted for it sampled {[n for _, n in calls]}"
            )
        # each sampled token's version, in order; a turn that sampled nothing adds none
        sampled = iter([version for version, num_tokens in calls for _ in range(num_tokens)])
        versions: list[int] = []
        current = calls[0][0] if calls else self._version()
        for is_sampled in mask:
            if is_sampled:
                current = next(sampled)
            versions.append(current)
        return versions
