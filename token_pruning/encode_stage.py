"""The encode stage end to end on the vision tower's output: key tokens, then spatial merge.

Temporal dropping happens first and decides what the tower sees (`temporal.py`); this function
takes the tower's embeddings of the tokens that are present and returns the tokens that go on to
prefill, each named by its index in the *full* merged-token list, i.e. by which `<|video_pad|>`
placeholder of the unpruned prompt it replaces. With the prompt's visual indices that gives the
prompt to keep (`positions.prompt_keep_indices`) and its original position ids.

    present = temporal_redundancy_mask(...).keep_tokens   # or all True
    embeds  = tower(...)                                   # [present.sum(), D]
    out = prune_encoded_tokens(embeds, grid_thw, present, cfg)
    keep = prompt_keep_indices(L, visual_positions(input_ids, video_id), out.token_index)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epd.token_pruning.config import PruningConfig
from epd.token_pruning.grid import TokenGrid
from epd.token_pruning.key_tokens import select_key_tokens
from epd.token_pruning.spatial_merge import spatial_merge
from epd.token_pruning.temporal import _rows


@dataclass(frozen=True)
class EncodedTokens:
    embeddings: torch.Tensor
    """[N', D] embeddings that go to prefill, in prompt order."""
    token_index: torch.Tensor
    """[N'] long, increasing: index of each in the full merged-token list (all grid rows)."""
    sizes: torch.Tensor
    """[N'] float: original tokens each stands for (merging)."""
    key_mask: torch.Tensor
    """[N'] bool: key tokens, which no later stage drops."""
    num_tokens_full: int
    """Merged tokens of the unpruned grids."""
    num_tokens_present: int
    """Tokens that entered this stage (after temporal dropping)."""


def prune_encoded_tokens(
    embeddings: torch.Tensor,
    grid_thw: torch.Tensor | list,
    present: torch.Tensor | None,
    config: PruningConfig,
    merge_size: int = 2,
) -> EncodedTokens:
    """Key tokens (c) and spatial merge (b) on the present tokens of each grid row.

    `config.key_token_ratio` applies per video (ceil of the ratio of its present tokens), so a
    short clip next to a long one still gets its own key tokens.

    embeddings: [present.sum(), D] tower output. grid_thw: [num_videos, 3] in patches.
    present: [num_full_tokens] bool (None = all present).

    The embeddings stay on their device (the tower's); `token_index`, `sizes` and `key_mask` are
    bookkeeping on `present`'s (the CPU: the pixels it comes from are the processor's).
    """
    rows = _rows(grid_thw)
    grids = [TokenGrid.from_patch_grid(row, merge_size) for row in rows]
    num_full = sum(g.num_cells for g in grids)
    present = torch.ones(num_full, dtype=torch.bool) if present is None else present
    if present.numel() != num_full or embeddings.shape[0] != int(present.sum()):
        raise ValueError(
            f"{embeddings.shape[0]} embeddings and a mask of {present.numel()} for grids of {num_full} "
            f"tokens with {int(present.sum())} present"
        )
    parts: dict[str, list[torch.Tensor]] = {"emb": [], "index": [], "sizes": [], "key": []}
    cell_offset, emb_offset = 0, 0
    for full in grids:
        cells = present[cell_offset : cell_offset + full.num_cells].nonzero().flatten()
        grid = TokenGrid(full.t, full.h, full.w, cells)
        emb = embeddings[emb_offset : emb_offset + grid.num_tokens]
        key = select_key_tokens(emb, grid, config.key_token_ratio, score=config.key_token_score)
        sizes = torch.ones(grid.num_tokens, device=cells.device)
        index = cells + cell_offset
        if config.spatial_merge:
            merged = spatial_merge(
                emb, grid, config.spatial_merge_threshold, config.spatial_merge_window, key_mask=key
            )
            emb, sizes, key = merged.embeddings, merged.sizes, merged.key_mask
            index = index[merged.representative]
        parts["emb"].append(emb)
        parts["index"].append(index)
        parts["sizes"].append(sizes)
        parts["key"].append(key)
        cell_offset += full.num_cells
        emb_offset += grid.num_tokens
    return EncodedTokens(
        embeddings=torch.cat(parts["emb"]),
        token_index=torch.cat(parts["index"]),
        sizes=torch.cat(parts["sizes"]),
        key_mask=torch.cat(parts["key"]),
        num_tokens_full=num_full,
        num_tokens_present=int(present.sum()),
    )
