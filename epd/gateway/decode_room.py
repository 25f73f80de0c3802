"""Waiting for a decoder with room: a prefilled request whose decoders are all full before its
first decode step is asked again, with a growing delay, rather than failed (its first token may be
with the client already)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import DecodeStage, PrefillHandle, TokenStep
from epd.stages.errors import EpdError
from epd.token_pruning import PruningConfig

log = logging.getLogger(__name__)


DECODE_ROOM_WAIT_S = 60.0
"""How long a prefilled request waits for a decoder with room (`decode_when_room`): half of
prefill's default --kv-ttl, so the cache it waits with is still stored when room comes."""
_ROOM_FIRST_DELAY_S = 0.05
_ROOM_MAX_DELAY_S = 1.0


async def decode_when_room(
    decoder: DecodeStage,
    handle: PrefillHandle,
    generation: GenerationConfig,
    request_id: str,
    pruning: PruningConfig,
    decode_room_wait_s: float,
) -> AsyncGenerator[TokenStep, None]:
    """The decoder's steps for a prefilled request. Every decoder full (`Busy`: its KV memory
    and its wait queue) before the first step is not this request's end: its prefill ran, its
    first token may be with the client already, and the full decoder took nothing (it reserves
    room before it pulls a cache). So it is asked again, after 50 ms, 100 ms, ... 1 s, for up
    to `decode_room_wait_s`, the cache waiting in prefill's KV store meanwhile (--kv-ttl,
    120 s by default; one that expires is prefilled again, once, as a lost one is). Until then
    the busy error is passed on (RESOURCE_EXHAUSTED, HTTP 429). What bounds the requests
    waiting here is prefill's KV store (--kv-store-bytes): when it is full, prefill refuses new
    requests before they have any token."""
    waiting_since: float | None = None
    delay_s = _ROOM_FIRST_DELAY_S
    while True:
        stepped = False
        try:
            generating = decoder.generate(handle, generation, request_id, pruning)
            async with aclosing(generating) as steps:  # type: ignore[type-var]  # an async generator
                async for step in steps:
                    stepped = True
                    yield step
            return
        except EpdError as exc:
            if stepped or getattr(exc, "retry_after_s", None) is None:
                raise
            now = time.monotonic()
            if waiting_since is None:
                waiting_since = now
                log.info(
                    "request %s: every decoder is full; waiting up to %.0f s for room",
                    request_id,
                    decode_room_wait_s,
                )
            if now - waiting_since + delay_s > decode_room_wait_s:
                raise
        await asyncio.sleep(delay_s)
        delay_s = min(2 * delay_s, _ROOM_MAX_DELAY_S)
