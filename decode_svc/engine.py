"""Decode: KV cache + first token -> the rest of the answer, one step at a time. No gRPC here.

A `Generation` is one request's decoding state (positions, sampler, text, finish reason). It
advances in one of two ways:
  * in the batch (`accept(logits)`): the decode core's runner (`epd.decode_svc.runner`) runs one
    forward pass for every running request and hands each Generation its row of logits; the
    cache lives in the runner's `BatchKv`;
  * alone (`step()`), with its own cache: requests with decode-stage eviction (their cache
    shrinks per layer and head, which a shared batch cache cannot represent), and the benchmarks
    that time one request.
Either way the same code samples, detects the end and builds the `TokenStep`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epd.decode_svc.eviction import DecodeEviction
from epd.model_runtime.adapter import VLMAdapter
from epd.model_runtime.detokenizer import OutputText
from epd.model_runtime.grammar_state import CompiledGrammar
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.logprobs import RowLogprobs, TokenLogprob, rows_logprobs, token_logprob
from epd.model_runtime.sampling import GenerationConfig, Sampler
from epd.stages.contracts import TokenStep, bad_words_token_ids
from epd.stages.errors import InvalidRequest
from epd.token_pruning import PruningConfig


class Generation:
    """One request being decoded."""

    def __init__(
        self,
        adapter: VLMAdapter,
        cache: KvCache,
        first_token_id: int,
        next_position_ids: list[int],
        config: GenerationConfig,
        visual_entry_mask: torch.Tensor | None = None,
        pruning: PruningConfig = PruningConfig(),
        own_cache: bool = True,
        prompt_token_ids: Sequence[int] = (),
        first_logprob: TokenLogprob | None = None,
        grammar: CompiledGrammar | None = None,
        prompt_ends_reasoning: bool = False,
    ) -> None:
        """own_cache: keep `cache` in this Generation and advance with `step()`; False: the
        caller keeps it (in a BatchKv) and advances with `accept(logits)`. prompt_token_ids: the
        prompt's distinct ids, for a repetition penalty (`PrefillHandle.distinct_prompt_token_ids`).
        first_logprob: the prefill's token's (`PrefillHandle.first_logprob`), sent with it.
        grammar: the request's compiled structured-output constraint (None: none); its matcher is
        advanced by the first token here, as prefill's was (`prompt_ends_reasoning`: as prefill
        found the prompt, `PrefillHandle.prompt_ends_reasoning`)."""
        self.adapter = adapter
        self.first_logprob = first_logprob
        self.config = config
        self.cache = adapter.new_decode_cache(cache) if own_cache else None
        self.positions = torch.tensor(next_position_ids, dtype=torch.long)  # [4]
        bad_words = bad_words_token_ids(config, adapter)
        self.sampler = Sampler(
            config, 1, prompt_token_ids, adapter.eos_token_ids, bad_words, grammar, prompt_ends_reasoning
        )
        # prefill sampled it: penalties, min_tokens and the constraint's matcher count it
        self.sampler.seen(first_token_id)
        self.output = OutputText(
            adapter.detokenize, adapter.eos_token_ids, config, eos_token_id=adapter.eos_token_id
        )
        self.last_token = first_token_id
        self.finish_reason = ""
        self.eviction = None
        if own_cache and pruning.decode_evict and visual_entry_mask is not None:
            shape = (cache.num_layers, cache.keys[0].shape[1], cache.num_cached_tokens)
            if visual_entry_mask.numel() != shape[0] * shape[1] * shape[2]:
                raise InvalidRequest("visual_entry_mask does not match the KV cache's shape")
            self.eviction = DecodeEviction(adapter, self.cache, visual_entry_mask.reshape(shape), pruning)

    @property
    def num_logprobs(self) -> int | None:
        """Top tokens this request wants with each token's logprob (None: no logprobs)."""
        return self.config.logprobs

    def first(self) -> TokenStep:
        """The prefill's token, as the first step."""
        step = self._emit(self.last_token)
        if self.num_logprobs is not None:
            if self.first_logprob is None or self.first_logprob.token_id != self.last_token:
                raise InvalidRequest(
                    "the request asks for logprobs but its prefill result carries none for its first token "
                    "(first_logprob); send the PrefillResult as prefill returned it"
                )
            step.logprobs = [self.first_logprob]
        return step

    def step(self) -> TokenStep:
        """Alone: run the model on the last token with this Generation's cache, emit the next."""
        if self.cache is None:
            raise RuntimeError("this Generation's cache is in a batch: advance it with accept()")
        if self.eviction is not None:
            logits = self.eviction.step(self.last_token, self.positions)
        else:
            logits = self.adapter.decode_step(self.last_token, self.positions, self.cache)
        return self.accept(logits)

    def accept(self, logits: torch.Tensor, row: RowLogprobs | None = None) -> TokenStep:
        """The model's logits [vocab] for `last_token` at `positions`: sample and emit the next.
        row: their log-probabilities, when the request asked and the batch computed them for its
        rows together (`epd.decode_svc.runner`); computed here when it asked and `row` is None."""
        if self.num_logprobs is not None and (row is None or self.sampler.constrained):
            # before the sampler runs; under a structured-output constraint, of the logits its mask
            # leaves (vLLM applies the grammar's bitmask before its sampler computes logprobs)
            row = rows_logprobs(self.sampler.allowed(logits).unsqueeze(0), [self.num_logprobs])[0]
        self.positions = self.positions + 1
        self.last_token = self.sampler(logits)
        step = self._emit(self.last_token)
        if row is not None:
            step.logprobs = [token_logprob(row, self.last_token, self.adapter.token_text)]
        return step

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def close(self) -> None:
        """Free the cache (the request ended, finished or not); no step may follow."""
        self.cache = None
        self.eviction = None
        if not self.finish_reason:
            self.finish_reason = "cancelled"

    def _emit(self, token: int) -> TokenStep:
        delta, self.finish_reason = self.output.add(token)
        if self.finish_reason:
            evicted = self.eviction.counts if self.eviction is not None else None
            return TokenStep(
                [token], delta, self.finish_reason, decode_evict=evicted, stop_reason=self.output.stop_reason
            )
        return TokenStep([token], delta)


class DecodeEngine:
    """The decode stage's model: starts Generations (the core's runner and the benchmarks)."""

    def __init__(self, adapter: VLMAdapter) -> None:
        self.adapter = adapter

    def start(
        self,
        cache: KvCache,
        first_token_id: int,
        next_position_ids: list[int],
        generation: GenerationConfig,
        visual_entry_mask: torch.Tensor | None = None,
        pruning: PruningConfig = PruningConfig(),
        own_cache: bool = True,
        prompt_token_ids: Sequence[int] = (),
        first_logprob: TokenLogprob | None = None,
        grammar: CompiledGrammar | None = None,
        prompt_ends_reasoning: bool = False,
    ) -> Generation:
        return Generation(
            self.adapter,
            cache,
            first_token_id,
            next_position_ids,
            generation,
            visual_entry_mask,
            pruning,
            own_cache,
            prompt_token_ids,
            first_logprob,
            grammar,
            prompt_ends_reasoning,
        )
