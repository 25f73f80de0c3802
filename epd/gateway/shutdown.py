"""The front door's answers still in flight when its grace period ends: ended by the gateway with
a status of its own, not dropped.

At the end of `--grace-period` (or at the second signal) the gateway cancels the tasks still
answering (`CallsInFlight.cut`). Each answer's handler sees the cancel, asks `cutting`, and ends
with `CallsInFlight.shutdown_error`, which says which of the two ended the drain: UNAVAILABLE
(HTTP 503) when nothing has reached the client (retrying is safe), ABORTED (an SSE error event,
HTTP 502) once tokens have (the client holds part of an answer; UNAVAILABLE would invite a retry
as if nothing had happened). Left to gRPC's and aiohttp's own stop, a gRPC client got UNAVAILABLE
"Cancelling all calls" after hundreds of tokens, an HTTP client a dropped connection, and a
streamed answer a cut chunk with no error and no [DONE]. Both APIs use it; the statuses map to
HTTP as every other error does (`http_error_of`).

The request metric counts a cut request with the status its client gets
(`GatewayMetrics.track` asks `current_call` and `Call.cut_status`), not as CANCELLED, a client
that went away.

A gRPC call that gRPC itself holds at the cut (sending a message the handler yielded) is not
cancelled there, where gRPC would swallow the cancel, but when it hands the call back
(`Call.sending`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import grpc

from epd.stages.errors import EpdError, Unavailable
from epd.transport.errors import UpstreamError, status_of

_answering: ContextVar[Call | None] = ContextVar("epd_gateway_call", default=None)


def current_call() -> Call | None:
    """The answer this task is giving (inside `CallsInFlight.tracking`); None outside one."""
    return _answering.get()


class Call:
    """One answer in flight: its task, and whether gRPC holds that task now (sending a message the
    handler yielded)."""

    def __init__(self, task: asyncio.Task | None, calls: CallsInFlight | None = None) -> None:
        self.task = task
        self.calls = calls
        """The set it is tracked in, which knows what ended the drain (`CallsInFlight.hurried`)."""
        self.was_cut = False
        self._sending = False
        self.request_id = ""
        self.num_tokens = 0
        """The tokens sent to the client so far, for its status if it is cut (`shutdown_error`)."""

    @contextmanager
    def sending(self) -> Iterator[None]:
        """Around a gRPC handler's `yield`. A cancel that lands while gRPC sends what was yielded
        raises CancelledError inside gRPC's own code, which swallows it: the call then ended
        UNAVAILABLE "Cancelling all calls" at gRPC's stop, without the gateway's status. So `cut`
        leaves such a call alone and it is cut here, when gRPC hands it back."""
        self._sending = True
        try:
            yield
        finally:
            self._sending = False
        if self.was_cut:
            raise asyncio.CancelledError

    def cut_status(self) -> str | None:
        """The status name its client gets if the shutdown cut it (UNAVAILABLE before any token,
        ABORTED after), None when it was not cut."""
        if not self.was_cut or self.calls is None:
            return None
        return status_of(self.calls.shutdown_error(self.num_tokens, self.request_id))[0].name

    def cut(self) -> None:
        self.was_cut = True
        if self.task is not None and not self._sending:
            self.task.cancel()


class CallsInFlight:
    """The answers being given now (aiohttp's per-connection tasks, gRPC's per-call ones)."""

    def __init__(self) -> None:
        self._calls: set[Call] = set()
        self.cutting = False
        """Set by `cut`: a CancelledError in a handler is the shutdown's, not its client's."""
        self.hurried = False
        """Set by `cut` when a second stop signal, not the end of the grace period, ended the drain."""

    @contextmanager
    def tracking(self) -> Iterator[Call]:
        call = Call(asyncio.current_task(), self)
        self._calls.add(call)
        _answering.set(call)
        try:
            yield call
        finally:
            # Not reset(token): a gRPC handler is an async generator, whose end may run in
            # another context than its start (reset would raise there).
            _answering.set(None)
            self._calls.discard(call)

    def cut(self, hurried: bool = False) -> list[asyncio.Task]:
        """Cancel every answer still in flight (`hurried`: at a second stop signal); returns their
        tasks."""
        self.cutting, self.hurried = True, hurried
        calls = list(self._calls)
        for call in calls:
            call.cut()
        return [call.task for call in calls if call.task is not None]

    async def cut_and_wait(self, timeout_s: float, hurried: bool = False) -> None:
        """`cut`, then give the handlers `timeout_s` to send their statuses."""
        if tasks := self.cut(hurried):
            await asyncio.wait(tasks, timeout=timeout_s)

    def shutdown_error(self, num_tokens: int, request_id: str) -> EpdError:
        """What a request cut at shutdown ends with (see the module docstring), saying what ended
        the drain. `request_id` is empty when the cut came before the request said it (a gRPC
        upload being read)."""
        which = f" (request id {request_id})" if request_id else ""
        if not num_tokens:
            why = "a second stop signal ended its drain" if self.hurried else "its grace period is over"
            return Unavailable(f"the server is shutting down ({why}); retry the request{which}")
        why = "a second stop signal ended its drain" if self.hurried else "its grace period was over"
        return UpstreamError(
            grpc.StatusCode.ABORTED,
            f"the server shut down after {num_tokens} tokens ({why}); the answer is "
            f"incomplete; retry the request{which}",
        )
