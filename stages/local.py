"""In-process stages: the engines called directly, the KV cache handed over in memory.

This is the embedded mode (`epd ask` without --endpoint) and the reference implementation of
every boundary; the services run the same engines behind gRPC.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from decode_svc.engine import DecodeEngine, stream_tokens
from encoder_svc.engine import EncoderEngine
from model_runtime.sampling import GenerationConfig
from prefill_svc.engine import PrefillEngine
from prefill_svc.kv_store import KvStore
from stages.contracts import (
    DecodeStage,
    EncodedMedia,
    EncodeStage,
    EventSink,
    MediaInput,
    PrefillHandle,
    PrefillStage,
    StageEvent,
    TokenStep,
)
from stages.model_thread import ModelThread
from token_pruning import PruningConfig
from video.types import SamplingOptions


class LocalEncodeStage(EncodeStage):
    def __init__(self, engine: EncoderEngine, model_thread: ModelThread) -> None:
        self.engine = engine
        self.model_thread = model_thread

    async def encode(
        self,
        media: MediaInput,
        sampling: SamplingOptions,
        on_event: EventSink,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> EncodedMedia:
        loop = asyncio.get_running_loop()

        def threadsafe(event: StageEvent) -> None:
            loop.call_soon_threadsafe(on_event, event)

        return await self.model_thread.run(self.engine.encode, media, sampling, threadsafe, pruning)


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
        out = await self.model_thread.run(self.engine.prefill, question, media, generation, pruning)
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
        async for step in stream_tokens(
            self.engine, self.model_thread, cache, handle, generation, 0.0, pruning
        ):
            yield step
