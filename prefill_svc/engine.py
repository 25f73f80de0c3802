"""Prefill: messages + visual embeddings -> KV cache + first token. No gRPC here.

The engine's result is the boundary's own type, `PrefillHandle` (without the cache's location,
which the stage that stores the cache fills in), next to the cache itself."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from epd.model_runtime.adapter import VisualMeta, VLMAdapter
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.sampling import GenerationConfig, Sampler
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.pruned_prefill import pruned_prefill
from epd.stages.contracts import EncodedMedia, PrefillHandle, check_generation_limits
from epd.stages.errors import InvalidRequest, ResourceExhausted
from epd.stages.messages import Message, check_messages, to_chat_template
from epd.token_pruning import PruningConfig, PruningStats


@dataclass
class PrefillOutput:
    """The handle decoding starts from (`kv_handle` and `kv_address` still empty) and the cache
    it describes, which the stage stores under a new `kv_handle`."""

    handle: PrefillHandle
    cache: KvCache


class PrefillEngine:
    """Owns the language model of the prefill stage; one request at a time."""

    def __init__(self, config: PrefillConfig, adapter: VLMAdapter) -> None:
        self.config = config
        self.adapter = adapter

    def validate(self, messages: Sequence[Message], meta: VisualMeta, generation: GenerationConfig) -> None:
        check_messages(messages, self.config.max_question_chars)
        check_generation_limits(generation, self.config.max_new_tokens_limit)
        if meta.num_visual_tokens > self.config.max_prompt_tokens:
            raise ResourceExhausted(
                f"{meta.num_visual_tokens} visual tokens exceed the prompt limit of "
                f"{self.config.max_prompt_tokens}; lower max_frames, fps or max_pixels"
            )

    def _check_visual(self, media: EncodedMedia) -> None:
        """The number of embeddings must match the grid (or the encoder's kept-token list):
        a mismatch means encoder and prefill serve different models, and fails this request."""
        meta, embeds = media.meta, media.embeds
        full = self.adapter.num_visual_tokens(meta.grid_thw)
        expected = full if media.token_index is None else int(media.token_index.numel())
        if embeds.ndim != 2 or embeds.shape[0] != expected or embeds.shape[1] != self.adapter.hidden_size \
                or meta.num_visual_tokens != expected:
            raise InvalidRequest(
                f"visual embeddings have shape {tuple(embeds.shape)}, expected "
                f"[{expected}, {self.adapter.hidden_size}]: encoder and prefill serve different models"
            )
        if media.token_index is not None and media.token_index.numel() and (
            int(media.token_index.max()) >= full or bool((media.token_index.diff() <= 0).any())
        ):
            raise InvalidRequest("kept_token_index must be increasing and within the grid's tokens")

    def prefill(
        self,
        messages: Sequence[Message],
        media: EncodedMedia,
        generation: GenerationConfig,
        pruning: PruningConfig = PruningConfig(),
    ) -> PrefillOutput:
        self.validate(messages, media.meta, generation)
        self._check_visual(media)
        t0 = time.perf_counter()
        try:
            # Rendered by the model's own chat template, parts in the user's order; the media
            # part's placeholder takes the kind the encoder found in the bytes.
            prompt = self.adapter.build_prompt(to_chat_template(messages, media.meta.modality), media.meta)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if prompt.num_tokens > self.config.max_prompt_tokens:
            raise ResourceExhausted(
                f"the prompt has {prompt.num_tokens} tokens, over the limit of "
                f"{self.config.max_prompt_tokens}; lower max_frames, fps or max_pixels"
            )
        stats = PruningStats(stages=list(media.pruning.stages), num_key_tokens=media.pruning.num_key_tokens)
        num_in = media.meta.num_visual_tokens
        uses_pruning = media.token_index is not None or pruning.prefill_drop or pruning.kv_compress \
            or pruning.decode_evict
        if uses_pruning:
            try:
                out = pruned_prefill(self.adapter, prompt, media.embeds, media.token_index, media.key_mask,
                                     pruning, stats)
            except ValueError as exc:  # budgets that cannot be met (e.g. key tokens over budget)
                raise InvalidRequest(str(exc)) from None
            state, mask, kept, kv_before = out.state, out.visual_entry_mask, out.kept_visual_token_index, \
                out.kv_bytes_before
            num_out = len(kept)
        else:
            state = self.adapter.prefill(prompt, media.embeds)
            mask, kept, kv_before, num_out = None, [], state.cache.num_bytes, num_in
        cache = state.cache
        if pruning.kv_dtype != "auto":
            cache = cache.cast(getattr(torch, pruning.kv_dtype))
            stats.kv_bytes_before = kv_before
            stats.kv_bytes_after = cache.num_bytes
        first = Sampler(generation)(state.last_logits)
        handle = PrefillHandle(
            first_token_id=first,
            num_prompt_tokens=state.num_prompt_tokens,
            num_cached_tokens=cache.num_cached_tokens,
            next_position_ids=[int(x) for x in state.next_position_ids],
            kv_num_bytes=cache.num_bytes,
            prefill_ms=(time.perf_counter() - t0) * 1e3,
            num_visual_tokens_in=num_in,
            num_visual_tokens_out=num_out,
            kv_num_bytes_uncompressed=kv_before,
            pruning=stats,
            # [layers, kv_heads, cached] bool; sent only when decode-stage eviction will use it.
            visual_entry_mask=mask if pruning.decode_evict else None,
            kept_visual_token_index=kept,
        )
        return PrefillOutput(handle, cache)
