"""Encode stage (b): merge adjacent, near-identical visual tokens of one frame group.

Two tokens are linked when they are left/right or up/down neighbours on the merged-token grid,
in the same `window` x `window` square of their frame group, neither is a key token, and their
cosine similarity exceeds `threshold`. Each connected group of linked tokens becomes one token:
the size-weighted mean of its members, whose size is the sum of theirs. So the total weight
(sum of sizes, and the size-weighted sum of embeddings) is preserved exactly. Windows bound how
far a chain of pairwise-similar tokens can drift (A~B~C with A !~ C); they also fit any grid,
the last window of a row or column being smaller when h or w is not a multiple of `window`.

A merged token takes the place and the position ids of its first member (lowest index), so
the output stays in the original token order and survivors keep their original positions. The
`sizes` can feed ToMe-style proportional attention (add log(size) to the attention logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from epd.token_pruning.grid import TokenGrid


@dataclass(frozen=True)
class MergeResult:
    embeddings: torch.Tensor
    """[N', D] size-weighted mean of each group, in the dtype of the input."""
    sizes: torch.Tensor
    """[N'] float: original tokens each output token stands for."""
    representative: torch.Tensor
    """[N'] long, increasing: input index of each group's first member (whose position it keeps)."""
    assignment: torch.Tensor
    """[N] long: output index each input token went to."""
    grid: TokenGrid
    """Layout of the output tokens (the representatives' cells)."""
    key_mask: torch.Tensor
    """[N'] bool: output tokens that are key tokens (never merged, so they map one to one)."""

    @property
    def num_tokens_out(self) -> int:
        return int(self.representative.numel())


def _connected_components(num_nodes: int, edges: torch.Tensor) -> torch.Tensor:
    """[num_nodes] long: the smallest node index in each node's component (min-label propagation)."""
    labels = torch.arange(num_nodes, device=edges.device)
    if edges.numel() == 0:
        return labels
    a, b = edges
    while True:
        new = labels.clone()
        new.scatter_reduce_(0, a, labels[b], reduce="amin")
        new.scatter_reduce_(0, b, labels[a], reduce="amin")
        new = new[new]  # pointer jumping: converges in O(log diameter) rounds
        if torch.equal(new, labels):
            return labels
        labels = new


def spatial_merge(
    embeddings: torch.Tensor,
    grid: TokenGrid,
    threshold: float,
    window: int = 2,
    sizes: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> MergeResult:
    """Merge similar neighbours within windows.

    embeddings: [N, D] tower output in `grid` order. sizes: [N] (default all 1). key_mask: [N]
    bool, tokens never merged.

    Devices: similarities and the merged embeddings are computed on the embeddings' device (the
    tower's); which tokens link and the groups they form are index bookkeeping on the grid's
    (the CPU), so `sizes`, `representative`, `assignment` and `key_mask` come back there.
    """
    n = grid.num_tokens
    if embeddings.shape[0] != n:
        raise ValueError(f"{embeddings.shape[0]} embeddings for a grid of {n} tokens")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    device, index_device = embeddings.device, grid.flat_index.device
    sizes = torch.ones(n, device=device) if sizes is None else sizes.to(device, torch.float32)
    key_mask = (
        torch.zeros(n, dtype=torch.bool, device=index_device)
        if key_mask is None
        else key_mask.to(index_device)
    )

    a, b = grid.neighbour_pairs(spatial=True, temporal=False)  # [E] each, on index_device
    _, rows, cols = grid.coords()
    same_window = (rows[a] // window == rows[b] // window) & (cols[a] // window == cols[b] // window)
    unit = F.normalize(embeddings.float(), dim=-1)
    # [E] bools back to the grid's device: the E dot products are the work, the rest is bookkeeping.
    similar = ((unit[a.to(device)] * unit[b.to(device)]).sum(dim=-1) > threshold).to(index_device)
    linked = same_window & similar & ~key_mask[a] & ~key_mask[b]
    labels = _connected_components(n, torch.stack([a[linked], b[linked]]))

    representative, assignment = torch.unique(labels, sorted=True, return_inverse=True)
    num_out = representative.numel()
    on_device = assignment.to(device)
    weighted = torch.zeros(num_out, embeddings.shape[1], dtype=torch.float64, device=device)
    weighted.index_add_(0, on_device, embeddings.double() * sizes.double()[:, None])
    out_sizes = torch.zeros(num_out, dtype=torch.float64, device=device).index_add_(
        0, on_device, sizes.double()
    )
    merged = (weighted / out_sizes[:, None]).to(embeddings.dtype)
    return MergeResult(
        embeddings=merged,
        sizes=out_sizes.to(index_device, torch.float32),
        representative=representative,
        assignment=assignment,
        grid=grid.select(representative),
        key_mask=key_mask[representative],
    )
