"""Left-right mirroring of prepared training inputs: a second, equally valid view of every clip.

The runs overfit the 4,000 training clips (the vision tower fits the auxiliary targets of the
training clips far better than its answers generalise: shape and direction lag). A mirrored clip
is a new clip of the same world: shapes stay what they are (every shape is left-right symmetric:
circle, square, apex-up triangle), counts, orders, entries, exits and end events stay, and only
"left" and "right" swap, in the direction answers and in the auxiliary direction targets.

Mirroring works on the processor's output directly, so no clip is decoded or preprocessed twice.
Qwen2-VL's processor lays a video out as patches in the order (t, h / m, w / m, m, m) with m = 2
(the merge size), each patch flattened as (channel, temporal patch 2, 14 rows, 14 columns):
mirroring reverses the column-block, the column-inside-block and the pixel-column axes. The
normalisation is per channel, so mirroring and preprocessing commute (a test checks it against
the processor run on mirrored frames).
"""

from __future__ import annotations

import torch

from epd.synth.scene import DIRECTIONS
from epd.train.aux_targets import IGNORE, TokenTargets

_MIRRORED_WORD = {"left": "right", "right": "left"}
"""The only answers (and direction targets) a left-right mirror changes."""
_SWAP = {DIRECTIONS.index(a): DIRECTIONS.index(b) for a, b in _MIRRORED_WORD.items()}


def mirror_pixels(
    pixel_values: torch.Tensor, grid_thw: tuple[int, int, int], merge: int = 2, temporal_patch: int = 2
) -> torch.Tensor:
    """[t * h * w, C * tp * p * p] patches of one media file -> the same of its mirror image."""
    t, h, w = grid_thw
    n, dim = pixel_values.shape
    patch = int(round((dim / (3 * temporal_patch)) ** 0.5))
    x = pixel_values.reshape(t, h // merge, w // merge, merge, merge, 3, temporal_patch, patch, patch)
    return x.flip(2, 4, 8).reshape(n, dim)


def mirror_targets(targets: TokenTargets, grid_thw: tuple[int, int, int], merge: int = 2) -> TokenTargets:
    """Targets of the mirrored file: tokens reordered column-wise, left and right swapped."""
    t, h, w = grid_thw
    rows, cols = h // merge, w // merge
    order = torch.arange(t * rows * cols).reshape(t, rows, cols).flip(2).reshape(-1)

    def swap(d: torch.Tensor) -> torch.Tensor:
        out = d.clone()
        for a, b in _SWAP.items():
            out[d == a] = b
        return out

    return TokenTargets(
        cell_present=targets.cell_present[order],
        cell_shape=targets.cell_shape[order],
        cell_dir=swap(targets.cell_dir[order]),
        group_present=targets.group_present[order],
        group_shape=targets.group_shape[order],
        group_dir=swap(targets.group_dir[order]),
    )


def mirror_answer(answer: str) -> str:
    """The answer to the same question about the mirrored clip."""
    return _MIRRORED_WORD.get(answer, answer)


def mirrored_answer_ids(tokenizer) -> dict[str, torch.Tensor]:
    """The supervised ids (answer + <|im_end|>) of every answer that mirroring changes."""
    end = tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]
    return {
        w: torch.tensor(tokenizer(w, add_special_tokens=False)["input_ids"] + end, dtype=torch.long)
        for w in _MIRRORED_WORD
    }


def mirror_sequence(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor,
    answer: str,
    answer_ids: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [L], position_ids [4, L] and labels [L] of the same question about the mirrored
    clip: the supervised tail (answer + <|im_end|>) replaced by the mirrored answer's ids. The
    question names objects by colour or shape, which mirroring leaves alone; the answer tokens
    are text after the video, so every position row continues by one per token."""
    new = mirror_answer(answer)
    if new == answer:
        return input_ids, position_ids, labels
    prompt_len = int((labels == IGNORE).sum())  # the supervised tokens are the tail
    tail = answer_ids[new]
    steps = torch.arange(1, len(tail) + 1)
    positions = torch.cat(
        [position_ids[:, :prompt_len], position_ids[:, prompt_len - 1 : prompt_len] + steps], 1
    )
    ids = torch.cat([input_ids[:prompt_len], tail])
    new_labels = torch.cat([labels[:prompt_len], tail])
    return ids, positions, new_labels
