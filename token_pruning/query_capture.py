"""The model's own rotated queries and keys at chosen layers (moved to the model runtime).

Scoring (prefill drop, KV compression, decode eviction) needs each layer's query states of a few
tokens and the keys of all tokens, exactly as the attention computes them. How to get them is the
family's business: the stages call `VLMAdapter.capture_queries` (and `LayerwisePass.layer_queries`),
which the Qwen families implement with forward pre-hooks in `epd.model_runtime.qwen_text_layers`.
This module keeps the old names for code that holds a bare transformers Qwen text model (tests,
notebooks):

    with QueryCapture(language_model.layers, layers=[2], query_index=q_idx) as cap:
        language_model(...)
    q, k = cap.queries[2], cap.keys[2]   # [1, heads, Q, D], [1, kv_heads, L, D]
"""

from __future__ import annotations

from epd.model_runtime.qwen_text_layers import QueryCapture, rotated_states

__all__ = ["QueryCapture", "rotated_states"]
