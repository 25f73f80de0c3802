"""One request prefilled whole and alone, outside the batched steps (`PrefillRunner`): a request with
token dropping or KV compression (`exclusive`), and any request for benchmarks and tools
(`prefill_alone`). No gRPC here."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from epd.model_runtime.adapter import (
    PrefillChunk,
    Prompt,
    UnsupportedByFamily,
    VLMAdapter,
)
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.first_token import PrefillOutput, finish_prefill
from epd.prefill_svc.pruned_prefill import PrunedPrefill, pruned_prefill
from epd.prefill_svc.request_inputs import request_features, request_parts
from epd.prefill_svc.scheduler import PrefillRequest
from epd.stages.contracts import EncodedMedia
from epd.stages.errors import InvalidRequest
from epd.stages.messages import Message
from epd.token_pruning import (
    ModelSizes,
    PruningConfig,
    PruningStats,
    gather_prompt,
    prefill_flops,
    prompt_keep_indices,
)


def prefill_alone(
    engine: PrefillEngine,
    messages: Sequence[Message],
    media: EncodedMedia | None,
    generation: GenerationConfig,
    pruning: PruningConfig = PruningConfig(),
) -> PrefillOutput:
    """One request, whole and alone (benchmarks and tools; the service runs `PrefillRunner`).
    The prefix cache is left alone: a benchmark repeating a prompt times the whole prefill."""
    request = engine.render(messages, media, generation, pruning, use_prefix_cache=False)
    t0 = time.perf_counter()
    if request.exclusive:
        return prefill_pruned_request(engine.adapter, request)
    prompt = request_parts(request)[0]
    if generation.prompt_logprobs is not None:  # every position's logits: the chunked path's
        features = request_features(engine.adapter, request)
        row = PrefillChunk(
            prompt,
            features.embeds,
            0,
            prompt.num_tokens,
            None,
            features.deepstack,
            generation.prompt_logprobs,
        )
        result = engine.adapter.prefill_chunks([row])[0]
        request.prompt_logprob_rows = result.prompt_logprobs
        cache = engine.adapter.chunk_cache_to_kv(result.cache)
        return finish_prefill(
            engine.adapter, request, cache, result.last_logits, (time.perf_counter() - t0) * 1e3
        )
    state = engine.adapter.prefill_features(prompt, request_features(engine.adapter, request))
    return finish_prefill(
        engine.adapter, request, state.cache, state.last_logits, (time.perf_counter() - t0) * 1e3
    )


def prefill_pruned_request(adapter: VLMAdapter, request: PrefillRequest) -> PrefillOutput:
    """A request with token dropping or KV compression: whole and alone, as `pruned_prefill` does it."""
    prompt, media, pruning = request_parts(request)
    assert media is not None  # a text-only request is never exclusive (`render`)
    if media.deepstack:
        return _prefill_kept_tokens(adapter, request)
    t0 = time.perf_counter()
    stats = PruningStats(stages=list(media.pruning.stages), num_key_tokens=media.pruning.num_key_tokens)
    try:
        out = pruned_prefill(adapter, prompt, media.embeds, media.token_index, media.key_mask, pruning, stats)
    except ValueError as exc:  # budgets that cannot be met (e.g. key tokens over budget)
        raise InvalidRequest(str(exc)) from None
    return finish_prefill(
        adapter,
        request,
        out.state.cache,
        out.state.last_logits,
        (time.perf_counter() - t0) * 1e3,
        stats=stats,
        pruned=out,
    )


def _prefill_kept_tokens(adapter: VLMAdapter, request: PrefillRequest) -> PrefillOutput:
    """A DeepStack family's request whose encoder dropped tokens (the only pruning it has
    before decode, `refuse_unsupported_pruning`): the prompt without the dropped placeholders,
    every kept token at its full-prompt position, and the DeepStack features' rows of the kept
    tokens (the encoder kept the same rows), run whole through `prefill_features`."""
    prompt, media, _ = request_parts(request)
    assert media is not None and media.token_index is not None
    t0 = time.perf_counter()
    full_visual = prompt.visual_mask.nonzero().flatten()  # [V] prompt index of each placeholder
    keep = prompt_keep_indices(prompt.num_tokens, full_visual, media.token_index)  # [L'] increasing
    kept = gather_prompt(prompt.input_ids, prompt.position_ids, keep)
    kept_prompt = Prompt(kept.input_ids, kept.position_ids, prompt.visual_mask[keep])
    try:
        state = adapter.prefill_features(kept_prompt, request_features(adapter, request))
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    stats = PruningStats(stages=list(media.pruning.stages), num_key_tokens=media.pruning.num_key_tokens)
    with contextlib.suppress(UnsupportedByFamily):  # a family without text_dims: no estimate
        sizes = ModelSizes.from_dims(adapter.text_dims)
        stats.prefill_flops_full = prefill_flops(sizes, prompt.num_tokens)
        stats.prefill_flops_pruned = prefill_flops(sizes, kept_prompt.num_tokens)
    cache = state.cache
    stats.kv_bytes_before = stats.kv_bytes_after = cache.num_bytes
    # [layers, kv_heads, cached] bool: the visual entries (decode eviction is refused for
    # DeepStack families, so nobody reads it; kept for PrunedPrefill's shape)
    visual_entries = kept_prompt.visual_mask.expand(len(cache.keys), cache.keys[0].shape[1], -1).clone()
    pruned = PrunedPrefill(state, visual_entries, media.token_index.tolist(), cache.num_bytes)
    ms = (time.perf_counter() - t0) * 1e3
    return finish_prefill(adapter, request, cache, state.last_logits, ms, stats=stats, pruned=pruned)
