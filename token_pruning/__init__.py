"""Multi-stage visual token dropping and KV-cache compression, as pure functions on tensors.

Batch size 1, Qwen2-VL / Qwen2.5-VL layouts. One file per stage; no gRPC, no model loading:

    config.py            PruningConfig (all off by default), named presets, to_dict/from_dict
    temporal.py          encode (a): drop tokens unchanged since the last kept frame group
    spatial_merge.py     encode (b): merge similar adjacent tokens in windows (size-weighted)
    key_tokens.py        encode (c): key token set that no later stage drops
    encode_stage.py      (c) then (b) on the tower output; surviving tokens by full-list index
    text_guided.py       prefill: question-guided dropping with MustDrop's dual rule
    layerwise_prefill.py a prefill that drops at layers, through VLMAdapter.layerwise_prefill
    kv_compress.py       after prefill: LOOK-M text-prior eviction with merging
    decode_policy.py     decode: output-aware eviction of ignored visual KV entries
    attention_scores.py  attention received from a few queries, grouped by KV head (GQA)
    query_capture.py     old names of the Qwen query capture (now model_runtime/qwen_text_layers.py)
    positions.py         survivors keep their original position ids
    grid.py              where each surviving token sits on the merged-token grid
    budget.py            ratio / count / bytes -> exact number kept
    accounting.py        tokens in/out per stage, prefill FLOPs saved, KV bytes

A request's order: temporal (before or after the tower) -> key tokens -> spatial merge ->
prefill drop at a layer -> KV compression -> decode eviction. Every stage keeps the key tokens
and reports its counts into `PruningStats`.
"""

# Torch-free modules load eagerly; the rest (torch) on first use of one of their names, so the
# gateway can take PruningConfig / PruningStats without importing torch (PEP 562 __getattr__).
from typing import TYPE_CHECKING

from epd.token_pruning.accounting import ModelSizes, PruningStats, prefill_flops, tokens_per_layer
from epd.token_pruning.budget import resolve_keep_count, staged_keep_counts
from epd.token_pruning.config import PRESETS, PruningConfig

if TYPE_CHECKING:
    from epd.token_pruning.attention_scores import ReceivedAttention, received_attention
    from epd.token_pruning.decode_policy import OutputAwareEviction
    from epd.token_pruning.encode_stage import EncodedTokens, prune_encoded_tokens
    from epd.token_pruning.grid import TokenGrid
    from epd.token_pruning.key_tokens import key_token_scores, select_key_tokens
    from epd.token_pruning.kv_compress import KVCompressionResult, compress_kv_cache, text_prior_scores
    from epd.token_pruning.positions import PrunedPrompt, gather_prompt, prompt_keep_indices, visual_positions
    from epd.token_pruning.spatial_merge import MergeResult, spatial_merge
    from epd.token_pruning.temporal import (
        SparseVisionInputs,
        TemporalDropResult,
        sparse_vision_inputs,
        temporal_redundancy_mask,
    )
    from epd.token_pruning.text_guided import (
        PrefillDropResult,
        dual_rule_select,
        text_guided_drop,
        text_query_positions,
    )

_LAZY = {
    "ReceivedAttention": "attention_scores", "received_attention": "attention_scores",
    "OutputAwareEviction": "decode_policy",
    "EncodedTokens": "encode_stage", "prune_encoded_tokens": "encode_stage",
    "TokenGrid": "grid",
    "key_token_scores": "key_tokens", "select_key_tokens": "key_tokens",
    "KVCompressionResult": "kv_compress", "compress_kv_cache": "kv_compress", "text_prior_scores": "kv_compress",
    "PrunedPrompt": "positions", "gather_prompt": "positions", "prompt_keep_indices": "positions",
    "visual_positions": "positions",
    "MergeResult": "spatial_merge", "spatial_merge": "spatial_merge",
    "SparseVisionInputs": "temporal", "TemporalDropResult": "temporal", "sparse_vision_inputs": "temporal",
    "temporal_redundancy_mask": "temporal",
    "PrefillDropResult": "text_guided", "dual_rule_select": "text_guided",
    "text_guided_drop": "text_guided",
    "text_query_positions": "text_guided",
}  # fmt: skip


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "PRESETS",
    "KVCompressionResult",
    "MergeResult",
    "ModelSizes",
    "OutputAwareEviction",
    "PrefillDropResult",
    "PrunedPrompt",
    "PruningConfig",
    "PruningStats",
    "ReceivedAttention",
    "SparseVisionInputs",
    "TemporalDropResult",
    "TokenGrid",
    "EncodedTokens",
    "compress_kv_cache",
    "prune_encoded_tokens",
    "dual_rule_select",
    "gather_prompt",
    "key_token_scores",
    "prefill_flops",
    "prompt_keep_indices",
    "received_attention",
    "resolve_keep_count",
    "staged_keep_counts",
    "select_key_tokens",
    "sparse_vision_inputs",
    "spatial_merge",
    "temporal_redundancy_mask",
    "text_guided_drop",
    "text_prior_scores",
    "text_query_positions",
    "tokens_per_layer",
    "visual_positions",
]
