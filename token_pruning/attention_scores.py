"""Attention that a few query tokens pay to a set of keys, without a full L x L matrix.

Shared by the prefill drop, the KV compression and the decode policy. Queries and keys are the
model's own, already rotated (Qwen2-VL's M-RoPE is applied inside the attention module; see
`query_capture.py`), so the scores are the ones the model computes.

Grouped-query attention: query head h reads KV head h // n_rep (n_rep = heads / kv_heads, as
transformers' `repeat_kv`). Scores are returned per KV head, averaged over the n_rep query heads
that share it (the mean of their received attention) and maxed for the max, because an evicted
KV entry is lost to the whole group at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ReceivedAttention:
    total: torch.Tensor
    """[kv_heads, K'] float32: attention each scored key receives, summed over the queries and
    averaged over the query heads of its KV group."""
    max: torch.Tensor
    """[kv_heads, K'] float32: the largest single attention weight it receives from any query
    and any query head of its group."""

    def per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([K'], [K']): total averaged over all heads, max over all heads (token-level dropping)."""
        return self.total.mean(dim=0), self.max.amax(dim=0)


def received_attention(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    query_positions: torch.Tensor,
    scored_keys: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    scaling: float | None = None,
    query_chunk: int = 64,
) -> ReceivedAttention:
    """Softmax attention of the given queries over all keys, reduced onto the scored keys.

    query_states: [1, heads, Q, D]. key_states: [1, kv_heads, K, D] (the full key set: text and
    visual, so the softmax is the model's). query_positions: [Q] long, each query's index in the
    key sequence, for the causal mask (key j is visible to query q iff key_positions[j] <=
    query_positions[q]). key_positions: [K] long (default 0..K-1; pass the survivors' original
    indices when the cache has gaps). scored_keys: [K'] long indices into K (default all).
    scaling: default D ** -0.5. Memory: heads * query_chunk * K floats at a time.

    Computed on the queries' device (the model's); the positions and indices, which callers keep
    on the CPU with the prompt, are moved there. Returns tensors on that device.
    """
    _, num_heads, num_queries, head_dim = query_states.shape
    _, num_kv_heads, num_keys, _ = key_states.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if query_positions.numel() != num_queries:
        raise ValueError(f"{query_positions.numel()} query positions for {num_queries} queries")
    n_rep = num_heads // num_kv_heads
    scaling = head_dim**-0.5 if scaling is None else scaling
    device = query_states.device
    key_positions = (
        torch.arange(num_keys, device=device) if key_positions is None else key_positions.to(device)
    )
    scored_keys = torch.arange(num_keys, device=device) if scored_keys is None else scored_keys.to(device)
    query_positions = query_positions.to(device)

    # [kv_heads, n_rep, Q, D] against [kv_heads, K, D]: head h = g * n_rep + r reads KV head g.
    queries = query_states[0].float().reshape(num_kv_heads, n_rep, num_queries, head_dim)
    keys = key_states[0].float()
    total = torch.zeros(num_kv_heads, n_rep, scored_keys.numel(), device=device)
    peak = torch.zeros(num_kv_heads, n_rep, scored_keys.numel(), device=device)
    for start in range(0, num_queries, query_chunk):
        stop = min(start + query_chunk, num_queries)
        logits = torch.einsum("grqd,gkd->grqk", queries[:, :, start:stop], keys) * scaling
        hidden = key_positions[None, :] > query_positions[start:stop, None]  # [q, K]
        logits = logits.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(logits, dim=-1)[..., scored_keys]  # [kv_heads, n_rep, q, K']
        total += probs.sum(dim=2)
        peak = torch.maximum(peak, probs.amax(dim=2))
    return ReceivedAttention(total=total.mean(dim=1), max=peak.amax(dim=1))
