"""The think markers of a thinking model, on their own so that each side that needs them imports
them from here: the front door (`epd.gateway.reasoning`, without torch or xgrammar), prefill's
engine and `ModelInfo` (which of them a model's tokenizer has), and the structured-output compiler.
"""

from __future__ import annotations

REASONING_MARKERS = ("<think>", "</think>")
"""The markers vLLM's reasoning parsers (qwen3, deepseek_r1) part an answer at, each one token of a
thinking model; a structured output under one starts after the second
(`StructuredOutputs.after_reasoning`)."""
