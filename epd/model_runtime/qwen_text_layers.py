"""The pruning interface on transformers' Qwen text models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), for
the family files' `VLMAdapter` methods (`capture_queries`, `layerwise_prefill`, the decode-cache
accessors). Only model_runtime imports it; `epd.token_pruning.query_capture` re-exports the old
names for code holding a bare transformers text model (tests, notebooks).

Written against transformers 5.x: a text model has `layers`, `rotary_emb`, `norm`; decoder layers
are called with keyword arguments; each attention module receives `hidden_states` [1, L, hidden]
and `position_embeddings` (cos, sin), each [1, L, head_dim], M-RoPE's sections already folded in;
Qwen3-VL's attention adds a per-head q/k norm before RoPE. Batch size 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from epd.model_runtime.adapter import LayerwisePass, TextDims
from epd.model_runtime.thread_hooks import owner_thread_only


def dims_of(text_config) -> TextDims:
    """`VLMAdapter.text_dims` from a transformers Qwen text config."""
    c = text_config
    return TextDims(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
    )


def count_parameters(*modules) -> int:
    """Distinct parameters of the modules (the whole model holds the tower too)."""
    seen = {id(p): p.numel() for m in modules if m is not None for p in m.parameters()}
    return sum(seen.values())


def dynamic_cache_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [1, kv_heads, n, D] per layer of a transformers DynamicCache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def set_dynamic_cache_kv(cache, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    cache.layers[layer].keys, cache.layers[layer].values = keys, values


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotated_states(
    attn: torch.nn.Module, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, proj: str
) -> torch.Tensor:
    """[1, n_heads, n, D]: `proj` ("q_proj" or "k_proj") of hidden_states [1, n, hidden], normed
    per head where the attention has q_norm / k_norm (Qwen3-VL), RoPE'd with cos/sin [1, n, D]
    (the rows of the same tokens): the first lines of the attention's forward, for these tokens."""
    head_dim = attn.head_dim
    states = getattr(attn, proj)(hidden_states).view(1, hidden_states.shape[1], -1, head_dim)
    norm = getattr(attn, proj[0] + "_norm", None)
    if norm is not None:
        states = norm(states)
    states = states.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return states * cos + _rotate_half(states) * sin


class QueryCapture:
    """Context manager: forward pre-hooks on the attention of the chosen decoder layers capture the
    rotated queries (of `query_index`) and keys (of all tokens) of every forward pass through them.

        with QueryCapture(language_model.layers, layers=[2], query_index=q_idx) as cap:
            language_model(...)
        q, k = cap.queries[2], cap.keys[2]   # [1, heads, Q, D], [1, kv_heads, L, D]
    """

    def __init__(
        self,
        decoder_layers: Sequence[torch.nn.Module],
        layers: Iterable[int],
        query_index: torch.Tensor,
        with_keys: bool = True,
    ) -> None:
        self.decoder_layers = decoder_layers
        self.layers = list(layers)
        self.query_index = query_index
        self.with_keys = with_keys
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, layer: int):
        def capture(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            with torch.no_grad():
                idx = self.query_index
                self.queries[layer] = rotated_states(
                    module, hidden[:, idx], cos[:, idx], sin[:, idx], "q_proj"
                )
                if self.with_keys:
                    self.keys[layer] = rotated_states(module, hidden, cos, sin, "k_proj")

        return capture

    def __enter__(self) -> QueryCapture:
        for layer in self.layers:
            attn: torch.nn.Module = self.decoder_layers[layer].self_attn  # type: ignore[assignment]
            hook = owner_thread_only(self._hook(layer))
            self._handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def text_model_num_layers(language_model) -> int:
    return len(language_model.layers)


def _causal_mask(language_model, like: torch.Tensor) -> torch.Tensor | None:
    """SDPA/flash kernels are causal by themselves when given no mask; eager needs one [1,1,n,n],
    in the dtype and on the device of the hidden states `like` ([1, n, hidden])."""
    if getattr(language_model.config, "_attn_implementation", "eager") != "eager":
        return None
    length, dtype = like.shape[1], like.dtype
    return torch.full((length, length), torch.finfo(dtype).min, dtype=dtype, device=like.device).triu(1)[
        None, None
    ]


class QwenLayerwisePass(LayerwisePass):
    """`LayerwisePass` on a transformers Qwen text model: cos/sin computed once from the full
    prompt's positions and gathered by `keep` (never recomputed from a shorter range); the
    result's cache is an ordinary DynamicCache whose every layer holds the survivors."""

    def __init__(self, language_model, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.language_model = language_model
        self.hidden = inputs_embeds  # [1, n, hidden]
        rope_rows = position_ids[1:] if position_ids.shape[0] == 4 else position_ids  # [3, 1, L]
        self.text_rows = position_ids[0] if position_ids.shape[0] == 4 else None  # [1, L]
        self.cos, self.sin = language_model.rotary_emb(inputs_embeds, rope_rows)  # each [1, L, head_dim]
        self.mask = _causal_mask(language_model, inputs_embeds)
        self.cache = DynamicCache(config=language_model.config)
        self.num_layers_run = 0

    @property
    def num_tokens(self) -> int:
        return int(self.hidden.shape[1])

    def run_layers(self, start: int, stop: int) -> None:
        if start != self.num_layers_run:
            raise ValueError(f"layers run in order: next is {self.num_layers_run}, not {start}")
        for layer in self.language_model.layers[start:stop]:
            self.hidden = layer(
                self.hidden,
                attention_mask=self.mask,
                position_embeddings=(self.cos, self.sin),
                position_ids=self.text_rows,
                past_key_values=self.cache,
                use_cache=True,
            )
        self.num_layers_run = max(start, stop)

    def layer_queries(self, layer: int, query_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer != self.num_layers_run:
            raise ValueError(
                f"queries come from the next layer's input ({self.num_layers_run}), not layer {layer}"
            )
        decoder_layer = self.language_model.layers[layer]
        attn = decoder_layer.self_attn
        normed = decoder_layer.input_layernorm(self.hidden)
        cos, sin = self.cos, self.sin
        q = rotated_states(attn, normed[:, query_index], cos[:, query_index], sin[:, query_index], "q_proj")
        k = rotated_states(attn, normed, cos, sin, "k_proj")
        return q, k

    def keep(self, index: torch.Tensor) -> None:
        self.hidden, self.cos, self.sin = self.hidden[:, index], self.cos[:, index], self.sin[:, index]
        if self.text_rows is not None:
            self.text_rows = self.text_rows[:, index]
        done: Any
        # DynamicLayer: keys, values [1, kv_heads, L, D]
        for done in self.cache.layers[: self.num_layers_run]:
            done.keys, done.values = done.keys[:, :, index], done.values[:, :, index]
        self.mask = _causal_mask(self.language_model, self.hidden)

    def finish(self) -> tuple[torch.Tensor, Any]:
        return self.language_model.norm(self.hidden), self.cache
