"""Where each surviving visual token sits on the merged-token grid of one video (or image).

Qwen2-VL's vision tower emits one embedding per merged token (2x2 patches), in order
(t, row, col) over a grid of t x (h/2) x (w/2) merged tokens. After temporal dropping or
merging, only some of those grid cells remain; `TokenGrid` remembers which, so that neighbour
lookups, windows and position ids stay right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenGrid:
    """Layout of N present visual tokens on a [t, h, w] merged-token grid."""

    t: int
    """Temporal groups (frames / temporal_patch_size)."""
    h: int
    """Merged-token rows (patch rows / spatial merge size)."""
    w: int
    """Merged-token columns."""
    flat_index: torch.Tensor
    """[N] long, strictly increasing: the cell (t*h*w order) of each present token. Index
    bookkeeping, on the CPU in the encode stage (`full` makes it there); what the grid derives
    (coordinates, neighbour pairs) is on this tensor's device."""

    @classmethod
    def full(cls, t: int, h: int, w: int) -> TokenGrid:
        return cls(t, h, w, torch.arange(t * h * w))

    @classmethod
    def from_patch_grid(cls, grid_thw: tuple[int, int, int], merge_size: int = 2) -> TokenGrid:
        """The full grid for a `video_grid_thw` row given in patches ([t, h, w])."""
        t, h, w = (int(x) for x in grid_thw)
        if h % merge_size or w % merge_size:
            raise ValueError(f"grid h={h}, w={w} must be multiples of the merge size {merge_size}")
        return cls.full(t, h // merge_size, w // merge_size)

    @property
    def num_tokens(self) -> int:
        return int(self.flat_index.numel())

    @property
    def num_cells(self) -> int:
        return self.t * self.h * self.w

    def coords(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(t, row, col) of each present token, each [N] long."""
        per_frame = self.h * self.w
        return (
            self.flat_index // per_frame,
            (self.flat_index % per_frame) // self.w,
            self.flat_index % self.w,
        )

    def cell_to_token(self) -> torch.Tensor:
        """[t, h, w] long: index of the present token in each cell, -1 where none is."""
        device = self.flat_index.device
        table = torch.full((self.num_cells,), -1, dtype=torch.long, device=device)
        table[self.flat_index] = torch.arange(self.num_tokens, device=device)
        return table.view(self.t, self.h, self.w)

    def select(self, token_index: torch.Tensor) -> TokenGrid:
        """The grid of a subset of the present tokens (`token_index`: [N'] increasing)."""
        return TokenGrid(self.t, self.h, self.w, self.flat_index[token_index])

    def neighbour_pairs(self, *, spatial: bool = True, temporal: bool = False) -> torch.Tensor:
        """[2, E] long: pairs (a, b) of present tokens that are adjacent, a < b.

        Spatial: right and down neighbours in the same frame group. Temporal: the same cell in the
        next frame group.
        """
        table = self.cell_to_token()
        pairs = []
        if spatial:
            pairs.append(torch.stack([table[:, :, :-1].reshape(-1), table[:, :, 1:].reshape(-1)]))
            pairs.append(torch.stack([table[:, :-1, :].reshape(-1), table[:, 1:, :].reshape(-1)]))
        if temporal:
            pairs.append(torch.stack([table[:-1].reshape(-1), table[1:].reshape(-1)]))
        if not pairs:
            return torch.empty(2, 0, dtype=torch.long, device=self.flat_index.device)
        edges = torch.cat(pairs, dim=1)
        return edges[:, (edges >= 0).all(dim=0)]
