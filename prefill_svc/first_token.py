"""A prefilled prompt's cache and last logits -> the first token of each choice and the handle decoding
starts from (`PrefillOutput`), the boundary's own type, `PrefillHandle` (without the cache's
location, which the stage that stores the cache fills in), next to the cache itself. No gRPC here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epd.model_runtime.adapter import VLMAdapter
from epd.model_runtime.detokenizer import OutputText
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.logprobs import (
    TokenLogprob,
    prompt_token_logprobs,
    rows_logprobs,
    token_logprob,
)
from epd.model_runtime.sampling import Sampler
from epd.prefill_svc.pruned_prefill import PrunedPrefill
from epd.prefill_svc.request_inputs import request_parts
from epd.prefill_svc.scheduler import PrefillRequest
from epd.stages.contracts import (
    ChoiceStart,
    PrefillHandle,
)
from epd.token_pruning import PruningStats


@dataclass
class PrefillOutput:
    """The handle decoding starts from (`kv_handle` and `kv_address` still empty) and the cache
    it describes, which the stage stores under a new `kv_handle`."""

    handle: PrefillHandle
    cache: KvCache


def finish_prefill(
    adapter: VLMAdapter,
    request: PrefillRequest,
    cache: KvCache,
    last_logits: torch.Tensor,
    prefill_ms: float,
    stats: PruningStats | None = None,
    pruned: PrunedPrefill | None = None,
) -> PrefillOutput:
    """The prompt's cache and last logits -> the first token and the handle decoding starts from."""
    prompt, media, pruning = request_parts(request)
    if stats is None:
        stats = (
            PruningStats()
            if media is None
            else PruningStats(stages=list(media.pruning.stages), num_key_tokens=media.pruning.num_key_tokens)
        )
    num_in = 0 if media is None else media.meta.num_visual_tokens
    if pruned is not None:
        mask, kept, kv_before, num_out = (
            pruned.visual_entry_mask,
            pruned.kept_visual_token_index,
            pruned.kv_bytes_before,
            len(pruned.kept_visual_token_index),
        )
    else:
        mask, kept, kv_before, num_out = None, [], cache.num_bytes, num_in
    if pruning.kv_dtype != "auto":
        cache = cache.cast(getattr(torch, pruning.kv_dtype))
        stats.kv_bytes_before = kv_before
        stats.kv_bytes_after = cache.num_bytes
    assert request.generation is not None
    # The whole prompt as generate() sees it (media placeholders included, whatever pruning
    # dropped), for repetition_penalty only: the decoder gets these ids too, it has no prompt.
    distinct_prompt_ids = (
        torch.unique(prompt.input_ids).tolist() if request.generation.repetition_penalty != 1.0 else []
    )
    bad_words = request.bad_words_token_ids
    # A constraint that waits for the reasoning's end holds at once when the prompt closed the
    # thinking block (vLLM reads its prompt so); the decoder, which has no prompt, is told.
    ends_reasoning = request.grammar is not None and request.grammar.prompt_ends_reasoning(
        prompt.input_ids[0].tolist()
    )
    # One first token per choice (vLLM's n), each by the choice's own sampler (seed + i, and its
    # own matcher of a structured-output constraint) from the same logits [vocab]; a sampler may
    # change the logits it gets, so each gets a copy.
    starts = []
    row = None
    for index in range(request.generation.n):
        generation = request.generation.for_choice(index)
        sampler = Sampler(
            generation,
            0,
            distinct_prompt_ids,
            adapter.eos_token_ids,
            bad_words,
            request.grammar,
            ends_reasoning,
        )
        if index == 0 and (k := request.generation.logprobs) is not None:
            # The raw distribution (last_logits [vocab]), taken before the sampler's processors
            # run (after a structured-output constraint's mask, as vLLM's: `Sampler.allowed`);
            # one row for every choice (their tokens differ, the distribution does not).
            row = rows_logprobs(sampler.allowed(last_logits).unsqueeze(0), [k])[0]
        token = sampler(last_logits if request.generation.n == 1 else last_logits.clone())
        # The decoder's first step, worked out here so the first token can go out before the
        # cache reaches a decoder; a token that ends the request is left to the decoder.
        output = OutputText(
            adapter.detokenize,
            adapter.eos_token_ids,
            generation,
            eos_token_id=adapter.eos_token_id,
        )
        text, finish = output.add(token)
        logprob = None if row is None else token_logprob(row, token, adapter.token_text)
        starts.append(ChoiceStart(token, None if finish else text, logprob))
    first, first_text = starts[0].first_token_id, starts[0].first_text
    handle = PrefillHandle(
        first_token_id=first,
        num_prompt_tokens=prompt.num_tokens,
        num_cached_tokens=cache.num_cached_tokens,
        next_position_ids=[int(x) for x in prompt.position_ids[:, 0, -1] + 1],
        kv_num_bytes=cache.num_bytes,
        prefill_ms=prefill_ms,
        num_visual_tokens_in=num_in,
        num_visual_tokens_out=num_out,
        kv_num_bytes_uncompressed=kv_before,
        pruning=stats,
        # [layers, kv_heads, cached] bool; sent only when decode-stage eviction will use it.
        visual_entry_mask=mask if pruning.decode_evict else None,
        kept_visual_token_index=kept,
        num_reused_prompt_tokens=request.num_reused_tokens,
        num_stored_prompt_tokens=request.num_stored_tokens,
        first_text=first_text,
        distinct_prompt_token_ids=distinct_prompt_ids,
        prompt_ends_reasoning=ends_reasoning,
        max_new_tokens=request.generation.max_new_tokens,
        first_logprob=starts[0].first_logprob,
        other_choices=starts[1:],
        prompt_logprobs=_prompt_logprobs(adapter, request),
        prompt_token_ids=prompt.input_ids[0].tolist() if request.generation.return_prompt_token_ids else None,
    )
    return PrefillOutput(handle, cache)


def _prompt_logprobs(adapter: VLMAdapter, request: PrefillRequest) -> list[TokenLogprob] | None:
    """The prompt logprobs its chunks computed (`PrefillRequest.prompt_logprob_rows`), with texts."""
    rows = request.prompt_logprob_rows
    if request.generation is None or request.generation.prompt_logprobs is None or rows is None:
        return None
    prompt, _, _ = request_parts(request)
    return prompt_token_logprobs(rows, prompt.input_ids[0].tolist(), adapter.token_text)
