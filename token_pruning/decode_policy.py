"""Decode stage: output-aware eviction of visual KV entries that generated tokens ignore.

MustDrop's decode stage: what the *answer* looks at can differ from what the question looked
at, so while generating we keep watching. For every layer and KV head, each visual entry has a
running mean (EMA) of the attention it receives from each newly generated token (averaged over
the query heads of its KV group). Once `min_steps` tokens have been generated, and then every
`evict_interval` tokens, the visual entries with the lowest running mean are evicted until at
most `keep_count` remain per head. A single token's attention is noisy; the EMA over several
makes eviction mean "persistently ignored".

Every layer is evicted at the same step by the same count, so all layers' caches keep equal
lengths (transformers builds one attention mask for every layer). Text entries and generated
tokens are never evicted. Use:

    policy = OutputAwareEviction.start(visual_masks, keep_count, ...)   # after the prefill
    for each generated token:
        # in each layer's attention: policy.observe(layer, weights) or observe_queries(...)
        policy.step()
        if policy.should_evict():
            caches = [policy.evict(layer, k, v) for layer, (k, v) in enumerate(caches)]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epd.token_pruning.attention_scores import received_attention


@dataclass
class _LayerState:
    ema: torch.Tensor  # [kv_heads, n] running mean of received attention
    visual: torch.Tensor  # [kv_heads, n] bool: entry is visual (evictable)
    positions: torch.Tensor  # [kv_heads, n] long: original sequence index of each entry


@dataclass
class OutputAwareEviction:
    keep_count: int
    """Visual entries kept per layer and KV head after an eviction."""
    ema_decay: float = 0.9
    """ema <- decay * ema + (1 - decay) * attention received from the new token."""
    min_steps: int = 4
    """Generated tokens observed before the first eviction."""
    evict_interval: int = 4
    """Evict at most once every this many generated tokens."""
    layers: list[_LayerState] = field(default_factory=list)
    num_steps: int = 0
    num_evicted: int = 0
    """Visual entries evicted so far, per layer and head (same for all)."""

    @classmethod
    def start(
        cls,
        visual_masks: list[torch.Tensor],
        keep_count: int,
        positions: list[torch.Tensor] | None = None,
        **knobs: float,
    ) -> OutputAwareEviction:
        """visual_masks: per layer [kv_heads, n] bool over the cache entries after prefill (and
        after KV compression, whose `kept_positions` tell which entries are visual).
        positions: per layer [kv_heads, n] original sequence indices (default 0..n-1).
        The policy's state lives on the masks' device: give them on the cache's device, so that
        observing each step's attention does not move it (`observe` moves what it is given)."""
        layers = []
        for i, mask in enumerate(visual_masks):
            device = mask.device
            pos = (
                torch.arange(mask.shape[1], device=device).expand_as(mask)
                if positions is None
                else positions[i]
            )
            layers.append(
                _LayerState(torch.zeros(mask.shape, device=device), mask.clone(), pos.to(device, copy=True))
            )
        counts = {int(s.visual.sum(dim=1).max()) for s in layers} | {
            int(s.visual.sum(dim=1).min()) for s in layers
        }
        if len(counts) != 1:
            raise ValueError("every layer and KV head must start with the same number of visual entries")
        return cls(keep_count=keep_count, layers=layers, **knobs)  # type: ignore[arg-type]

    @property
    def num_visual(self) -> int:
        """Visual entries currently held per layer and head."""
        return int(self.layers[0].visual[0].sum())

    def observe(self, layer: int, attn_weights: torch.Tensor) -> None:
        """attn_weights: [1, heads, q, n_cur] softmax weights of the new token(s) over the cache.

        Entries beyond the tracked ones (the generated tokens' own) are appended as text.
        """
        state = self.layers[layer]
        num_kv_heads, num_tracked = state.ema.shape
        device = state.ema.device
        _, num_heads, _, num_cur = attn_weights.shape
        if num_cur < num_tracked:
            raise ValueError(f"layer {layer}: attention covers {num_cur} entries, {num_tracked} are tracked")
        if num_cur > num_tracked:
            extra = num_cur - num_tracked
            state.ema = torch.cat([state.ema, torch.zeros(num_kv_heads, extra, device=device)], dim=1)
            state.visual = torch.cat(
                [state.visual, torch.zeros(num_kv_heads, extra, dtype=torch.bool, device=device)], dim=1
            )
            last = int(state.positions.max())
            new_pos = torch.arange(last + 1, last + 1 + extra, device=device).expand(num_kv_heads, -1)
            state.positions = torch.cat([state.positions, new_pos], dim=1)
        received = (
            attn_weights[0].float().sum(dim=1).view(num_kv_heads, num_heads // num_kv_heads, num_cur).mean(1)
        ).to(device)
        state.ema = self.ema_decay * state.ema + (1 - self.ema_decay) * received

    def observe_queries(self, layer: int, query_states: torch.Tensor, key_states: torch.Tensor) -> None:
        """Like `observe`, from the new token's rotated queries [1, heads, q, D] and the layer's
        keys [1, kv_heads, n_cur, D] (all visible to the new token)."""
        num_cur = key_states.shape[2]
        positions = torch.full((query_states.shape[2],), num_cur, device=query_states.device)
        scores = received_attention(query_states, key_states, positions)
        n_rep = query_states.shape[1] // key_states.shape[1]
        # observe() wants per-head weights; received totals are already group means, so repeat.
        self.observe(layer, scores.total.repeat_interleave(n_rep, dim=0)[None, :, None, :])

    def step(self) -> None:
        """Call once per generated token, after every layer has been observed."""
        self.num_steps += 1

    def should_evict(self) -> bool:
        return (
            self.num_visual > self.keep_count
            and self.num_steps >= self.min_steps
            and (self.num_steps - self.min_steps) % self.evict_interval == 0
        )

    def evict(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop this layer's least-attended visual entries down to `keep_count` per head.

        key, value: [1, kv_heads, n_cur, D] (n_cur = tracked entries). Returns the same minus
        the evicted entries, order kept.
        """
        state = self.layers[layer]
        num_kv_heads, num_tracked = state.ema.shape
        if key.shape[2] != num_tracked:
            raise ValueError(f"layer {layer}: cache has {key.shape[2]} entries, {num_tracked} are tracked")
        num_drop = int(state.visual[0].sum()) - self.keep_count
        if num_drop <= 0:
            return key, value
        candidate = torch.where(state.visual, state.ema, torch.inf)
        drop = torch.sort(candidate, dim=1, stable=True).indices[:, :num_drop]
        keep_mask = torch.ones(num_kv_heads, num_tracked, dtype=torch.bool, device=state.visual.device)
        keep_mask.scatter_(1, drop, False)
        keep = keep_mask.nonzero()[:, 1].view(num_kv_heads, -1)  # [G, n'] increasing per head
        state.ema, state.visual, state.positions = (
            x.gather(1, keep) for x in (state.ema, state.visual, state.positions)
        )
        if layer == 0:
            self.num_evicted += num_drop
        idx = keep.to(key.device)[None, :, :, None].expand(1, -1, -1, key.shape[3])
        return key.gather(2, idx), value.gather(2, idx)
