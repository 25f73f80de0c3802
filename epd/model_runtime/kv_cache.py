"""The KV cache as it crosses the Prefill -> Decode boundary: plain per-layer tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class KvCache:
    """Keys and values of every layer, each [1, num_kv_heads, num_cached_tokens, head_dim].

    RoPE is already applied to the keys, so the cache carries no position information: the next
    token's position ids travel beside it (`next_position_ids`).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_cached_tokens(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @classmethod
    def from_dynamic(cls, cache: DynamicCache) -> KvCache:
        layers = cache.layers
        return cls(
            keys=[layer.keys for layer in layers],  # type: ignore[union-attr,misc]
            values=[layer.values for layer in layers],  # type: ignore[union-attr,misc]
        )

    def cast(self, dtype: torch.dtype) -> KvCache:
        """The same cache with every tensor in `dtype` (a no-op for tensors already in it)."""
        return KvCache([k.to(dtype) for k in self.keys], [v.to(dtype) for v in self.values])

    def to_dynamic(self, config) -> DynamicCache:
        """A DynamicCache that the language model extends in place during decoding."""
        cache = DynamicCache(config=config)
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            cache.update(k, v, i)
        return cache

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Wire names, in transfer order: layer by layer, key then value."""
        out = []
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            out += [(f"layer.{i}.key", k), (f"layer.{i}.value", v)]
        return out

    @classmethod
    def from_named_tensors(cls, tensors: dict[str, torch.Tensor]) -> KvCache:
        num_layers = (len(tensors) + 1) // 2
        try:
            keys = [tensors[f"layer.{i}.key"] for i in range(num_layers)]
            values = [tensors[f"layer.{i}.value"] for i in range(num_layers)]
        except KeyError as exc:
            raise ValueError(f"KV cache transfer is missing tensor {exc.args[0]}") from None
        if len(tensors) != 2 * num_layers:
            raise ValueError(f"KV cache transfer has unexpected tensors: {sorted(tensors)}")
        return cls(keys, values)
