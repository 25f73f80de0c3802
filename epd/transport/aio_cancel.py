"""grpc.aio's own cancellation of a call, told apart from a cancel of the calling task; its own
INTERNAL for a send cut short; and the batches a cancelled task leaves in flight, kept until they
end so their native memory is freed (`shield_grpc_batches`); and a time limit that never swallows
a cancel (`within`).

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
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc

log = logging.getLogger(__name__)

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """`await awaitable`, or TimeoutError (asyncio.TimeoutError) once `timeout_s` has passed.

    Not asyncio.wait_for on Python 3.11: when the awaiting task is cancelled just as what it waits
    for completes, 3.11's wait_for returns the result and the cancel is lost (fixed in 3.12, whose
    wait_for is `asyncio.timeout`). A gateway handler whose client had gone as its upload or body
    arrived then went on to encode and prefill for nobody. `asyncio.timeout` (3.11+) runs the
    awaitable in this task and keeps the cancel; Python 3.10 has only wait_for."""
    if not hasattr(asyncio, "timeout"):  # Python 3.10
        return await asyncio.wait_for(awaitable, timeout_s)
    async with asyncio.timeout(timeout_s):
        return await awaitable


def cancelled_by_grpc() -> bool:
    """Whether a CancelledError just caught came from grpc.aio's own cancel of the call rather than
    a cancel of the current task (which Python 3.11+ counts; on 3.10 it is taken as the task's)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() == 0


async def answer_or_none(call: Awaitable[T], timeout_s: float, what: str) -> T | None:
    """A gateway's background read of one replica (its load, its model info): the answer, or None
    when the call fails or is not answered within `timeout_s` (logged at DEBUG, `what` first), or
    when grpc.aio cancels it because the replica left its pool and its channel closed under the
    call. That cancel, let through, ended the watch doing the reads for good; a cancel of the
    reading task itself goes on."""
    try:
        return await within(call, timeout_s)
    except Exception as exc:  # noqa: BLE001 - down, starting, or too old to answer
        log.debug("%s: %r", what, exc)
        return None
    except asyncio.CancelledError:
        if not cancelled_by_grpc():
            raise
        return None


LOST_WHILE_SENDING = "Internal error from Core"
"""How grpc.aio words the INTERNAL it raises itself when a request stream is being sent as the call
ends under it: a connection that has just broken (the replica was killed mid-upload), or the call's
own deadline passing mid-send (a soak saw 2 of ~1,000 short-deadline SDK calls; with a 1 ms
deadline and a 2 MB upload, most). gRPC's text, never one of our services' (theirs is
`epd.transport.errors.status_of`'s)."""


def lost_while_sending(code: grpc.StatusCode, details: str) -> bool:
    """Whether a failed call's (code, details) is grpc.aio's INTERNAL for a send cut short."""
    return code == grpc.StatusCode.INTERNAL and details.startswith(LOST_WHILE_SENDING)


class LeftBatches:
    """The gRPC batches that cancelled tasks left in flight (`shield_grpc_batches`): each runs on in
    its own task until gRPC completes it, which the call's end does (grpc.aio cancels a call
    whose task is cancelled mid-operation; a server's call is over when its handler is cancelled).
    That is at once, but for the few calls grpcio's core ends only at their deadline (seen for
    some 0.1-1% of uploads cut mid-send, with grpcio as it is as well): every stage call has one."""

    def __init__(self) -> None:
        self.in_flight: set[asyncio.Task[Any]] = set()  # held: the loop keeps only weak references
        self.num_ended = 0
        """Left batches gRPC has completed since the process started (their memory freed)."""

    def keep(self, batch: asyncio.Task[Any]) -> None:
        self.in_flight.add(batch)
        batch.add_done_callback(self._ended)

    def _ended(self, batch: asyncio.Task[Any]) -> None:
        self.in_flight.discard(batch)
        self.num_ended += 1
        if not batch.cancelled():
            batch.exception()  # retrieved: a batch of an ended call may fail, nobody awaits it now


LEFT_BATCHES = LeftBatches()

BatchRunner = Callable[[Any, tuple[Any, ...], asyncio.AbstractEventLoop], Coroutine[Any, Any, None]]


def shield_grpc_batches() -> bool:
    """Make every grpc.aio batch (one operation of a call: a read, a write, the initial metadata)
    of this process run to its end in a task of its own, so that cancelling the task awaiting it
    (a client gone, a deadline of ours, grpc.aio's own cancel of a call) no longer leaks it. False
    where this grpcio has no `execute_batch` to wrap (nothing changed). Idempotent.

    Why: grpcio (1.56 to 1.85.3 at least) frees a batch's `grpc_op` array, and what its operations
    hold (received message, metadata), only when the coroutine awaiting the batch sees it complete
    (`execute_batch` in grpcio's `aio/callback_common.pyx.pxi`; grpc/grpc#43360, fix not released).
    A task cancelled mid-batch drops it for good: about 100 B per cut read, 1 KB per cut unary
    call, 1.5-5 KB per request a gateway's client abandons (docs/architecture.md, known issue).
    Here the cancelled awaiter still raises at once, as before; only the batch waits on, in a task
    `LEFT_BATCHES` holds, and ends when gRPC completes it: the call was cancelled or ended, so
    promptly (`LeftBatches`). A batch gRPC reports as failed still leaks (grpcio reads its ops back
    only on success).

    grpcio's Cython code calls `execute_batch` through its module's globals, which is what lets
    this wrapper in. Called at a serving process's start (`epd serve`), not by the SDK: a user's
    process is theirs to patch."""
    from grpc._cython import cygrpc

    original: BatchRunner | None = getattr(cygrpc, "execute_batch", None)
    if original is None:
        log.warning(
            "grpcio %s has no execute_batch: cancelled calls may leak native memory (grpc/grpc#43360)",
            grpc.__version__,
        )
        return False
    if getattr(original, "_epd_shielded", False):
        return True

    async def execute_batch(call: Any, operations: tuple[Any, ...], loop: asyncio.AbstractEventLoop) -> None:
        batch: asyncio.Task[None] = loop.create_task(original(call, operations, loop))
        try:
            await asyncio.shield(batch)
        except asyncio.CancelledError:
            if not batch.done():  # this task was cancelled, not the batch: it runs on to its end
                LEFT_BATCHES.keep(batch)
            raise

    execute_batch._epd_shielded = True  # type: ignore[attr-defined]
    setattr(cygrpc, "execute_batch", execute_batch)  # noqa: B010 - cygrpc's stub does not declare it
    return True
