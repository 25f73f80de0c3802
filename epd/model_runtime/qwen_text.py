"""`QwenTextAdapter`: the shared language side (`HfTextAdapter`) with the pruning interface's hooks
for Qwen attention layers (`qwen_text_layers`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from epd.model_runtime.adapter import CapturedQueries, LayerwisePass, TextDims
from epd.model_runtime.hf_text import HfTextAdapter
from epd.model_runtime.qwen_text_layers import (
    QueryCapture,
    QwenLayerwisePass,
    count_parameters,
    dims_of,
    dynamic_cache_kv,
    set_dynamic_cache_kv,
)


class QwenTextAdapter(HfTextAdapter):
    """`HfTextAdapter` with the pruning interface's hooks for Qwen attention layers
    (`qwen_text_layers`): dims, the layer-by-layer prefill, query capture, the decode cache's
    per-layer KV, parameter count."""

    @property
    def text_dims(self) -> TextDims:
        return dims_of(self.hf_config.text_config)

    def layerwise_prefill(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> LayerwisePass:
        return QwenLayerwisePass(self._language_model(), inputs_embeds, position_ids)

    @contextmanager
    def capture_queries(self, layers: Iterable[int], query_index: torch.Tensor) -> Iterator[CapturedQueries]:
        with QueryCapture(self._language_model().layers, layers, query_index, with_keys=False) as cap:
            yield CapturedQueries(cap.queries, cap.keys)

    def decode_cache_kv(self, cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return dynamic_cache_kv(cache)

    def set_decode_cache_kv(self, cache, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        set_dynamic_cache_kv(cache, layer, keys, values)

    @property
    def num_parameters(self) -> int:
        return count_parameters(self.model, self.visual)
