"""Prefill stage: drop visual tokens the question does not look at (MustDrop's dual rule).

At a chosen decoder layer, the question's tokens (the text after the video) are the queries;
every visual token gets two numbers from their softmax attention over the *full* key set (text
and visual keys, so the weights are the model's): `total`, the attention it receives summed
over the queries (averaged over heads), and `max`, the largest single weight any query and head
gives it. A token that one query looks at hard (high max) or that many look at a little (high
total) is kept; only tokens low on *both* are dropped.

With a budget of exactly k survivors the rule becomes a ranking: each token's rank under total
and under max (0 = most attended); a token's priority is its better rank, ties broken by the
worse one. Keeping the k best priorities keeps, for the largest possible m, every token in the
top m of either list, and never drops a token that beats a kept one on both numbers. Key tokens
(from the encode stage) are kept first and count toward k.

The lead's forward then runs the layers >= the drop layer on `keep_indices` only: gather the
hidden states, the position ids / RoPE cos-sin, and (for FastKV-style propagation) leave the
earlier layers' caches full or gather them too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epd.token_pruning.attention_scores import received_attention
from epd.token_pruning.budget import resolve_keep_count
from epd.token_pruning.positions import prompt_keep_indices


def text_query_positions(seq_len: int, visual_index: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[Q] long: the text after the last visual token, or its last `window` positions (0 = all).

    The queries of the text-guided prefill drop and of the KV compression: both scores are
    text-prior, what the text after the video (the question) attends to. A window longer than that
    text is clamped to it: tokens before the video see no visual entry (causal); a visual token as
    a query would score the video by what it attends to itself (only the frames before it), and
    visual tokens may be dropped at a prefill drop layer before the later layers are scored. So
    every query follows every visual token, and after a drop of n visual tokens it sits exactly n
    places earlier. On `visual_index`'s device.
    """
    start = int(visual_index.max()) + 1 if visual_index.numel() else 0
    if start >= seq_len:
        raise ValueError("the prompt has no text after the video to score its visual tokens with")
    if window > 0:
        start = max(start, seq_len - window)
    return torch.arange(start, seq_len, device=visual_index.device)


def dual_rule_select(
    total: torch.Tensor,
    peak: torch.Tensor,
    num_keep: int,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_keep] long, increasing: indices of the surviving tokens.

    total, peak: [V] scores. key_mask: [V] bool, always kept. Raises if the key tokens alone
    exceed num_keep.
    """
    num_tokens = total.numel()
    device = total.device
    key_mask = (
        torch.zeros(num_tokens, dtype=torch.bool, device=device) if key_mask is None else key_mask.to(device)
    )
    num_key = int(key_mask.sum())
    if num_keep > num_tokens:
        raise ValueError(f"cannot keep {num_keep} of {num_tokens} tokens")
    if num_key > num_keep:
        raise ValueError(
            f"the {num_key} key tokens exceed the budget of {num_keep} tokens; "
            "raise the keep ratio or lower key_token_ratio"
        )

    def rank(score: torch.Tensor) -> torch.Tensor:
        order = torch.sort(score, descending=True, stable=True).indices
        return torch.empty_like(order).scatter_(0, order, torch.arange(num_tokens, device=device))

    rank_total, rank_peak = rank(total.float()), rank(peak.float())
    better = torch.minimum(rank_total, rank_peak)
    worse = torch.maximum(rank_total, rank_peak)
    priority = better * num_tokens + worse
    priority[key_mask] = -1  # key tokens first
    chosen = torch.sort(priority, stable=True).indices[:num_keep]
    return torch.sort(chosen).values


@dataclass(frozen=True)
class PrefillDropResult:
    keep_indices: torch.Tensor
    """[L'] long, increasing: sequence indices that go on to the next layers (text + kept visual)."""
    kept_visual: torch.Tensor
    """[V'] long, increasing: indices into the visual tokens of those that survive."""
    total: torch.Tensor
    """[V] float: attention received, summed over queries, averaged over heads."""
    max: torch.Tensor
    """[V] float: largest single attention weight received."""


def text_guided_drop(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    query_positions: torch.Tensor,
    visual_index: torch.Tensor,
    keep_ratio: float = 1.0,
    keep_count: int | None = None,
    key_mask: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
) -> PrefillDropResult:
    """Score the visual tokens by the question's attention and keep a budget of them.

    query_states: [1, heads, Q, D] rotated queries of the question tokens at the drop layer.
    key_states: [1, kv_heads, L, D] rotated keys of the whole current sequence at that layer.
    query_positions: [Q] indices of the queries in L. visual_index: [V] indices of the visual
    tokens in L. key_mask: [V] bool, never dropped. key_positions: [L] original indices, for
    the causal mask when earlier stages left gaps (default 0..L-1). The scores are computed on the
    queries' device; the result's tensors are on `visual_index`'s.
    Budget: exactly resolve_keep_count(V, keep_ratio, keep_count) visual tokens survive.
    """
    scores = received_attention(
        query_states, key_states, query_positions, scored_keys=visual_index, key_positions=key_positions
    )
    # [V] scores from the model's device to visual_index's (the CPU, with the prompt): choosing the
    # survivors is index bookkeeping on the prompt's positions; V floats are cheap to move.
    total, peak = (s.to(visual_index.device) for s in scores.per_token())
    num_keep = resolve_keep_count(visual_index.numel(), keep_ratio, keep_count)
    kept_visual = dual_rule_select(total, peak, num_keep, key_mask)
    keep_indices = prompt_keep_indices(key_states.shape[2], visual_index, kept_visual)
    return PrefillDropResult(keep_indices=keep_indices, kept_visual=kept_visual, total=total, max=peak)
