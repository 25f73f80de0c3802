"""A prompt's positions as the interface carries them, [4, 1, L] (the text row and M-RoPE's
three): a text prompt's, a 1-D family's, and an M-RoPE family's with one media item (its
`get_rope_index`, run without the model)."""

from __future__ import annotations

from typing import Any

import torch

from epd.model_runtime.adapter import Prompt, VisualMeta
from epd.model_runtime.visual_placeholders import placeholder_id


def text_prompt(input_ids: torch.Tensor) -> Prompt:
    """A prompt of text alone, input_ids [1, L]: every position row (M-RoPE's three and the text
    row; a 1-D family reads them alike) the plain position 0..L-1, no visual token."""
    length = input_ids.shape[1]
    return Prompt(input_ids, one_dim_positions(length), torch.zeros(length, dtype=torch.bool))


def one_dim_positions(length: int) -> torch.Tensor:
    """[4, 1, length]: the plain positions 0..length-1 in every row."""
    return torch.arange(length, dtype=torch.long).view(1, 1, length).expand(4, 1, length).clone()


def mrope_prompt_positions(
    model_cls,
    hf_config,
    input_ids: torch.Tensor,
    visual: VisualMeta,
    mm_token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """[4, 1, L]: the text row and `model_cls.get_rope_index`'s three M-RoPE rows of a prompt with
    one media item, as generate's `_prepare_position_ids_for_generation` (get_rope_index reads only
    self.config and self.get_vision_position_ids: no model needed, `RopeHolder`).
    `mm_token_type_ids` [1, L] (0 text, 1 image, 2 video): by default the media's placeholders,
    by the config's token id for its modality (GLM-4.1V's tell a video's by its markers)."""
    mm_type = 2 if visual.modality == "video" else 1
    if mm_token_type_ids is None:
        mm_token_type_ids = (input_ids == placeholder_id(hf_config, visual.modality)).long() * mm_type
    grid = torch.tensor([visual.grid_thw], dtype=torch.long)
    kwargs = {"video_grid_thw": grid} if mm_type == 2 else {"image_grid_thw": grid}
    rope_index: Any = model_cls.get_rope_index
    mrope, _ = rope_index(
        RopeHolder(hf_config, model_cls), input_ids, mm_token_type_ids=mm_token_type_ids, **kwargs
    )
    text_row = torch.arange(input_ids.shape[1], dtype=torch.long)[None, None]
    return torch.cat([text_row, mrope], dim=0)


class RopeHolder:
    """Stands in for `model_cls` (`Qwen3VLModel`, `Qwen3_5Model`, `Glm4vModel`) in its
    `get_rope_index`, which reads only these two."""

    def __init__(self, config, model_cls) -> None:
        self.config = config
        self._get_vision_position_ids = model_cls.get_vision_position_ids

    def get_vision_position_ids(self, *args, **kwargs):
        return self._get_vision_position_ids(self, *args, **kwargs)
