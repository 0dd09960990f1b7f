"""Turn a blocking producer (an engine loop in a worker thread) into an async iterator.

    producer(emit) --worker thread--> emit(completion) --call_soon_threadsafe--> asyncio.Queue
                                                                                  |
    async for completion in stream: <-----------------------------------------------

The event loop never blocks on generation, so a consumer (the GenRM) can score each completion
while the rest are still being generated.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from yatt.rollout._types import Completion

Emit = Callable[[Completion], None]

_DONE = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def stream_from_thread(
    produce: Callable[[Emit], None], *, abort: Callable[[], None], name: str
) -> AsyncIterator[Completion]:
    """Run `produce(emit)` in a thread and yield what it emits, in emission order.

    If the consumer stops early (break, cancellation) while the producer is still producing,
    `abort` is called; the thread is joined either way, so the engine is free again when this
    generator closes. An exception in the producer is re-raised here.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    # Set by the worker as soon as produce() has returned or raised. The thread stays alive a
    # little longer, so "thread alive" does not mean "still producing": aborting then would hit
    # whatever the engine runs next (another overlapping stream's generation).
    is_produced = threading.Event()

    def put(item: object) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def work() -> None:
        try:
            produce(put)
        except BaseException as exc:
            is_produced.set()
            put(_Failed(exc))
        else:
            is_produced.set()
            put(_DONE)

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        if not is_produced.is_set():
            abort()
        if thread.is_alive():
            # Joined off the event loop: the producer may still be finishing a step.
            await asyncio.to_thread(thread.join)
