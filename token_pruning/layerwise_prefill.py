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

The model is reached only through `VLMAdapter.layerwise_prefill` (a `LayerwisePass`: run layers
[a, b), score at a layer's input, keep tokens); each family implements it in its own file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from epd.model_runtime.adapter import LayerwisePass, VLMAdapter
from epd.token_pruning.budget import resolve_keep_count, staged_keep_counts
from epd.token_pruning.text_guided import PrefillDropResult, text_guided_drop, text_query_positions


@dataclass
class LayerwisePrefillResult:
    last_hidden_state: torch.Tensor
    """[1, L', hidden] after the final norm (the last row gives the first token's logits)."""
    past_key_values: Any
    """The family's cache object (transformers DynamicCache for Qwen), every layer holding L'
    entries; `VLMAdapter.chunk_cache_to_kv` turns it into a `KvCache`."""
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


def _start(model: Any, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> tuple[LayerwisePass, int]:
    """The pass and the number of decoder layers. `model`: a `VLMAdapter`, or a bare transformers
    Qwen2-VL / Qwen2.5-VL text model (tests and notebooks), run by the Qwen family file."""
    if isinstance(model, VLMAdapter):
        return model.layerwise_prefill(inputs_embeds, position_ids), model.num_layers
    from epd.model_runtime.qwen_text_layers import QwenLayerwisePass, text_model_num_layers

    return QwenLayerwisePass(model, inputs_embeds, position_ids), text_model_num_layers(model)


@torch.no_grad()
def prefill_with_drop(
    model: Any,
    inputs_embeds: torch.Tensor,
    position_ids: torch.Tensor,
    visual_index: torch.Tensor,
    drop_layer: int | Sequence[int] | None,
    keep_ratio: float = 1.0,
    keep_count: int | None = None,
    key_mask: torch.Tensor | None = None,
    query_window: int = 0,
) -> LayerwisePrefillResult:
    """Run the language model's prefill, dropping visual tokens at `drop_layer` (None: never).

    drop_layer: one layer, or several (ascending) for a staged drop whose survivors shrink
    geometrically to the final budget, `resolve_keep_count(V, keep_ratio, keep_count)`.
    model: a `VLMAdapter` (or a bare transformers Qwen2-VL text model, see `_start`).

    inputs_embeds: [1, L, hidden] with the visual features already in place. position_ids:
    [4, 1, L] (row 0 text positions, rows 1..3 M-RoPE) or [3, 1, L]. visual_index: [V] indices
    of the visual tokens in L. key_mask: [V] bool, never dropped.
    """
    run, num_layers = _start(model, inputs_embeds, position_ids)
    drop_layers = (
        [] if drop_layer is None else [drop_layer] if isinstance(drop_layer, int) else list(drop_layer)
    )
    for d in drop_layers:
        if not 0 <= d < num_layers:
            raise ValueError(f"drop layers must be in [0, {num_layers - 1}], got {drop_layers}")
    if any(b <= a for a, b in zip(drop_layers, drop_layers[1:])):
        raise ValueError(f"drop layers must be strictly ascending, got {drop_layers}")
    num_visual = visual_index.numel()
    final = resolve_keep_count(num_visual, keep_ratio, keep_count)
    budget = (
        dict(zip(drop_layers, staged_keep_counts(num_visual, final, len(drop_layers)))) if drop_layers else {}
    )
    # Index bookkeeping stays on visual_index's device (the CPU, with the prompt); the model's
    # tensors take those indices where they are (indexing a device tensor with CPU indices works).
    keep = torch.arange(inputs_embeds.shape[1], device=visual_index.device)
    drop = None
    lengths: list[int] = []
    visual_per_stage: list[int] = []
    visual_now, key_now = visual_index, key_mask  # in the current (shrinking) sequence
    bounds = sorted({0, *drop_layers, num_layers})  # segments of layers between drops
    for start, stop in zip(bounds, bounds[1:]):
        if start in budget:
            length_now = run.num_tokens
            queries = text_query_positions(length_now, visual_now, query_window)
            q, k = run.layer_queries(start, queries)
            drop = text_guided_drop(q, k, queries, visual_now, keep_count=budget[start], key_mask=key_now)
            here = drop.keep_indices  # [L_next] indices into the current sequence
            keep = keep[here]
            is_visual = torch.zeros(length_now, dtype=torch.bool, device=visual_now.device)
            is_visual[visual_now] = True
            visual_now = is_visual[here].nonzero().flatten()
            key_now = None if key_now is None else key_now[drop.kept_visual]
            visual_per_stage.append(int(visual_now.numel()))
            run.keep(here)
        run.run_layers(start, stop)
        lengths += [run.num_tokens] * (stop - start)
    last_hidden, cache = run.finish()
    return LayerwisePrefillResult(
        last_hidden_state=last_hidden,
        past_key_values=cache,
        keep_indices=keep,
        position_ids=position_ids[..., keep],
        drop=drop,
        tokens_per_layer=lengths,
        visual_per_stage=visual_per_stage,
    )
