"""Decode: KV cache + first token -> the rest of the answer, one step at a time. No gRPC here.

A `Generation` holds one request's state (cache, positions, sampler, text); `stream_tokens` (used
by `LocalDecodeStage`, in-process and behind the gRPC servicer alike) calls `step()` on the model
thread once per token, so several requests interleave token by token.
When the caller stops reading (its client went away, the task is cancelled), `stream_tokens`
runs no further step and `Generation.close()` drops the cache at once, without waiting for
garbage collection to find the abandoned stream.
"""

from __future__ import annotations

import torch

from epd.decode_svc.eviction import DecodeEviction
from epd.model_runtime.adapter import VLMAdapter
from epd.model_runtime.detokenizer import IncrementalText
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.sampling import GenerationConfig, Sampler
from epd.stages.contracts import PrefillHandle, TokenStep
from epd.stages.errors import InvalidRequest
from epd.token_pruning import PruningConfig


class Generation:
    """One request being decoded."""

    def __init__(
        self,
        adapter: VLMAdapter,
        cache: KvCache,
        first_token_id: int,
        next_position_ids: list[int],
        config: GenerationConfig,
        visual_entry_mask: torch.Tensor | None = None,
        pruning: PruningConfig = PruningConfig(),
    ) -> None:
        self.adapter = adapter
        self.config = config
        self.cache = adapter.new_decode_cache(cache)
        self.positions = torch.tensor(next_position_ids, dtype=torch.long)  # [4]
        self.sampler = Sampler(config, seed_offset=1)
        self.text = IncrementalText(adapter.detokenize, config.stop)
        self.last_token = first_token_id
        self.finish_reason = ""
        self.eviction = None
        if pruning.decode_evict and visual_entry_mask is not None:
            shape = (cache.num_layers, cache.keys[0].shape[1], cache.num_cached_tokens)
            if visual_entry_mask.numel() != shape[0] * shape[1] * shape[2]:
                raise InvalidRequest("visual_entry_mask does not match the KV cache's shape")
            self.eviction = DecodeEviction(adapter, self.cache, visual_entry_mask.reshape(shape), pruning)

    def first(self) -> TokenStep:
        """The prefill's token, as the first step."""
        return self._emit(self.last_token)

    def step(self) -> TokenStep:
        """Run the model on the last token and emit the next one."""
        if self.eviction is not None:
            logits = self.eviction.step(self.last_token, self.positions)
        else:
            logits = self.adapter.decode_step(self.last_token, self.positions, self.cache)
        self.positions = self.positions + 1
        self.last_token = self.sampler(logits)
        return self._emit(self.last_token)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def close(self) -> None:
        """Free the cache (the request ended, finished or not); no step may follow."""
        self.cache = None
        self.eviction = None
        if not self.finish_reason:
            self.finish_reason = "cancelled"

    def _emit(self, token: int) -> TokenStep:
        delta = self.text.add(token)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif token in self.adapter.eos_token_ids and not self.config.ignore_eos:
            self.finish_reason = "stop"
        elif len(self.text.token_ids) >= self.config.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason:
            delta += self.text.flush()
            evicted = self.eviction.counts if self.eviction is not None else None
            return TokenStep([token], delta, self.finish_reason, decode_evict=evicted)
        return TokenStep([token], delta, self.finish_reason)


class DecodeEngine:
    def __init__(self, adapter: VLMAdapter) -> None:
        self.adapter = adapter

    def start(
        self,
        cache: KvCache,
        first_token_id: int,
        next_position_ids: list[int],
        generation: GenerationConfig,
        visual_entry_mask: torch.Tensor | None = None,
        pruning: PruningConfig = PruningConfig(),
    ) -> Generation:
        return Generation(self.adapter, cache, first_token_id, next_position_ids, generation,
                          visual_entry_mask, pruning)


async def stream_tokens(
    engine: DecodeEngine,
    model_thread,
    cache: KvCache,
    handle: PrefillHandle,
    generation: GenerationConfig,
    kv_transfer_ms: float,
    pruning: PruningConfig = PruningConfig(),
):
    """Async iterator of TokenStep for one request; every model call runs on `model_thread`.
    Pass the cache without keeping a reference: the stream frees it when it ends (close it with
    `contextlib.aclosing`, or cancel the task reading it)."""
    kv_num_bytes = cache.num_bytes
    gen = await model_thread.run(
        engine.start, cache, handle.first_token_id, handle.next_position_ids, generation,
        handle.visual_entry_mask, pruning,
    )
    del cache  # the Generation holds it now, until close()
    try:
        first = gen.first()
        first.kv_transfer_ms = kv_transfer_ms
        first.kv_num_bytes = kv_num_bytes
        yield first
        while not gen.done:
            yield await model_thread.run(gen.step)
    finally:
        gen.close()
