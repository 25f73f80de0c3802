"""Encode stage (a): drop merged tokens whose pixels did not change since the previous frame group.

Input layout (Qwen2-VL's processor): `pixel_values_videos` is [num_patches, C*tp*p*p] (tp = 2
frames per temporal patch, p = 14), ordered frame group by frame group, then over the patch
grid in 2x2 merge blocks, so each run of 4 consecutive patches is one merged token.
`video_grid_thw` rows are [t, h, w] in patches; a row has t*h*w patches and t*(h/2)*(w/2) tokens.

The rule: a token is *unchanged* if the mean absolute difference between its 4 patches and the
reference at the same cell is below `threshold`. The reference is the last *kept* token at that
cell, not simply the previous group, so that slow drift (a shadow creeping a pixel per frame)
still accumulates into a change and is kept. The first frame group is always kept.

Where to drop, and the trade-off (`PruningConfig.temporal_before_tower`):

* Before the tower (`sparse_vision_inputs`): the dropped patches never run through the vision
  tower, which dominates encode time on CPU. Qwen2-VL's tower attends within each frame group
  (cu_seqlens per group) and takes its rotary positions and group lengths as precomputed
  kwargs, so we hand it only the kept patches with their original (row, col) positions. The
  cost: a kept token attends only to the kept tokens of its group, so its embedding differs
  slightly from the full-grid one. Whole dropped groups change nothing for the other groups.
  Qwen2.5-VL's windowed attention reorders patches by window; it is not supported there: drop
  after the tower instead.
* After the tower (`keep_tokens` applied to the tower output): the kept embeddings are exactly
  the unpruned ones, prefill and KV still shrink, but encode time does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TemporalDropResult:
    keep_tokens: torch.Tensor
    """[num_merged_tokens] bool over every row of grid_thw in order; True = keep."""
    keep_patches: torch.Tensor
    """[num_patches] bool: `keep_tokens` expanded to the merge_size**2 patches of each token."""
    change: torch.Tensor
    """[num_merged_tokens] float: mean |difference| to the reference (inf for first groups)."""

    @property
    def num_tokens_in(self) -> int:
        return int(self.keep_tokens.numel())

    @property
    def num_tokens_out(self) -> int:
        return int(self.keep_tokens.sum())


def _rows(grid_thw: torch.Tensor | list) -> list[tuple[int, int, int]]:
    rows = torch.as_tensor(grid_thw).reshape(-1, 3).tolist()
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def temporal_redundancy_mask(
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor | list,
    threshold: float,
    merge_size: int = 2,
) -> TemporalDropResult:
    """Mark merged tokens that are unchanged versus the last kept token at the same cell.

    pixel_values: [num_patches, patch_dim] as produced by the processor.
    grid_thw: [num_videos, 3] patch grid rows (t, h, w); several videos are concatenated.
    threshold: unchanged if mean |diff| < threshold; 0 keeps everything.
    """
    unit = merge_size * merge_size
    keep_parts, change_parts = [], []
    offset = 0
    for t, h, w in _rows(grid_thw):
        num_patches = t * h * w
        per_frame = (h // merge_size) * (w // merge_size)
        # [t, tokens_per_frame, unit * patch_dim]: one row per merged token.
        tokens = pixel_values[offset : offset + num_patches].reshape(t, per_frame, -1).float()
        offset += num_patches
        keep = torch.ones(t, per_frame, dtype=torch.bool, device=pixel_values.device)
        change = torch.full((t, per_frame), float("inf"), device=pixel_values.device)
        reference = tokens[0].clone()
        for i in range(1, t):
            change[i] = (tokens[i] - reference).abs().mean(dim=-1)
            keep[i] = change[i] >= threshold
            reference[keep[i]] = tokens[i][keep[i]]
        keep_parts.append(keep.reshape(-1))
        change_parts.append(change.reshape(-1))
    if offset != pixel_values.shape[0]:
        raise ValueError(f"grid_thw describes {offset} patches but pixel_values has {pixel_values.shape[0]}")
    keep_tokens = torch.cat(keep_parts)
    return TemporalDropResult(
        keep_tokens=keep_tokens,
        keep_patches=keep_tokens.repeat_interleave(unit),
        change=torch.cat(change_parts),
    )


@dataclass(frozen=True)
class SparseVisionInputs:
    """What Qwen2-VL's vision tower needs to run on a subset of merged tokens.

    Call: `visual(inputs.pixel_values, grid_thw=grid_thw, position_ids=inputs.position_ids,
    cu_seqlens=inputs.cu_seqlens)`; the tower pops the two precomputed kwargs instead of deriving
    them from the full grid. Its output has one embedding per kept merged token, in order.
    """

    pixel_values: torch.Tensor
    """[num_kept_patches, patch_dim]."""
    position_ids: torch.Tensor
    """[num_kept_patches, 2] long: each kept patch's (row, col) on its frame's patch grid."""
    cu_seqlens: torch.Tensor
    """[num_nonempty_groups + 1] int32: attention segment bounds, one per frame group that kept
    at least one token (empty segments are left out: attention kernels reject them)."""


def vision_patch_positions(grid_thw: torch.Tensor | list, merge_size: int = 2) -> torch.Tensor:
    """[num_patches, 2] long (row, col) per patch in the processor's 2x2-block order.

    Same layout as transformers' `get_vision_position_ids` for Qwen2-VL.
    """
    parts = []
    for t, h, w in _rows(grid_thw):
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge_size, merge_size, w // merge_size, merge_size)
        rows = rows.reshape(block).transpose(1, 2).reshape(-1)
        cols = cols.reshape(block).transpose(1, 2).reshape(-1)
        parts.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(parts)


def sparse_vision_inputs(
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor | list,
    keep_tokens: torch.Tensor,
    merge_size: int = 2,
) -> SparseVisionInputs:
    """Gather the kept tokens' patches, positions and per-group attention segments (on the
    pixels' device, where the tower's adapter moves them from)."""
    unit = merge_size * merge_size
    keep_patches = keep_tokens.to(pixel_values.device).repeat_interleave(unit)
    if keep_patches.numel() != pixel_values.shape[0]:
        raise ValueError(
            f"keep_tokens covers {keep_patches.numel()} patches but pixel_values has {pixel_values.shape[0]}"
        )
    group_lengths = []
    for t, h, w in _rows(grid_thw):
        group_lengths += [h * w] * t
    device = keep_patches.device
    groups = torch.repeat_interleave(
        torch.arange(len(group_lengths), device=device), torch.tensor(group_lengths, device=device)
    )
    kept_per_group = torch.bincount(groups[keep_patches], minlength=len(group_lengths))
    kept_per_group = kept_per_group[kept_per_group > 0]
    cu_seqlens = torch.nn.functional.pad(kept_per_group.cumsum(0), (1, 0)).to(torch.int32)
    return SparseVisionInputs(
        pixel_values=pixel_values[keep_patches],
        position_ids=vision_patch_positions(grid_thw, merge_size).to(device)[keep_patches],
        cu_seqlens=cu_seqlens,
    )
