"""Run a call that reports progress through a callback, as an async stream of what it reports.

The call runs in its own task. It is cancelled when the consumer stops reading before the end:
when the stream is closed (`aclosing`, `break` + close) or the consumer's await is cancelled (the
stream then ends only once the call has finished cleaning up), and also when the consumer's task
ends while the stream sits unclosed (a gRPC handler cancelled while it was sending): so a client
that goes away always cancels the work done for it, without waiting for garbage collection to
close an abandoned stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
E = TypeVar("E")
_DONE = object()


@dataclass
class Finished(Generic[T]):
    value: T


async def with_events(
    call: Callable[[Callable[[E], None]], Awaitable[T]],
) -> AsyncIterator[E | Finished[T]]:
    """Yields each item as `call` reports it through its sink, then Finished(result). Errors
    propagate; if the consumer stops early, the call is cancelled."""
    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(call(queue.put_nowait))
    task.add_done_callback(_end_of_stream(queue))
    consumer = asyncio.current_task()

    def consumer_ended(_: asyncio.Task) -> None:
        task.cancel()

    if consumer is not None:
        consumer.add_done_callback(consumer_ended)
    try:
        while (item := await queue.get()) is not _DONE:
            yield item
        yield Finished(task.result())
    finally:
        if consumer is not None:
            consumer.remove_done_callback(consumer_ended)
        if not task.done():
            task.cancel()
            # Let it stop and clean up (release what it holds) before the stream counts as closed;
            # asyncio.wait neither raises the call's error nor cancels it if we are cancelled again.
            await asyncio.wait([task])


def _end_of_stream(queue: asyncio.Queue) -> Callable[[asyncio.Future], None]:
    def done(task: asyncio.Future) -> None:
        if not task.cancelled():
            task.exception()  # retrieved here too: a consumer that left will never read it
        queue.put_nowait(_DONE)

    return done
