"""What an engine can do beyond `RolloutEngine`, as typed protocols a caller checks with
isinstance instead of probing attribute names with getattr:

    if isinstance(judge_engine, Abortable):
        judge_engine.abort()
    if isinstance(engine, AcceptsImages) and not engine.accepts_images:
        ...  # refuse image requests before sending any
    if isinstance(engine, SupportsLabelLogprobs) and engine.supports_label_logprobs:
        ...  # read Completion.label_logprobs

A protocol with a flag (`accepts_images`, `supports_label_logprobs`) says the engine *declares*
the capability; the flag's value says whether it has it. An engine that does not declare it
leaves the caller's default in force (the caller says which default is safe).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Abortable(Protocol):
    """An engine (or judge engine) whose in-flight requests can be cut short."""

    def abort(self) -> None:
        """Finish every in-flight request now with finish_reason="abort"."""
        ...


@runtime_checkable
class AcceptsImages(Protocol):
    """An engine that says whether the served model takes Request.images."""

    @property
    def accepts_images(self) -> bool: ...


@runtime_checkable
class SupportsLabelLogprobs(Protocol):
    """An engine that says whether its completions carry `label_logprobs` when
    SamplingParams.label_token_ids asks for them."""

    @property
    def supports_label_logprobs(self) -> bool: ...
