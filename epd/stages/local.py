"""In-process stages: the engines called directly, the KV cache handed over in memory.

This is the embedded mode (`epd ask` without --endpoint) and the reference implementation of
every boundary; the services run the same engines behind gRPC.

Where each stage's work runs: the encoder's per-request driver (demux, waiting for frames, cache)
on a bounded `RequestPool` thread and only its model calls on the `ModelThread`; prefill and
decode steps on the `ModelThread`. Cancelling a call (the client went away) sets the encoder
driver's cancel flag, drops queued model calls, and keeps prefill from storing its cache.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import aclosing

from epd.decode_svc.engine import DecodeEngine, stream_tokens
from epd.encoder_svc.engine import EncoderEngine
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import (
    DecodeStage,
    EncodedMedia,
    EncodeStage,
    EventSink,
    MediaInput,
    PrefillHandle,
    PrefillStage,
    RequestCancelled,
    StageEvent,
    TokenStep,
)
from epd.stages.model_thread import ModelThread
from epd.stages.request_pool import RequestPool
from epd.token_pruning import PruningConfig
from epd.video.types import SamplingOptions

log = logging.getLogger(__name__)


def _decodes_full(num_running: int, num_waiting: int) -> str:
    return (f"the encoder is decoding {num_running} videos and {num_waiting} more requests are waiting; "
            "retry shortly, or start the encoder with a larger --max-concurrent-decodes or "
            "--max-queued-decodes")


class LocalEncodeStage(EncodeStage):
    def __init__(self, engine: EncoderEngine, model_thread: ModelThread) -> None:
        self.engine = engine
        self.model_thread = model_thread
        self.drivers = RequestPool(engine.config.max_concurrent_decodes, engine.config.max_queued_decodes,
                                   _decodes_full, thread_name="encode-driver")

    async def encode(
        self,
        media: MediaInput,
        sampling: SamplingOptions,
        on_event: EventSink,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> EncodedMedia:
        loop = asyncio.get_running_loop()

        def drive(cancel: threading.Event) -> EncodedMedia:  # on a request-pool thread
            def threadsafe(event: StageEvent) -> None:
                if not cancel.is_set():  # nobody listens any more (and the loop may be gone)
                    loop.call_soon_threadsafe(on_event, event)

            try:
                return self.engine.encode(media, sampling, threadsafe, pruning,
                                          run_model=self.model_thread.call, cancel=cancel)
            except RequestCancelled as exc:
                log.info("encode of request %s stopped: %s", request_id, exc)
                raise

        try:
            return await self.drivers.run(drive)
        except asyncio.CancelledError:
            log.info("encode of request %s cancelled by its caller; its decoding stops",
                     request_id)
            raise


class LocalPrefillStage(PrefillStage):
    def __init__(self, engine: PrefillEngine, kv_store: KvStore, model_thread: ModelThread) -> None:
        self.engine = engine
        self.kv_store = kv_store
        self.model_thread = model_thread

    async def prefill(
        self,
        question: str,
        media: EncodedMedia,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> PrefillHandle:
        try:
            out = await self.model_thread.run(self.engine.prefill, question, media, generation, pruning)
        except asyncio.CancelledError:
            # A call still queued is dropped; one already running finishes and its cache is freed
            # with `out`: a cancelled prefill stores nothing.
            log.info("prefill of request %s cancelled by its caller; no KV cache is kept", request_id)
            raise
        handle = self.kv_store.put(out.cache)
        return PrefillHandle(
            kv_handle=handle,
            kv_address="",
            first_token_id=out.first_token_id,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.cache.num_cached_tokens,
            next_position_ids=out.next_position_ids,
            kv_num_bytes=out.cache.num_bytes,
            prefill_ms=out.prefill_ms,
            num_visual_tokens_in=out.num_visual_tokens_in,
            num_visual_tokens_out=out.num_visual_tokens_out,
            kv_num_bytes_uncompressed=out.kv_num_bytes_uncompressed,
            pruning=out.pruning,
            visual_entry_mask=out.visual_entry_mask if pruning.decode_evict else None,
            kept_visual_token_index=out.kept_visual_token_index,
        )

    async def release(self, handle: PrefillHandle, request_id: str) -> None:
        if self.kv_store.release(handle.kv_handle):
            log.info("released the KV cache of request %s: it ended before a decoder took it", request_id)


class LocalDecodeStage(DecodeStage):
    """Takes the cache from the prefill stage's in-memory store: the in-process 'transfer'."""

    def __init__(self, engine: DecodeEngine, kv_store: KvStore, model_thread: ModelThread) -> None:
        self.engine = engine
        self.kv_store = kv_store
        self.model_thread = model_thread

    async def generate(
        self,
        handle: PrefillHandle,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> AsyncIterator[TokenStep]:
        cache = self.kv_store.take(handle.kv_handle)
        tokens = stream_tokens(self.engine, self.model_thread, cache, handle, generation, 0.0, pruning)
        del cache  # the token stream owns it now and frees it when it ends, however it ends
        async with aclosing(tokens):
            async for step in tokens:
                yield step
