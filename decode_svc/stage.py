"""The decode stage in this process, taking the KV cache from an in-process prefill `KvStore`: the
embedded mode's in-memory 'transfer'. The decode gRPC service pulls caches over the network instead
(`epd.decode_svc.kv_pull`) and streams them through the same `stream_tokens`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from epd.decode_svc.engine import DecodeEngine, stream_tokens
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import DecodeStage, PrefillHandle, TokenStep
from epd.stages.model_thread import ModelThread
from epd.token_pruning import PruningConfig


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
