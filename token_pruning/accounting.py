"""What pruning saved, for every response and the metrics: tokens, prefill FLOPs, KV bytes.

Prefill FLOPs are estimated from the model's sizes (multiply-add = 2 FLOPs), per decoder layer
that runs on T tokens (causal attention, grouped-query K/V projections, SwiGLU MLP):

    projections  2 * T * hidden * (2 * q_dim + 2 * kv_dim)     q, o: hidden x q_dim; k, v: hidden x kv_dim
    mlp          2 * T * 3 * hidden * intermediate              gate, up, down
    attention    2 * q_dim * T * (T + 1)                        QK^T and AV over the causal half

with q_dim = num_heads * head_dim and kv_dim = num_kv_heads * head_dim. head_dim is the config's,
not hidden / num_heads: Qwen3-VL-4B has 32 heads x 128 = 4096 over a hidden size of 2560. A prefill that drops tokens at layer l runs
layers < l on the full length and layers >= l on the survivors, so the estimate takes one token
count per layer. Embeddings and the LM head (one position) are left out: pruning does not
change them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epd.model_runtime.adapter import TextDims


@dataclass(frozen=True)
class ModelSizes:
    """The language model's sizes (from its text config)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Width of one attention head (num_heads * head_dim need not be hidden_size)."""

    @classmethod
    def from_config(cls, text_config: Any) -> ModelSizes:
        """From a transformers text config (Qwen2-VL's `config.text_config`); a config without
        `head_dim` means hidden_size / num_attention_heads, as transformers reads it."""
        return cls(
            num_layers=text_config.num_hidden_layers,
            hidden_size=text_config.hidden_size,
            intermediate_size=text_config.intermediate_size,
            num_heads=text_config.num_attention_heads,
            num_kv_heads=text_config.num_key_value_heads,
            head_dim=getattr(text_config, "head_dim", None)
            or text_config.hidden_size // text_config.num_attention_heads,
        )

    @classmethod
    def from_dims(cls, dims: TextDims) -> ModelSizes:
        """From the adapter's `VLMAdapter.text_dims`."""
        return cls(
            dims.num_layers,
            dims.hidden_size,
            dims.intermediate_size,
            dims.num_heads,
            dims.num_kv_heads,
            dims.head_dim,
        )


def layer_prefill_flops(sizes: ModelSizes, num_tokens: int) -> int:
    """Estimated FLOPs of one decoder layer over `num_tokens` prompt tokens (causal)."""
    h, t = sizes.hidden_size, num_tokens
    q_dim = sizes.num_heads * sizes.head_dim  # queries and the attention output, all heads
    kv_dim = sizes.num_kv_heads * sizes.head_dim
    projections = 2 * t * h * (2 * q_dim + 2 * kv_dim)
    mlp = 2 * t * 3 * h * sizes.intermediate_size
    attention = 2 * q_dim * t * (t + 1)
    return projections + mlp + attention


def prefill_flops(sizes: ModelSizes, tokens_per_layer: list[int] | int) -> int:
    """Estimated prefill FLOPs; `tokens_per_layer` is one count per layer, or one for all."""
    if isinstance(tokens_per_layer, int):
        tokens_per_layer = [tokens_per_layer] * sizes.num_layers
    if len(tokens_per_layer) != sizes.num_layers:
        raise ValueError(f"{len(tokens_per_layer)} token counts for {sizes.num_layers} layers")
    return sum(layer_prefill_flops(sizes, t) for t in tokens_per_layer)


def tokens_per_layer(
    num_layers: int, num_tokens: int, drop_layer: int | None, num_tokens_after: int
) -> list[int]:
    """Token count per layer for a prefill that drops at `drop_layer` (None: no drop)."""
    if drop_layer is None:
        return [num_tokens] * num_layers
    return [num_tokens if i < drop_layer else num_tokens_after for i in range(num_layers)]


@dataclass(frozen=True)
class StageCount:
    stage: str
    """"temporal", "spatial_merge", "prefill_drop", "kv_compress" or "decode_evict"."""
    num_visual_tokens_in: int
    num_visual_tokens_out: int


@dataclass
class PruningStats:
    """Filled in as a request passes each stage; `to_dict()` goes into the response and metrics."""

    stages: list[StageCount] = field(default_factory=list)
    num_key_tokens: int = 0
    """Visual tokens flagged never-drop at encode."""
    prefill_flops_full: int = 0
    """Estimated prefill FLOPs had nothing been pruned (every visual token, every layer)."""
    prefill_flops_pruned: int = 0
    """Estimated prefill FLOPs of the prefill that ran."""
    kv_bytes_before: int = 0
    """KV cache bytes after prefill, before compression."""
    kv_bytes_after: int = 0
    """KV cache bytes sent to Decode."""
    transfer_bytes: int = 0
    """Tensor payload bytes that crossed a process boundary for this request, summed over its
    hops: the visual embeddings (and DeepStack features) encoder -> gateway and gateway -> prefill,
    the KV cache prefill -> decode, the visual-entry mask prefill -> gateway -> decode (decode
    eviction only). The gateway's remote stages count their hops (`epd.transport.remote_encode`,
    `remote_prefill`: an `EncodedMedia`'s is encoder -> gateway, a `PrefillHandle`'s that prefill
    call's) and the pipeline sums them with the decoder's KV pull (`epd.gateway.pipeline`). Never
    sent between stages; 0 in one process (embedded, colocated), where nothing crosses."""

    def record(self, stage: str, num_in: int, num_out: int) -> None:
        self.stages.append(StageCount(stage, num_in, num_out))

    @property
    def prefill_flops_saved(self) -> int:
        return self.prefill_flops_full - self.prefill_flops_pruned

    @property
    def num_visual_tokens_in(self) -> int:
        return self.stages[0].num_visual_tokens_in if self.stages else 0

    @property
    def num_visual_tokens_out(self) -> int:
        return self.stages[-1].num_visual_tokens_out if self.stages else 0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["prefill_flops_saved"] = self.prefill_flops_saved
        return out
