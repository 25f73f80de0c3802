"""One call at a time of an async function, shared by every caller who asks while it runs.

For what anyone may ask for at any rate and costs a gRPC call per replica each time: the gateway's
unauthenticated `GET /health` (a health check of every stage replica) and `GET /metrics` (every
replica's engine load). Without it, a thousand concurrent requests to either made a thousand calls
to each replica; with it, they wait for the one in flight and share its answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self, fn: Callable[[], Awaitable[T]]) -> None:
        self._fn = fn
        self._running: asyncio.Future[T] | None = None

    async def __call__(self) -> T:
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._fn())
            # Its outcome is read here even when every caller has gone (cancelled): no "exception
            # never retrieved" warning.
            self._running.add_done_callback(lambda f: f.cancelled() or f.exception())
        # shield: one caller cancelled (its client went away) does not cancel the others' call.
        return await asyncio.shield(self._running)
