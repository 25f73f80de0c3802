"""grpc.aio's own cancellation of a call, told apart from a cancel of the calling task; and its
own INTERNAL for a send cut short.

grpc.aio cancels a client-streaming call itself when its request iterator fails: the iterator
raised, or the deadline passed before a message could be written (grpcio's `aio/_call.py`,
`_consume_request_iterator`). Reading the answer then raises `asyncio.CancelledError`, not an
`AioRpcError`, so a caller that lets it through reports a failed call as a cancelled task (the
SDK's `ask` raised `concurrent.futures.CancelledError`). Callers catch it, ask
`cancelled_by_grpc()`, and turn grpc's cancel into a status of their own. No torch here: the SDK
imports it.
"""

from __future__ import annotations

import asyncio

import grpc


def cancelled_by_grpc() -> bool:
    """Whether a CancelledError just caught came from grpc.aio's own cancel of the call rather than
    a cancel of the current task (which Python 3.11+ counts; on 3.10 it is taken as the task's)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() == 0


LOST_WHILE_SENDING = "Internal error from Core"
"""How grpc.aio words the INTERNAL it raises itself when a request stream is being sent as the call
ends under it: a connection that has just broken (the replica was killed mid-upload), or the call's
own deadline passing mid-send (a soak saw 2 of ~1,000 short-deadline SDK calls; with a 1 ms
deadline and a 2 MB upload, most). gRPC's text, never one of our services' (theirs is
`epd.transport.errors.status_of`'s)."""


def lost_while_sending(code: grpc.StatusCode, details: str) -> bool:
    """Whether a failed call's (code, details) is grpc.aio's INTERNAL for a send cut short."""
    return code == grpc.StatusCode.INTERNAL and details.startswith(LOST_WHILE_SENDING)
