"""Encode stage (c): the key token set, which no later stage may drop or merge away.

MustDrop takes key tokens from the vision encoder's [CLS] attention. Qwen2-VL's tower has no
CLS token, so we score each merged token (the tower's output, [N, D]) by one of:

* "distinct" (default): 1 - the highest cosine similarity to any present neighbour on the grid
  (left/right/up/down in its frame group, and the same cell in the previous/next group). A token
  unlike all of its neighbours carries detail that neither a merge nor the surrounding tokens
  can stand in for (an edge, a small object, something that just appeared); a token that
  resembles a neighbour is, by construction, recoverable from it. A token with no present
  neighbour scores 2 (nothing can stand in for it).
* "norm": the L2 norm of the embedding. Cheap and order-free, but in ViTs large norms also mark
  "register"-like artifact tokens in flat background, so it is offered for comparison only.

Ties go to the earlier token, so the choice is deterministic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epd.token_pruning.budget import resolve_keep_count
from epd.token_pruning.grid import TokenGrid


def key_token_scores(embeddings: torch.Tensor, grid: TokenGrid, score: str = "distinct") -> torch.Tensor:
    """[N] float saliency of each token, on the embeddings' device. embeddings: [N, D] in `grid` order."""
    if embeddings.shape[0] != grid.num_tokens:
        raise ValueError(f"{embeddings.shape[0]} embeddings for a grid of {grid.num_tokens} tokens")
    x = embeddings.float()
    if score == "norm":
        return x.norm(dim=-1)
    if score != "distinct":
        raise ValueError(f"key token score must be 'distinct' or 'norm', got {score!r}")
    a, b = (i.to(x.device) for i in grid.neighbour_pairs(spatial=True, temporal=True))
    unit = F.normalize(x, dim=-1)
    sim = (unit[a] * unit[b]).sum(dim=-1)  # [E]
    best = torch.full((grid.num_tokens,), -1.0, device=x.device)
    best.scatter_reduce_(0, a, sim, reduce="amax")
    best.scatter_reduce_(0, b, sim, reduce="amax")
    return 1.0 - best


def select_key_tokens(
    embeddings: torch.Tensor,
    grid: TokenGrid,
    key_ratio: float = 0.0,
    key_count: int | None = None,
    score: str = "distinct",
) -> torch.Tensor:
    """[N] bool on the grid's device: the top ceil(key_ratio * N) (or `key_count`) tokens by
    `score` are key tokens."""
    num_key = resolve_keep_count(grid.num_tokens, key_ratio, key_count)
    mask = torch.zeros(grid.num_tokens, dtype=torch.bool, device=grid.flat_index.device)
    if num_key == 0:
        return mask
    # [N] scores from the embeddings' device to the grid's: the choice is index bookkeeping.
    scores = key_token_scores(embeddings, grid, score).to(mask.device)
    # Stable descending sort: equal scores go to the earlier token.
    order = torch.sort(scores, descending=True, stable=True).indices
    mask[order[:num_key]] = True
    return mask
