"""The prefill stage in this process: `PrefillEngine` on the `ModelThread`, caches kept in a `KvStore`.

Used by the prefill gRPC servicer and by the embedded mode. A cancelled prefill stores nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace

from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import EncodedMedia, PrefillHandle, PrefillStage
from epd.stages.messages import Message
from epd.stages.model_thread import ModelThread
from epd.token_pruning import PruningConfig

log = logging.getLogger(__name__)


class LocalPrefillStage(PrefillStage):
    def __init__(
        self, engine: PrefillEngine, kv_store: KvStore, model_thread: ModelThread, kv_address: str = ""
    ) -> None:
        self.engine = engine
        self.kv_store = kv_store
        self.model_thread = model_thread
        self.kv_address = kv_address
        """host:port decoders pull this stage's caches from ("" when they take them in-process)."""

    async def prefill(
        self,
        messages: Sequence[Message],
        media: EncodedMedia,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> PrefillHandle:
        try:
            out = await self.model_thread.run(self.engine.prefill, messages, media, generation, pruning)
        except asyncio.CancelledError:
            # A call still queued is dropped; one already running finishes and its cache is freed
            # with `out`: a cancelled prefill stores nothing.
            log.info("prefill of request %s cancelled by its caller; no KV cache is kept", request_id)
            raise
        return replace(out.handle, kv_handle=self.kv_store.put(out.cache), kv_address=self.kv_address)

    async def release(self, handle: PrefillHandle, request_id: str) -> None:
        if self.kv_store.release(handle.kv_handle):
            log.info("released the KV cache of request %s: it ended before a decoder took it", request_id)
