"""`OneDimTextAdapter`: the shared language side (`HfTextAdapter`) for a text model with plain
1-D rotary positions."""

from __future__ import annotations

import torch

from epd.model_runtime.adapter import TextDims
from epd.model_runtime.hf_text import HfTextAdapter
from epd.model_runtime.qwen_text_layers import count_parameters


class OneDimTextAdapter(HfTextAdapter):
    """`HfTextAdapter` for a language model with plain 1-D rotary positions (LLaVA-OneVision's and
    InternVL's Qwen2 / Qwen3 / Llama). The interface's positions are 4 rows (Qwen's text row + M-RoPE
    rows); such a family fills all four with the same 1-D position and the model reads row 0:
    `Prompt.position_ids` is [4, 1, L] of arange(L) in every row (`one_dim_positions`),
    `PrefillState.next_position_ids` (the 4 ints that cross to decode) is [L, L, L, L], and each
    decode step's positions (+1 on every row, as the decode core does) are read from row 0. This
    is what `generate()` uses: positions 0..L-1, then L, L+1, ... No pruning hook that needs
    attention re-implemented (layerwise prefill, query capture) is written for these families."""

    # `HfTextAdapter.prefill_chunks` over `_prefill_padded` and `_prefill_continue`, on row 0
    supports_chunked_prefill = True

    def _text_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        return position_ids[0]  # [B, n]: every row holds the 1-D position

    @property
    def text_dims(self) -> TextDims:
        c = self.hf_config.text_config
        layers, kv_heads, head_dim, _ = self._kv_shape()
        return TextDims(layers, c.hidden_size, c.intermediate_size, c.num_attention_heads, kv_heads, head_dim)

    @property
    def num_parameters(self) -> int:
        return count_parameters(self.model, self.visual)
