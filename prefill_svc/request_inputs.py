"""What a rendered request (`PrefillEngine.render`) runs with: its prompt, media and pruning, and
the visual features its prompt's placeholders take. No gRPC here."""

from __future__ import annotations

import torch

from epd.model_runtime.adapter import (
    Prompt,
    VisualFeatures,
    VLMAdapter,
)
from epd.prefill_svc.scheduler import PrefillRequest
from epd.stages.contracts import EncodedMedia
from epd.token_pruning import PruningConfig


def request_parts(request: PrefillRequest) -> tuple[Prompt, EncodedMedia | None, PruningConfig]:
    assert request.prompt is not None and request.pruning is not None
    return request.prompt, request.media, request.pruning


def request_features(adapter: VLMAdapter, request: PrefillRequest) -> VisualFeatures:
    """The request's embeddings [V, hidden] and DeepStack features (None for families without
    them); a text-only request's are empty ([0, hidden] each), so it runs and batches as any
    prompt, its visual mask all False."""
    media = request.media
    if media is not None:
        return VisualFeatures(media.embeds, list(media.deepstack) or None)
    empty = torch.empty(0, adapter.hidden_size)
    return VisualFeatures(empty, [empty] * adapter.num_deepstack_layers or None)
