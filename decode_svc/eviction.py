"""Decode-stage output-aware eviction around one request's decode steps (MustDrop's decode stage).

Each step captures the new token's rotated queries at every layer (`VLMAdapter.capture_queries`,
no L x L matrix), lets the policy accumulate the attention each visual cache entry receives, and
evicts persistently ignored entries from every layer at once when the policy says so. The decode
cache is read and shrunk through the adapter (`decode_cache_kv`, `set_decode_cache_kv`).
"""

from __future__ import annotations

import torch

from epd.model_runtime.adapter import VLMAdapter
from epd.token_pruning import OutputAwareEviction, PruningConfig, resolve_keep_count


class DecodeEviction:
    def __init__(
        self, adapter: VLMAdapter, cache, visual_entry_mask: torch.Tensor, config: PruningConfig
    ) -> None:
        """visual_entry_mask: [num_layers, num_kv_heads, num_cached] bool, from prefill (on the CPU)."""
        self.adapter = adapter
        self.cache = cache
        # The policy's state goes where the cache is, so each step's scores stay on the device.
        device = adapter.decode_cache_kv(cache)[0][0].device
        masks = list(visual_entry_mask.to(device).unbind(0))
        self.num_visual_start = int(masks[0][0].sum())
        self.policy = OutputAwareEviction.start(
            masks,
            resolve_keep_count(self.num_visual_start, config.decode_keep_ratio),
            ema_decay=config.decode_ema_decay,
            min_steps=config.decode_min_steps,
            evict_interval=config.decode_evict_interval,
        )

    def step(self, token_id: int, positions: torch.Tensor) -> torch.Tensor:
        """One decode step with observation (and eviction when due); returns logits [vocab]."""
        with self.adapter.capture_queries(range(self.adapter.num_layers), torch.tensor([0])) as cap:
            logits = self.adapter.decode_step(token_id, positions, self.cache)
        layers = self.adapter.decode_cache_kv(self.cache)
        for i, (keys, _) in enumerate(layers):
            self.policy.observe_queries(i, cap.queries[i], keys)
        self.policy.step()
        if self.policy.should_evict():
            for i, (keys, values) in enumerate(layers):
                self.adapter.set_decode_cache_kv(self.cache, i, *self.policy.evict(i, keys, values))
        return logits

    @property
    def counts(self) -> tuple[int, int]:
        """Visual entries per layer and head: at the start, now."""
        return self.num_visual_start, self.policy.num_visual
