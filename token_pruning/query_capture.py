"""The model's own rotated queries and keys at chosen layers, captured with forward pre-hooks.

Scoring (prefill drop, KV compression) needs each layer's query states of a few tokens (the
question) and the keys of all tokens, exactly as the attention computes them: projection, then
RoPE with the model's M-RoPE cos/sin. Qwen2-VL / Qwen2.5-VL attention modules (transformers
5.x) receive `hidden_states` [1, L, hidden] and `position_embeddings` (cos, sin), each
[1, L, head_dim], with M-RoPE's sections already folded in; we redo their first lines for just
the tokens we need. Nothing is L x L.

    with QueryCapture(model.model.language_model.layers, layers=[2], query_index=q_idx) as cap:
        model(...)                       # or the lead's own layer loop
    q, k = cap.queries[2], cap.keys[2]   # [1, heads, Q, D], [1, kv_heads, L, D]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotated_states(
    attn: nn.Module, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, proj: str
) -> torch.Tensor:
    """[1, n_heads, n, D]: `proj` ("q_proj" or "k_proj") of hidden_states [1, n, hidden], RoPE'd
    with cos/sin [1, n, D] (the rows of the same tokens)."""
    head_dim = attn.head_dim
    states = getattr(attn, proj)(hidden_states)
    states = states.view(1, hidden_states.shape[1], -1, head_dim).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return states * cos + _rotate_half(states) * sin


class QueryCapture:
    """Context manager: captures rotated queries (of `query_index`) and keys (of all tokens) at
    the attention input of the chosen decoder layers, during one prefill forward."""

    def __init__(self, decoder_layers: Sequence[nn.Module], layers: Iterable[int], query_index: torch.Tensor):
        self.decoder_layers = decoder_layers
        self.layers = list(layers)
        self.query_index = query_index
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, layer: int):
        def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            with torch.no_grad():
                idx = self.query_index
                self.queries[layer] = rotated_states(
                    module, hidden[:, idx], cos[:, idx], sin[:, idx], "q_proj"
                )
                self.keys[layer] = rotated_states(module, hidden, cos, sin, "k_proj")

        return capture

    def __enter__(self) -> QueryCapture:
        for layer in self.layers:
            attn: nn.Module = self.decoder_layers[layer].self_attn  # type: ignore[assignment]
            self._handles.append(attn.register_forward_pre_hook(self._hook(layer), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
