"""The cache as it crosses the Prefill -> Decode boundary: plain per-layer tensors.

Two kinds of layers:
  * attention layers carry keys and values that grow by one position per token;
  * linear-attention layers (Qwen3.5's Gated DeltaNet) carry a fixed-size state instead: a short
    convolution state (the last `kernel` projected inputs) and a recurrent state (the delta-rule
    memory). Their size does not depend on the number of tokens.
A cache of an attention-only model has no linear states, and its wire form is what it always was.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

_WIRE_NAME = re.compile(r"layer\.(\d+)\.(key|value|conv|recurrent)")


@dataclass
class KvCache:
    """Keys and values of every attention layer, each [1, num_kv_heads, num_cached_tokens, head_dim],
    and, for hybrid models, every linear-attention layer's states.

    RoPE is already applied to the keys, so the cache carries no position information: the next
    token's position ids travel beside it (`next_position_ids`).

    `attention_layers` names the model layer of each entry of `keys` / `values`; None (attention-only
    models) means entry i is layer i. `conv_states` / `recurrent_states` map a linear-attention layer
    to its states ([1, conv_dim, kernel] and [1, num_value_heads, key_head_dim, value_head_dim]).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    attention_layers: list[int] | None = None
    conv_states: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent_states: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        """Attention layers carried (entries of `keys`); linear layers are `linear_layers`."""
        return len(self.keys)

    @property
    def layer_ids(self) -> list[int]:
        """The model layer of each entry of `keys` / `values`."""
        return list(range(len(self.keys))) if self.attention_layers is None else list(self.attention_layers)

    @property
    def linear_layers(self) -> list[int]:
        return sorted(set(self.conv_states) | set(self.recurrent_states))

    @property
    def num_cached_tokens(self) -> int:
        """Tokens in the attention layers' KV (linear states have no token axis)."""
        return int(self.keys[0].shape[-2]) if self.keys else 0

    @property
    def num_bytes(self) -> int:
        return self.kv_num_bytes + self.linear_state_num_bytes

    @property
    def kv_num_bytes(self) -> int:
        """Bytes of keys and values: what grows with the tokens."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def linear_state_num_bytes(self) -> int:
        """Bytes of the linear-attention states: a fixed size per request."""
        states = (*self.conv_states.values(), *self.recurrent_states.values())
        return sum(t.numel() * t.element_size() for t in states)

    @classmethod
    def from_dynamic(cls, cache: DynamicCache) -> KvCache:
        """Every layer's tensors. A layer that keeps linear-attention states (transformers'
        `LinearAttentionLayer`) contributes its conv and recurrent state instead of keys and values."""
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        layers = cache.layers
        if not any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers):
            return cls(
                keys=[layer.keys for layer in layers],  # type: ignore[union-attr,misc]
                values=[layer.values for layer in layers],  # type: ignore[union-attr,misc]
            )
        keys, values, attention, conv, recurrent = [], [], [], {}, {}
        for i, layer in enumerate(layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                if layer.number_of_states != 1:
                    raise ValueError(
                        f"layer {i} keeps {layer.number_of_states} linear states; one is supported"
                    )
                if layer.is_conv_states_initialized[0]:
                    conv[i] = layer.conv_states[0]
                if layer.is_recurrent_states_initialized[0]:
                    recurrent[i] = layer.recurrent_states[0]
            else:
                keys.append(layer.keys)  # type: ignore[union-attr]
                values.append(layer.values)  # type: ignore[union-attr]
                attention.append(i)
        return cls(keys, values, attention, conv, recurrent)  # type: ignore[arg-type]

    def cast(self, dtype: torch.dtype) -> KvCache:
        """The same cache with keys, values and conv states in `dtype` (a no-op for tensors already
        in it). Recurrent states keep their dtype: the delta rule accumulates them in float32."""
        return KvCache(
            [k.to(dtype) for k in self.keys],
            [v.to(dtype) for v in self.values],
            None if self.attention_layers is None else list(self.attention_layers),
            {i: s.to(dtype) for i, s in self.conv_states.items()},
            dict(self.recurrent_states),
        )

    def clone(self) -> KvCache:
        """A copy of every tensor: for a second decoder of the same prompt (a request's choices,
        `KvStore.take`), as each extends its cache in place."""
        return KvCache(
            [k.clone() for k in self.keys],
            [v.clone() for v in self.values],
            None if self.attention_layers is None else list(self.attention_layers),
            {i: s.clone() for i, s in self.conv_states.items()},
            {i: s.clone() for i, s in self.recurrent_states.items()},
        )

    def to_dynamic(self, config) -> DynamicCache:
        """A DynamicCache that the language model extends in place during decoding. With `config`,
        transformers builds one cache layer per model layer (linear-attention layers included),
        and each gets its own tensors back: keys/values through `update`, linear states through the
        layer's own `update_conv_state` / `update_recurrent_state`, as after a prefill."""
        cache = DynamicCache(config=config)
        for i, k, v in zip(self.layer_ids, self.keys, self.values, strict=True):
            cache.update(k, v, i)
        for i in self.linear_layers:
            if i not in self.conv_states or i not in self.recurrent_states:
                raise ValueError(f"linear-attention layer {i} arrived without its conv and recurrent state")
            layer = cache.layers[i]
            layer.update_conv_state(self.conv_states[i])  # type: ignore[union-attr]
            layer.update_recurrent_state(self.recurrent_states[i])  # type: ignore[union-attr]
        return cache

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Wire names, in transfer order, by model layer: `layer.{i}.key` then `layer.{i}.value` for
        an attention layer, `layer.{i}.conv` then `layer.{i}.recurrent` for a linear-attention one."""
        out: list[tuple[str, torch.Tensor]] = []
        kv = {i: (k, v) for i, k, v in zip(self.layer_ids, self.keys, self.values, strict=True)}
        for i in sorted(set(kv) | set(self.linear_layers)):
            if i in kv:
                out += [(f"layer.{i}.key", kv[i][0]), (f"layer.{i}.value", kv[i][1])]
            if i in self.conv_states:
                out.append((f"layer.{i}.conv", self.conv_states[i]))
            if i in self.recurrent_states:
                out.append((f"layer.{i}.recurrent", self.recurrent_states[i]))
        return out

    @classmethod
    def from_named_tensors(cls, tensors: dict[str, torch.Tensor]) -> KvCache:
        kinds: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            match = _WIRE_NAME.fullmatch(name)
            if match is None:
                raise ValueError(f"KV cache transfer has unexpected tensors: {sorted(tensors)}")
            kinds.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        linear = {i for i, kind in kinds.items() if {"conv", "recurrent"} & kind.keys()}
        if not linear:  # attention-only: layers 0..n-1, each with key and value
            num_layers = (len(tensors) + 1) // 2
            try:
                keys = [tensors[f"layer.{i}.key"] for i in range(num_layers)]
                values = [tensors[f"layer.{i}.value"] for i in range(num_layers)]
            except KeyError as exc:
                raise ValueError(f"KV cache transfer is missing tensor {exc.args[0]}") from None
            if len(tensors) != 2 * num_layers:
                raise ValueError(f"KV cache transfer has unexpected tensors: {sorted(tensors)}")
            return cls(keys, values)
        # hybrid: every layer 0..n-1 is either attention (key, value) or linear (conv, recurrent)
        num_layers = max(kinds) + 1
        keys, values, attention, conv, recurrent = [], [], [], {}, {}
        for i in range(num_layers):
            kind = kinds.get(i, {})
            wanted = ("conv", "recurrent") if i in linear else ("key", "value")
            for part in wanted:
                if part not in kind:
                    raise ValueError(f"KV cache transfer is missing tensor 'layer.{i}.{part}'")
            if len(kind) != 2:
                raise ValueError(f"KV cache transfer has unexpected tensors: {sorted(tensors)}")
            if i in linear:
                conv[i], recurrent[i] = kind["conv"], kind["recurrent"]
            else:
                keys.append(kind["key"])
                values.append(kind["value"])
                attention.append(i)
        return cls(keys, values, attention, conv, recurrent)
