"""Releasing a KV cache that prefill stored and no decoder took (`epd.gateway.pipeline` releases
one on every way out of a request but a decode run to its end). A release runs in a task of its
own that outlives the request's, held in `_in_flight` until it ends, so that the pipeline's
`aclose` can wait for those still running before the channels they use close."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from epd.stages.contracts import PrefillHandle, PrefillStage

log = logging.getLogger(__name__)


_in_flight: set[asyncio.Future] = set()
"""Releases still running, held here so that one outliving its cancelled request task is not
garbage-collected half way."""


RELEASES_WAIT_S = 5.0
"""How long `Pipeline.aclose` waits for the KV releases still running (those of requests cut at
the end of the drain) before the channels they use close; one still running then is cut, and the
cache it meant to drop expires with prefill's --kv-ttl."""


async def wait_for_releases(timeout_s: float) -> None:
    """Until the KV releases running now end, or `timeout_s` passes."""
    if _in_flight:
        await asyncio.wait(set(_in_flight), timeout=timeout_s)


def _release_done(request_id: str) -> Callable[[asyncio.Future], None]:
    def done(release: asyncio.Future) -> None:
        _in_flight.discard(release)
        if not release.cancelled() and release.exception() is not None:
            log.warning(
                "could not release the KV cache of request %s (its TTL will): %r",
                request_id,
                release.exception(),
            )

    return done


def release_outcome(prefill: PrefillStage, request_id: str) -> Callable[[asyncio.Future], None]:
    """A done-callback for a prefill call cancelled as it ran: the handle it answered, if any,
    is released (`Pipeline._prefill`)."""

    def done(call: asyncio.Future) -> None:
        if not call.cancelled() and call.exception() is None:
            release = asyncio.ensure_future(prefill.release(call.result(), request_id))
            _in_flight.add(release)
            release.add_done_callback(_release_done(request_id))

    return done


async def release_kv(prefill: PrefillStage, handle: PrefillHandle, request_id: str) -> None:
    """Tell prefill to drop a cache no decoder took. Runs to the end even if this task is
    cancelled (again) meanwhile; a failure is logged, not raised over the request's own error."""
    release = asyncio.ensure_future(prefill.release(handle, request_id))
    _in_flight.add(release)
    release.add_done_callback(_release_done(request_id))
    await asyncio.wait([release])  # unlike await, neither raises its error nor cancels it
