"""The front door's answers still in flight when its grace period ends: ended by the gateway with
a status of its own, not dropped.

At the end of `--grace-period` (or at the second signal) the gateway cancels the tasks still
answering (`CallsInFlight.cut`). Each answer's handler sees the cancel, asks `cutting`, and ends
with `shutdown_error`: UNAVAILABLE (HTTP 503) when nothing has reached the client (retrying is
safe), ABORTED (an SSE error event, HTTP 502) once tokens have (the client holds part of an
answer; UNAVAILABLE would invite a retry as if nothing had happened). Left to gRPC's and aiohttp's
own stop, a gRPC client got UNAVAILABLE "Cancelling all calls" after hundreds of tokens, an HTTP
client a dropped connection, and a streamed answer a cut chunk with no error and no [DONE].
Both APIs use it; the statuses map to HTTP as every other error does (`http_error_of`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from epd.stages.errors import EpdError, Unavailable
from epd.transport.errors import UpstreamError


class CallsInFlight:
    """The tasks answering a request now (aiohttp's per-connection tasks, gRPC's per-call ones)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self.cutting = False
        """Set by `cut`: a CancelledError in a handler is the shutdown's, not its client's."""

    @contextmanager
    def tracking(self) -> Iterator[None]:
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)

    def cut(self) -> list[asyncio.Task]:
        """Cancel every answer still in flight; returns their tasks."""
        self.cutting = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks

    async def cut_and_wait(self, timeout_s: float) -> None:
        """`cut`, then give the handlers `timeout_s` to send their statuses."""
        if tasks := self.cut():
            await asyncio.wait(tasks, timeout=timeout_s)


def shutdown_error(num_tokens: int, request_id: str) -> EpdError:
    """What a request cut at shutdown ends with (see the module docstring)."""
    if not num_tokens:
        return Unavailable(f"the server is shutting down (its grace period is over); retry the request "
                           f"(request id {request_id})")
    return UpstreamError(grpc.StatusCode.ABORTED,
                         f"the server shut down after {num_tokens} tokens (its grace period was over); the "
                         f"answer is incomplete; retry the request (request id {request_id})")
