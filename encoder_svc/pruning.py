"""Encode-stage token dropping on one request's visual tokens (runs only when enabled).

    temporal (a): merged tokens unchanged since the last kept one at their cell are dropped,
                  before the tower (Qwen2-VL: the tower runs on kept patches only) or after it;
    key tokens (c) then spatial merge (b) on the tower's output.
The survivors are named by their index in the full visual-token list, which is how prefill knows
which placeholders (and so which M-RoPE positions) they take.
"""

from __future__ import annotations

import torch

from epd.token_pruning import (
    PruningConfig,
    PruningStats,
    prune_encoded_tokens,
    sparse_vision_inputs,
    temporal_redundancy_mask,
)


def encode_stage_pruning(
    adapter,
    embeds: torch.Tensor | None,
    pixel_values: torch.Tensor | None,
    grid_thw: tuple[int, int, int],
    config: PruningConfig,
    stats: PruningStats,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """embeds: [N, hidden] full tower output, or None when the tower must still run (sparse).
    pixel_values: [num_patches, patch_dim], needed by temporal dropping.
    Returns (embeddings [N', hidden], token_index [N'] long, key_mask [N'] bool)."""
    num_full = adapter.num_visual_tokens(grid_thw)
    present = None
    if config.temporal_drop:
        assert pixel_values is not None
        present = temporal_redundancy_mask(pixel_values, [grid_thw], config.temporal_threshold).keep_tokens
        stats.record("temporal", num_full, int(present.sum()))
        if embeds is None:
            sparse = sparse_vision_inputs(pixel_values, [grid_thw], present)
            embeds = adapter.encode_sparse(
                sparse.pixel_values, grid_thw, sparse.position_ids, sparse.cu_seqlens
            )
        else:
            embeds = embeds[present]
    assert embeds is not None
    out = prune_encoded_tokens(embeds, [grid_thw], present, config)
    if config.spatial_merge:
        stats.record("spatial_merge", out.num_tokens_present, int(out.embeddings.shape[0]))
    stats.num_key_tokens = int(out.key_mask.sum())
    return out.embeddings, out.token_index, out.key_mask
