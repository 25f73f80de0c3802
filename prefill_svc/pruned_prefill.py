"""Prefill with token dropping and KV compression (runs only when a request enables them).

    full prompt [1, L]  --(encode-stage drops: fewer placeholders)-->  [1, L']
        layers < d on L' tokens; at layer d the question's queries score the visual tokens
        (MustDrop dual rule) and layers >= d run on the survivors (repeated at each drop layer
        d1 < d2 < ... when several are configured)  -->  cache of L'' entries
    --(LOOK-M: text-prior eviction + merging, per layer and KV head)-->  cache of T + k entries

Positions are computed once on the full prompt and gathered, so every surviving token keeps its
original M-RoPE position, and the next token continues from the full prompt's last position.
With every stage off this module is not used at all (the exact path is `adapter.prefill`).
The model is reached through `VLMAdapter` only (`embed`, `layerwise_prefill`, `capture_queries`,
`logits`, `chunk_cache_to_kv`, `text_dims`): a family that lacks one is refused with its
`UnsupportedByFamily` (a ValueError, so the request gets INVALID_ARGUMENT).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch

from epd.model_runtime.adapter import CapturedQueries, PrefillState, Prompt, VLMAdapter
from epd.model_runtime.kv_cache import KvCache
from epd.token_pruning import (
    ModelSizes,
    PruningConfig,
    PruningStats,
    compress_kv_cache,
    gather_prompt,
    prefill_flops,
    prompt_keep_indices,
    resolve_keep_count,
    staged_keep_counts,
    text_prior_scores,
    text_query_positions,
)
from epd.token_pruning.layerwise_prefill import prefill_with_drop


@dataclass
class PrunedPrefill:
    state: PrefillState
    visual_entry_mask: torch.Tensor  # [num_layers, num_kv_heads, num_cached] bool
    kept_visual_token_index: list[int]  # full-list index of each visual token after the drop
    kv_bytes_before: int


def prefill_keep_target(config: PruningConfig, num_entering: int, num_video: int) -> int:
    """Visual tokens left after the (last) prefill drop: `prefill_keep_count` if set, else the
    ratio of the tokens entering prefill or, with basis "video", of the video's tokens before
    the encode stages (never more than enter)."""
    if config.prefill_keep_count is not None or config.prefill_keep_basis == "entering":
        return resolve_keep_count(num_entering, config.prefill_keep_ratio, config.prefill_keep_count)
    return min(num_entering, resolve_keep_count(num_video, config.prefill_keep_ratio))


def sent_kv_element_bytes(config: PruningConfig, cache: KvCache) -> int:
    """Bytes of one KV element as the cache is sent to decode: `kv_dtype`'s (the engine casts after
    compression) or, with "auto", the cache's own. `kv_budget_bytes` is a budget on what is sent."""
    if config.kv_dtype == "auto":
        return cache.keys[0].element_size()
    return getattr(torch, config.kv_dtype).itemsize


@torch.inference_mode()
def pruned_prefill(
    adapter: VLMAdapter,
    prompt: Prompt,
    embeds: torch.Tensor,
    token_index: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    config: PruningConfig,
    stats: PruningStats,
) -> PrunedPrefill:
    """prompt: the full prompt (every placeholder). embeds: [N', hidden], one per token of
    `token_index` ([N'] full-list indices; None = all). key_mask: [N'] bool or None.

    Devices: the model's tensors (hidden states, queries, the cache) stay on the adapter's device
    and the scores are computed there; the prompt's positions, the kept indices and the visual-entry
    mask (which crosses to Decode) are bookkeeping on the CPU, with the prompt."""
    num_layers = adapter.num_layers
    full_visual = prompt.visual_mask.nonzero().flatten()  # [V] prompt indices of placeholders
    if token_index is None:
        token_index = torch.arange(full_visual.numel())
    keep = prompt_keep_indices(prompt.num_tokens, full_visual, token_index)
    pruned = gather_prompt(prompt.input_ids, prompt.position_ids, keep)
    visual_index = prompt.visual_mask[keep].nonzero().flatten()  # [N'] in the pruned prompt
    hidden = adapter.embed(pruned.input_ids)  # [1, L', hidden]
    hidden[0, visual_index] = embeds.to(hidden.device, hidden.dtype)

    drop_layers = config.drop_layers(num_layers)
    num_visual = visual_index.numel()
    num_after_drop = num_visual
    counts: list[int] = []
    if drop_layers:
        num_after_drop = prefill_keep_target(config, num_visual, full_visual.numel())
        if num_after_drop == num_visual:  # the encode stages already met the budget: skip the scoring
            drop_layers = ()
        else:
            counts = staged_keep_counts(num_visual, num_after_drop, len(drop_layers))
    length = pruned.input_ids.shape[1]
    length_after = length - (num_visual - num_after_drop)
    captures: list[CapturedQueries] = []
    with ExitStack() as open_captures:
        if config.kv_compress:
            # Question queries for KV scoring: the text after the video (a window that reaches into
            # the video is clamped, `text_query_positions`), in each layer's own sequence: shorter
            # after each drop, and every dropped token precedes every query, so a query sits as many
            # places earlier as tokens were dropped before its layer. [Q] each.
            q_before = text_query_positions(length, visual_index, config.kv_query_window)
            q_after = q_before - (length - length_after)
            bounds = [0, *drop_layers, num_layers]
            left = [num_visual, *counts]  # visual tokens present in each segment of layers
            captures = [
                open_captures.enter_context(adapter.capture_queries(range(a, b), q_before - (num_visual - n)))
                for a, b, n in zip(bounds, bounds[1:], left)
                if b > a
            ]
        out = prefill_with_drop(
            adapter,
            hidden,
            pruned.position_ids.to(hidden.device),
            visual_index,
            list(drop_layers) or None,
            keep_count=num_after_drop,
            key_mask=key_mask,
            query_window=config.prefill_query_window,
        )
    logits = adapter.logits(out.last_hidden_state[:, -1:])[0, -1]
    cache = adapter.chunk_cache_to_kv(out.past_key_values)
    kept_visual = (prompt.visual_mask[keep][out.keep_indices]).nonzero().flatten()  # in L''
    # Which of the N' visual tokens survived the drop, by their rank among the visual tokens.
    visual_rank = torch.full((length,), -1, dtype=torch.long)
    visual_rank[visual_index] = torch.arange(num_visual)
    surviving = visual_rank[out.keep_indices][visual_rank[out.keep_indices] >= 0]
    if drop_layers:
        stats.record("prefill_drop", num_visual, int(surviving.numel()))
    sizes = ModelSizes.from_dims(adapter.text_dims)
    stats.prefill_flops_full = prefill_flops(sizes, prompt.num_tokens)
    stats.prefill_flops_pruned = prefill_flops(sizes, out.tokens_per_layer)
    kv_bytes_before = cache.num_bytes
    stats.kv_bytes_before = kv_bytes_before

    num_heads = cache.keys[0].shape[1]
    visual_entry_mask = torch.zeros(num_layers, num_heads, cache.num_cached_tokens, dtype=torch.bool)
    visual_entry_mask[:, :, kept_visual] = True
    if config.kv_compress:
        by_layer = {i: q for c in captures for i, q in c.queries.items()}
        queries = [by_layer[i] for i in range(num_layers)]
        layer_caches = list(zip(cache.keys, cache.values, strict=True))
        scores = text_prior_scores(queries, layer_caches, q_after, kept_visual)
        survivor_keys = None if key_mask is None else key_mask[surviving]
        result = compress_kv_cache(
            layer_caches,
            scores,
            kept_visual,
            keep_ratio=config.kv_keep_ratio,
            budget_bytes=config.kv_budget_bytes,
            merge=config.kv_merge,
            key_mask=survivor_keys,
            sent_element_bytes=sent_kv_element_bytes(config, cache),
        )
        cache = KvCache([k for k, _ in result.caches], [v for _, v in result.caches])
        visual_set = torch.zeros(length_after, dtype=torch.bool)
        visual_set[kept_visual] = True
        # On the CPU: the mask crosses to Decode as bytes (kept_positions are on the cache's device).
        visual_entry_mask = torch.stack([visual_set[pos.cpu()] for pos in result.kept_positions])
        stats.record("kv_compress", result.num_visual_in, result.num_visual_kept)
    stats.kv_bytes_after = cache.num_bytes
    state = PrefillState(
        cache=cache,
        last_logits=logits,
        next_position_ids=prompt.position_ids[:, 0, -1] + 1,
        num_prompt_tokens=prompt.num_tokens,
    )
    kept_full = token_index[surviving].tolist()
    return PrunedPrefill(state, visual_entry_mask, kept_full, kv_bytes_before)
