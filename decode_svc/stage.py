"""The decode stage in this process: `DecodeEngine` on the `ModelThread`, behind the `DecodeStage`
contract. Used by the decode gRPC servicer and by the embedded mode.

The two differ only in where the KV cache comes from, `take_kv`: the embedded mode takes it from
the prefill stage's in-process `KvStore` (its in-memory 'transfer'); the decode service pulls it
from the prefill server over gRPC (`epd.decode_svc.kv_pull.KvPuller.take_kv`). Everything else is
this class: the generation-limits check (before any cache moves), timing the transfer, streaming
the tokens (`stream_tokens`), and freeing the cache however the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from epd.decode_svc.config import DecodeConfig
from epd.decode_svc.engine import DecodeEngine, stream_tokens
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import DecodeStage, PrefillHandle, TokenStep, check_generation_limits
from epd.stages.model_thread import ModelThread
from epd.token_pruning import PruningConfig

log = logging.getLogger(__name__)

TakeKv = Callable[[PrefillHandle], Awaitable[KvCache]]
"""take_kv(handle) -> the KV cache of `handle`, handed over once: the caller owns it then."""


def take_from_store(kv_store: KvStore) -> TakeKv:
    """The in-process 'transfer': take the cache out of the prefill stage's store."""

    async def take_kv(handle: PrefillHandle) -> KvCache:
        return kv_store.take(handle.kv_handle)

    return take_kv


class LocalDecodeStage(DecodeStage):
    def __init__(
        self,
        engine: DecodeEngine,
        take_kv: TakeKv,
        model_thread: ModelThread,
        config: DecodeConfig | None = None,
    ) -> None:
        """take_kv: `take_from_store(kv_store)` in-process, `KvPuller.take_kv` in the service.
        `config` gives the generation limits (default: DecodeConfig's)."""
        self.engine = engine
        self.take_kv = take_kv
        self.model_thread = model_thread
        self.config = config or DecodeConfig()

    async def generate(
        self,
        handle: PrefillHandle,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> AsyncIterator[TokenStep]:
        check_generation_limits(generation, self.config.max_new_tokens_limit)
        num_tokens = 0
        try:
            t0 = time.perf_counter()
            cache = await self.take_kv(handle)
            kv_transfer_ms = (time.perf_counter() - t0) * 1e3
            tokens = stream_tokens(self.engine, self.model_thread, cache, handle, generation, kv_transfer_ms, pruning)
            del cache  # the token stream owns it now and frees it when it ends, however it ends
            async with aclosing(tokens):
                async for step in tokens:
                    num_tokens += len(step.token_ids)
                    yield step
        except asyncio.CancelledError:
            # A pull in flight is cancelled too (the prefill side has already forgotten the cache).
            log.info("generation of request %s cancelled by its caller after %d tokens; its KV cache is freed",
                     request_id, num_tokens)
            raise
