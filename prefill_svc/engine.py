"""Prefill: question + visual embeddings -> KV cache + first token. No gRPC here."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from model_runtime.adapter import VisualMeta, VLMAdapter
from model_runtime.kv_cache import KvCache
from model_runtime.sampling import GenerationConfig, Sampler
from prefill_svc.config import PrefillConfig
from transport.errors import InvalidRequest, ResourceExhausted


@dataclass
class PrefillOutcome:
    first_token_id: int
    cache: KvCache
    next_position_ids: list[int]  # [4]
    num_prompt_tokens: int
    prefill_ms: float


class PrefillEngine:
    """Owns the language model of the prefill stage; one request at a time."""

    def __init__(self, config: PrefillConfig, adapter: VLMAdapter) -> None:
        self.config = config
        self.adapter = adapter

    def validate(self, question: str, meta: VisualMeta, generation: GenerationConfig) -> None:
        if not question.strip():
            raise InvalidRequest("the question is empty; ask something about the video")
        if len(question) > self.config.max_question_chars:
            raise InvalidRequest(
                f"the question has {len(question)} characters; the limit is {self.config.max_question_chars}"
            )
        try:
            generation.validate(self.config.max_new_tokens_limit)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if meta.num_visual_tokens > self.config.max_prompt_tokens:
            raise ResourceExhausted(
                f"{meta.num_visual_tokens} visual tokens exceed the prompt limit of "
                f"{self.config.max_prompt_tokens}; lower max_frames, fps or max_pixels"
            )

    def prefill(
        self, question: str, meta: VisualMeta, embeds: torch.Tensor, generation: GenerationConfig
    ) -> PrefillOutcome:
        self.validate(question, meta, generation)
        if embeds.ndim != 2 or embeds.shape[0] != meta.num_visual_tokens or embeds.shape[1] != self.adapter.hidden_size:
            raise InvalidRequest(
                f"visual embeddings have shape {tuple(embeds.shape)}, expected "
                f"[{meta.num_visual_tokens}, {self.adapter.hidden_size}]: encoder and prefill serve different models"
            )
        t0 = time.perf_counter()
        try:
            prompt = self.adapter.build_prompt(question, meta)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if prompt.num_tokens > self.config.max_prompt_tokens:
            raise ResourceExhausted(
                f"the prompt has {prompt.num_tokens} tokens, over the limit of "
                f"{self.config.max_prompt_tokens}; lower max_frames, fps or max_pixels"
            )
        state = self.adapter.prefill(prompt, embeds)
        first = Sampler(generation)(state.last_logits)
        return PrefillOutcome(
            first_token_id=first,
            cache=state.cache,
            next_position_ids=[int(x) for x in state.next_position_ids],
            num_prompt_tokens=state.num_prompt_tokens,
            prefill_ms=(time.perf_counter() - t0) * 1e3,
        )
