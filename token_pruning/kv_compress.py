"""KV compression after prefill (LOOK-M): text-prior eviction of visual entries, with merging.

Applied to the prefill's cache before it is sent to Decode, so the transfer shrinks too.

* Text-prior: text entries are never evicted; only visual entries compete for the budget.
* Scores: the attention each visual entry receives from the prompt's last text tokens (the
  question), per layer and per KV head: under grouped-query attention the n_rep query heads that
  share a KV head are averaged (`attention_scores.received_attention(...).total`), because
  evicting the entry removes it for all of them.
* Selection: every layer and KV head keeps exactly the same number k of visual entries (its own
  top k), so every layer's cache has the same length and stays one [1, kv_heads, n, D] tensor.
  Key tokens are kept everywhere.
* Merging (compensation): each evicted entry is folded into the kept visual entry of the same
  layer and head whose key is most similar (cosine). With s the number of original entries an
  entry already stands for (1 after prefill), e the evicted entries assigned to kept entry c:
    - "averaged": c' = (s_c c + sum_e s_e e) / (s_c + sum_e s_e), the size-weighted mean, so the
      total weight sum(s * entry) is preserved exactly;
    - "pivotal": c' = (c + mean_e e) / 2: the kept entry is the pivot and keeps half the weight
      however many entries fold into it;
    - "weighted": c' = (c + sum_e w_e e) / (1 + sum_e w_e), w_e = max(cos(e, c), 0): dissimilar
      entries change c less;
    - "none": plain eviction.
  Keys and values are merged with the same weights. Keys already carry RoPE; merging rotated
  keys is what LOOK-M does too, and it is why merged entries stay close to the pivot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from epd.token_pruning.budget import kv_bytes_per_position, resolve_keep_count, visual_keep_count_from_bytes

KVCache = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KVCompressionResult:
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer (key, value), each [1, kv_heads, T + k, D]: text entries plus k visual ones."""
    kept_positions: list[torch.Tensor]
    """Per layer [kv_heads, T + k] long, increasing per head: the sequence index (in the cache
    given) of each kept entry."""
    sizes: list[torch.Tensor]
    """Per layer [kv_heads, T + k] float: original entries each kept entry stands for."""
    num_visual_in: int
    num_visual_kept: int
    bytes_before: int
    bytes_after: int


def cache_bytes(caches: KVCache) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in caches)


def _merge(
    keys: torch.Tensor,
    values: torch.Tensor,
    sizes: torch.Tensor,
    kept: torch.Tensor,
    evicted: torch.Tensor,
    mode: str,
    chunk: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold evicted visual entries into kept ones, per head.

    keys, values: [G, V, D] visual entries; sizes: [G, V]; kept: [G, k], evicted: [G, V - k]
    indices into V, all on one device. Returns merged (keys [G, k, D], values [G, k, D], sizes [G, k]).
    """
    device = keys.device
    gather = lambda x, idx: x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))  # noqa: E731
    kept_k, kept_v = gather(keys, kept).double(), gather(values, kept).double()
    kept_s = sizes.gather(1, kept).double()
    if mode == "none" or evicted.shape[1] == 0 or kept.shape[1] == 0:
        return kept_k.to(keys.dtype), kept_v.to(values.dtype), kept_s.float()
    num_heads, num_kept = kept.shape
    kept_unit = F.normalize(kept_k.float(), dim=-1)
    # Weight each evicted entry contributes, and into which kept entry: [G, E].
    target = torch.empty_like(evicted)
    similarity = torch.empty(evicted.shape, dtype=torch.float32, device=device)
    for start in range(0, evicted.shape[1], chunk):
        part = evicted[:, start : start + chunk]
        sim = torch.bmm(F.normalize(gather(keys, part).float(), dim=-1), kept_unit.transpose(1, 2))
        similarity[:, start : start + chunk], target[:, start : start + chunk] = sim.max(dim=-1)
    ev_k, ev_v = gather(keys, evicted).double(), gather(values, evicted).double()
    ev_s = sizes.gather(1, evicted).double()
    flat_target = (target + torch.arange(num_heads, device=device)[:, None] * num_kept).reshape(-1)

    def scatter(x: torch.Tensor) -> torch.Tensor:  # [G, E, ...] -> sums per kept entry [G, k, ...]
        out = torch.zeros(num_heads * num_kept, *x.shape[2:], dtype=x.dtype, device=device)
        return out.index_add_(0, flat_target, x.reshape(num_heads * x.shape[1], *x.shape[2:])).view(
            num_heads, num_kept, *x.shape[2:]
        )

    if mode == "averaged":
        self_w, ev_w = kept_s, ev_s
    elif mode == "weighted":
        self_w, ev_w = torch.ones_like(kept_s), similarity.clamp(min=0).double()
    elif mode == "pivotal":
        count = scatter(torch.ones_like(ev_s))
        self_w = torch.ones_like(kept_s)
        ev_w = 1.0 / count.clamp(min=1).gather(1, target)  # each of n evicted gets 1/n: their mean
    else:
        raise ValueError(f"kv merge mode must be none, averaged, pivotal or weighted, got {mode!r}")
    denom = self_w + scatter(ev_w)
    new_k = (self_w[..., None] * kept_k + scatter(ev_w[..., None] * ev_k)) / denom[..., None]
    new_v = (self_w[..., None] * kept_v + scatter(ev_w[..., None] * ev_v)) / denom[..., None]
    return new_k.to(keys.dtype), new_v.to(values.dtype), (kept_s + scatter(ev_s)).float()


def compress_kv_cache(
    caches: KVCache,
    scores: Sequence[torch.Tensor],
    visual_index: torch.Tensor,
    keep_ratio: float = 1.0,
    budget_bytes: int | None = None,
    merge: str = "averaged",
    key_mask: torch.Tensor | None = None,
    sizes: Sequence[torch.Tensor] | None = None,
    sent_element_bytes: int | None = None,
) -> KVCompressionResult:
    """Evict visual entries to a budget in every layer and KV head, merging them into kept ones.

    caches: per layer (key, value) [1, kv_heads, S, D]. scores: per layer [kv_heads, V] text-prior
    importance of the visual entries (higher = keep). visual_index: [V] indices of the visual
    entries in S (the rest are text). Budget: `budget_bytes` (whole cache, all layers) if given,
    else ceil(keep_ratio * V) visual entries per layer and head. key_mask: [V] bool, never
    evicted. sizes: per layer [kv_heads, S] (default ones), for repeated compression.
    sent_element_bytes: bytes of one entry element in the dtype the cache is sent in (2 for a
    `kv_dtype` of bfloat16), which the budget counts; default the caches' own.

    Runs on the cache's device: the scores, visual_index and key_mask (which callers may hold on the
    CPU) are moved there, and every tensor of the result is there (the caches are the bulk; the
    selection's indices gather from them).
    """
    num_layers = len(caches)
    _, num_kv_heads, seq_len, head_dim = caches[0][0].shape
    device = caches[0][0].device
    visual_index = visual_index.to(device)
    num_visual = visual_index.numel()
    if len(scores) != num_layers:
        raise ValueError(f"{len(scores)} score tensors for {num_layers} layers")
    if budget_bytes is not None:
        element_bytes = sent_element_bytes or caches[0][0].element_size()
        per_position = kv_bytes_per_position(num_layers, num_kv_heads, head_dim, element_bytes)
        num_keep = visual_keep_count_from_bytes(budget_bytes, seq_len - num_visual, num_visual, per_position)
    else:
        num_keep = resolve_keep_count(num_visual, keep_ratio)
    key_mask = (
        torch.zeros(num_visual, dtype=torch.bool, device=device) if key_mask is None else key_mask.to(device)
    )
    if int(key_mask.sum()) > num_keep:
        raise ValueError(
            f"the {int(key_mask.sum())} key tokens exceed the KV budget of {num_keep} visual entries; "
            "raise kv_keep_ratio / kv_budget_bytes or lower key_token_ratio"
        )
    is_text = torch.ones(seq_len, dtype=torch.bool, device=device)
    is_text[visual_index] = False
    text_index = is_text.nonzero().flatten()

    out_caches, out_positions, out_sizes = [], [], []
    for layer, (key, value) in enumerate(caches):
        layer_scores = scores[layer].to(device, torch.float32, copy=True)
        if layer_scores.shape != (num_kv_heads, num_visual):
            raise ValueError(
                f"layer {layer} scores are {tuple(layer_scores.shape)}, expected ({num_kv_heads}, {num_visual})"
            )
        layer_scores[:, key_mask] = float("inf")
        order = torch.sort(layer_scores, dim=1, descending=True, stable=True).indices  # [G, V]
        kept, evicted = order[:, :num_keep].sort(dim=1).values, order[:, num_keep:]
        layer_sizes = (
            torch.ones(num_kv_heads, seq_len, device=device)
            if sizes is None
            else sizes[layer].to(device, torch.float32)
        )
        vis_k, vis_v = key[0][:, visual_index], value[0][:, visual_index]  # [G, V, D]
        new_k, new_v, new_s = _merge(vis_k, vis_v, layer_sizes[:, visual_index], kept, evicted, merge)

        # Text entries (same for every head) and the kept visual ones, in sequence order per head.
        positions = torch.cat([text_index.expand(num_kv_heads, -1), visual_index[kept]], dim=1)
        order_in_seq = positions.argsort(dim=1)
        positions = positions.gather(1, order_in_seq)
        keys_out = torch.cat([key[0][:, text_index], new_k], dim=1)
        values_out = torch.cat([value[0][:, text_index], new_v], dim=1)
        keys_out = keys_out.gather(1, order_in_seq[..., None].expand(-1, -1, keys_out.shape[-1]))
        values_out = values_out.gather(1, order_in_seq[..., None].expand(-1, -1, values_out.shape[-1]))
        sizes_out = torch.cat([layer_sizes[:, text_index], new_s], dim=1).gather(1, order_in_seq)
        out_caches.append((keys_out[None], values_out[None]))
        out_positions.append(positions)
        out_sizes.append(sizes_out)
    return KVCompressionResult(
        caches=out_caches,
        kept_positions=out_positions,
        sizes=out_sizes,
        num_visual_in=num_visual,
        num_visual_kept=num_keep,
        bytes_before=cache_bytes(caches),
        bytes_after=cache_bytes(out_caches),
    )


def text_prior_scores(
    query_states: Sequence[torch.Tensor],
    caches: KVCache,
    query_positions: torch.Tensor,
    visual_index: torch.Tensor,
) -> list[torch.Tensor]:
    """Per layer [kv_heads, V]: attention the question's queries pay each visual entry.

    query_states: per layer [1, heads, Q, D] rotated queries of the question tokens (the last
    text of the prompt); caches: the prefill cache, whose keys are the full key set.
    """
    from epd.token_pruning.attention_scores import received_attention

    return [
        received_attention(q, k, query_positions, scored_keys=visual_index).total
        for q, (k, _) in zip(query_states, caches, strict=True)
    ]
