"""Run a stage call that reports progress through a callback, as an async stream of events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from stages.contracts import EventSink, StageEvent

T = TypeVar("T")
_DONE = object()


@dataclass
class Finished(Generic[T]):
    value: T


async def with_events(call: Callable[[EventSink], Awaitable[T]]) -> AsyncIterator[StageEvent | Finished[T]]:
    """Yields each StageEvent as `call` reports it, then Finished(result). Errors propagate; if the
    consumer stops early, the call is cancelled."""
    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(call(queue.put_nowait))
    task.add_done_callback(lambda _: queue.put_nowait(_DONE))
    try:
        while (item := await queue.get()) is not _DONE:
            yield item
        yield Finished(task.result())
    finally:
        if not task.done():
            task.cancel()
