"""A prefill that drops visual tokens part-way through the decoder (FastKV / MustDrop prefill).

Layers before the first drop layer run on the whole prompt. At a drop layer, the question's
queries score the visual tokens still present from that layer's own (normalised, projected,
M-RoPE-rotated) input; `text_guided_drop` keeps that stage's budget of them, and every later
layer runs on the survivors only, with their original position ids (cos/sin gathered, never
recomputed from a shorter range). With several drop layers (PyramidDrop-style stages) this
repeats, each stage scoring afresh. The earlier layers' cache entries of the dropped tokens are
removed too, so every layer's cache has the same length L' and the result is an ordinary
`DynamicCache`.

Decoding afterwards: the cache holds L' entries, but the next token's position continues from
the *unpruned* prompt (Qwen2-VL: `position = L + rope_deltas`); pass position_ids explicitly.

Written against transformers 5.x Qwen2-VL / Qwen2.5-VL text models (`language_model.layers`,
`.rotary_emb`, `.norm`; decoder layers called with keyword arguments), batch size 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from epd.token_pruning.budget import resolve_keep_count, staged_keep_counts
from epd.token_pruning.query_capture import rotated_states
from epd.token_pruning.text_guided import PrefillDropResult, question_query_positions, text_guided_drop


@dataclass
class LayerwisePrefillResult:
    last_hidden_state: torch.Tensor
    """[1, L', hidden] after the final norm (the last row gives the first token's logits)."""
    past_key_values: object
    """transformers DynamicCache, every layer holding L' entries."""
    keep_indices: torch.Tensor
    """[L'] long: survivors' indices in the unpruned prompt."""
    position_ids: torch.Tensor
    """[R, 1, L'] survivors' original position ids."""
    drop: PrefillDropResult | None
    """Scores and survivors of the last drop (None when no drop ran); its indices are relative to
    the tokens present at that stage."""
    tokens_per_layer: list[int]
    """Sequence length each decoder layer ran on (for the FLOPs estimate)."""
    visual_per_stage: list[int] = field(default_factory=list)
    """Visual tokens left after each drop stage, in layer order."""


def _causal_mask(language_model: Any, length: int, dtype: torch.dtype) -> torch.Tensor | None:
    """SDPA/flash kernels are causal by themselves when given no mask; eager needs one [1,1,n,n]."""
    if getattr(language_model.config, "_attn_implementation", "eager") != "eager":
        return None
    return torch.full((length, length), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]


@torch.no_grad()
def prefill_with_drop(
    language_model: Any,
    inputs_embeds: torch.Tensor,
    position_ids: torch.Tensor,
    visual_index: torch.Tensor,
    drop_layer: int | Sequence[int] | None,
    keep_ratio: float = 1.0,
    keep_count: int | None = None,
    key_mask: torch.Tensor | None = None,
    query_window: int = 0,
) -> LayerwisePrefillResult:
    """Run the text model's prefill, dropping visual tokens at `drop_layer` (None: never).

    drop_layer: one layer, or several (ascending) for a staged drop whose survivors shrink
    geometrically to the final budget, `resolve_keep_count(V, keep_ratio, keep_count)`.
    language_model: a transformers Qwen2-VL / Qwen2.5-VL text model (`model.model.language_model`).

    inputs_embeds: [1, L, hidden] with the visual features already in place. position_ids:
    [4, 1, L] (row 0 text positions, rows 1..3 M-RoPE) or [3, 1, L]. visual_index: [V] indices
    of the visual tokens in L. key_mask: [V] bool, never dropped.
    """
    from transformers import DynamicCache

    layers = language_model.layers
    drop_layers = [] if drop_layer is None else [drop_layer] if isinstance(drop_layer, int) else list(drop_layer)
    for d in drop_layers:
        if not 0 <= d < len(layers):
            raise ValueError(f"drop layers must be in [0, {len(layers) - 1}], got {drop_layers}")
    if any(b <= a for a, b in zip(drop_layers, drop_layers[1:])):
        raise ValueError(f"drop layers must be strictly ascending, got {drop_layers}")
    num_visual = visual_index.numel()
    final = resolve_keep_count(num_visual, keep_ratio, keep_count)
    budget = dict(zip(drop_layers, staged_keep_counts(num_visual, final, len(drop_layers)))) if drop_layers else {}
    seq_len = inputs_embeds.shape[1]
    rope_rows = position_ids[1:] if position_ids.shape[0] == 4 else position_ids
    text_rows = position_ids[0] if position_ids.shape[0] == 4 else None
    cache = DynamicCache(config=language_model.config)
    hidden = inputs_embeds
    cos, sin = language_model.rotary_emb(hidden, rope_rows)  # each [1, L, head_dim]
    keep = torch.arange(seq_len)
    mask = _causal_mask(language_model, seq_len, hidden.dtype)
    drop = None
    lengths: list[int] = []
    visual_per_stage: list[int] = []
    visual_now, key_now = visual_index, key_mask  # in the current (shrinking) sequence
    for i, layer in enumerate(layers):
        if i in budget:
            attn = layer.self_attn
            normed = layer.input_layernorm(hidden)
            length_now = hidden.shape[1]
            queries = question_query_positions(length_now, visual_now, query_window)
            q = rotated_states(attn, normed[:, queries], cos[:, queries], sin[:, queries], "q_proj")
            k = rotated_states(attn, normed, cos, sin, "k_proj")
            drop = text_guided_drop(q, k, queries, visual_now, keep_count=budget[i], key_mask=key_now)
            here = drop.keep_indices  # [L_next] indices into the current sequence
            keep = keep[here]
            is_visual = torch.zeros(length_now, dtype=torch.bool)
            is_visual[visual_now] = True
            visual_now = is_visual[here].nonzero().flatten()
            key_now = None if key_now is None else key_now[drop.kept_visual]
            visual_per_stage.append(int(visual_now.numel()))
            hidden, cos, sin = hidden[:, here], cos[:, here], sin[:, here]
            done: Any
            for done in cache.layers[:i]:  # DynamicLayer: keys, values [1, kv_heads, L, D]
                done.keys, done.values = done.keys[:, :, here], done.values[:, :, here]
            mask = _causal_mask(language_model, here.numel(), hidden.dtype)
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_embeddings=(cos, sin),
            position_ids=None if text_rows is None else text_rows[:, keep],
            past_key_values=cache,
            use_cache=True,
        )
        lengths.append(hidden.shape[1])
    return LayerwisePrefillResult(
        last_hidden_state=language_model.norm(hidden),
        past_key_values=cache,
        keep_indices=keep,
        position_ids=position_ids[..., keep],
        drop=drop,
        tokens_per_layer=lengths,
        visual_per_stage=visual_per_stage,
    )
