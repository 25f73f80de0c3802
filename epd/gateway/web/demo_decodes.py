"""Where the web demo's `POST /demo/frames` decodes: the gateway's only media decoding, of
untrusted bytes, kept apart from the rest of the gateway.

A decode's life:

    result = await decodes.run(fn, *args, ticket=ticket)
        Busy (HTTP 429 + Retry-After) when `max_concurrent` decodes run already;
        else fn(*args, cancel) runs on one of the demo's own threads (never asyncio's default
        executor, which the gateway's local-file reads and upload hashing wait on), in the
        request's context (its log lines carry the request id, as the encoder's do), and the
        request's admission ticket is held (`Ticket.hold`) until fn has returned.
    client goes away  ->  the handler is cancelled (aiohttp's handler_cancellation): `cancel` is
        set, the handler ends at once, fn stops at its next check (each decoded frame, and each read
        of the file while it demuxes) and only then are the thread, the client's slot and its body bytes free.

So a client that disconnects and retries cannot pile up decodes behind its back: a slot and a
thread each stay taken for as long as their decode really runs.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from epd.gateway.admission import RETRY_AFTER_S, Ticket
from epd.stages.errors import Busy, Unavailable
from epd.video.types import DecodeCancelled

log = logging.getLogger(__name__)

T = TypeVar("T")

THREAD_NAME_PREFIX = "epd-demo-decode"


class DemoDecodes:
    """At most `max_concurrent` demo decodes at once, each on its own thread with a cancel flag.
    `run` is called on the event loop only (its counter is not locked)."""

    def __init__(self, max_concurrent: int) -> None:
        self.max_concurrent = max_concurrent
        self.num_running = 0
        """Decodes whose function has not returned yet, their clients gone or not."""
        self._executor = ThreadPoolExecutor(max_concurrent, thread_name_prefix=THREAD_NAME_PREFIX)
        self._cancel_flags: set[threading.Event] = set()
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any, ticket: Ticket | None = None) -> T:
        """fn(*args, cancel) on a demo thread; see the module docstring."""
        if self._closed:
            raise Unavailable("the gateway is shutting down; retry on another replica")
        if self.num_running >= self.max_concurrent:
            raise Busy(
                f"the web demo is decoding {self.num_running} videos already (the gateway's "
                "--demo-max-concurrent-decodes); retry shortly",
                RETRY_AFTER_S,
            )
        loop = asyncio.get_running_loop()
        cancel = threading.Event()
        release = ticket.hold() if ticket is not None else None
        self.num_running += 1
        self._cancel_flags.add(cancel)

        def ended() -> None:  # on the event loop
            self.num_running -= 1
            self._cancel_flags.discard(cancel)
            if release is not None:
                release()

        def returned(_: Future) -> None:  # on the demo thread (or here, when it never started)
            try:
                loop.call_soon_threadsafe(ended)
            except RuntimeError:  # the loop is closed: nothing left to give back to
                pass

        # In the request's context, so that the decoder's log lines carry its request id.
        future = self._executor.submit(functools.partial(contextvars.copy_context().run, fn, *args, cancel))
        future.add_done_callback(returned)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            cancel.set()  # its client went away; the slot stays taken until `ended`
            raise
        except DecodeCancelled:  # flagged by `close`, not by its client
            raise Unavailable("the gateway is shutting down; retry on another replica") from None

    def close(self) -> None:
        """Stop every decode (their flags set) and the threads once they have; `run` refuses
        from now on."""
        self._closed = True
        for cancel in list(self._cancel_flags):
            cancel.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
