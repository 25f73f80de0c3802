"""Keeping a pruned prompt's positions right.

Position ids are computed once, on the *unpruned* prompt (Qwen2-VL's `get_rope_index`: a
[4, 1, L] tensor, row 0 the plain position 0..L-1 and rows 1..3 M-RoPE t/h/w; or [3, 1, L]).
Every pruning step then gathers columns of that tensor, so a surviving token keeps the exact
position it had, gaps and all, and the text after the video keeps its positions too. The next
generated token's positions continue from the unpruned prompt's (Qwen2-VL's `rope_deltas`),
never from the pruned length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def visual_positions(input_ids: torch.Tensor, visual_token_id: int) -> torch.Tensor:
    """[V] long: sequence indices where input_ids ([1, L]) holds the visual placeholder token."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, L] (batch size 1), got {tuple(input_ids.shape)}")
    return (input_ids[0] == visual_token_id).nonzero().flatten()


def prompt_keep_indices(seq_len: int, visual_index: torch.Tensor, keep_visual: torch.Tensor) -> torch.Tensor:
    """[L'] long, increasing: every non-visual index plus the kept visual ones.

    visual_index: [V] sequence indices of the visual tokens. keep_visual: [V] bool, or [V'] long
    indices into `visual_index`. On `visual_index`'s device.
    """
    keep = torch.ones(seq_len, dtype=torch.bool, device=visual_index.device)
    keep[visual_index] = False
    keep_visual = keep_visual.to(visual_index.device)
    if keep_visual.dtype == torch.bool:
        if keep_visual.numel() != visual_index.numel():
            raise ValueError(
                f"keep mask has {keep_visual.numel()} entries for {visual_index.numel()} visual tokens"
            )
        keep[visual_index[keep_visual]] = True
    else:
        keep[visual_index[keep_visual]] = True
    return keep.nonzero().flatten()


@dataclass(frozen=True)
class PrunedPrompt:
    input_ids: torch.Tensor
    """[1, L'] the prompt with dropped visual placeholders removed."""
    position_ids: torch.Tensor
    """[R, 1, L'] the original position ids of the survivors (R = 3 or 4)."""
    keep_indices: torch.Tensor
    """[L'] long: each survivor's index in the unpruned prompt."""
    attention_mask: torch.Tensor
    """[1, L'] ones. Always pass it: with gapped row-0 positions, no mask and no cache,
    transformers reads each gap as the start of a new packed sequence and blocks attention
    across it."""


def gather_prompt(
    input_ids: torch.Tensor, position_ids: torch.Tensor, keep_indices: torch.Tensor
) -> PrunedPrompt:
    """Select the survivors' ids and original positions. position_ids: [R, 1, L]."""
    if position_ids.shape[-1] != input_ids.shape[-1]:
        raise ValueError(
            f"position_ids cover {position_ids.shape[-1]} tokens but input_ids has {input_ids.shape[-1]}"
        )
    return PrunedPrompt(
        input_ids=input_ids[:, keep_indices],
        position_ids=position_ids[..., keep_indices],
        keep_indices=keep_indices,
        attention_mask=torch.ones(1, keep_indices.numel(), dtype=torch.long, device=input_ids.device),
    )
