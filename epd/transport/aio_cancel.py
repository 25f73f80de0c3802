"""grpc.aio's own cancellation of a call, told apart from a cancel of the calling task.

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


def cancelled_by_grpc() -> bool:
    """Whether a CancelledError just caught came from grpc.aio's own cancel of the call rather than
    a cancel of the current task (which Python 3.11+ counts; on 3.10 it is taken as the task's)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() == 0
