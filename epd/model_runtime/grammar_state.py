"""A request's place in its structured-output constraint (`epd.model_runtime.structured_output`
compiles it): the `CompiledGrammar` every request with the same spec shares, and each request's
`GrammarState` (an xgrammar matcher and its token bitmask), which masks the logits before every
token and advances by the token chosen, waiting for the end of the reasoning when the constraint
starts after it."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from epd.model_runtime.sampling import InvalidConstraint, SamplingFailed

if TYPE_CHECKING:
    import torch  # the front door checks specs without torch


def reasoning_ended(token_ids: Sequence[int], start_id: int, end_id: int) -> bool:
    """Whether `token_ids` (a prompt) leave the model outside a thinking block: their last think
    marker is the end one. vLLM's `BaseThinkingReasoningParser.is_reasoning_end` (qwen3's and
    deepseek_r1's), which its structured outputs read of the prompt to start the grammar at once."""
    for token in reversed(token_ids):
        if token == start_id:
            return False
        if token == end_id:
            return True
    return False


class CompiledGrammar:
    """A constraint compiled against one vocabulary; immutable, shared by every request with the
    same spec (xgrammar's cache hands the same one back)."""

    def __init__(self, compiled: Any, vocab_size: int, reasoning_ids: tuple[int, int] | None = None) -> None:
        """reasoning_ids: the (`<think>`, `</think>`) token ids when the constraint starts after the
        reasoning (`StructuredOutputs.after_reasoning`); None: from the first token."""
        self._compiled = compiled
        self.vocab_size = vocab_size
        self.reasoning_ids = reasoning_ids

    def prompt_ends_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt closed the thinking block, so the constraint holds from the first
        token (False for a constraint that does not wait for the reasoning: it holds anyway)."""
        return self.reasoning_ids is not None and reasoning_ended(prompt_token_ids, *self.reasoning_ids)

    def matcher(self, prompt_ends_reasoning: bool = False) -> GrammarState:
        """A request's state at its answer's start; `prompt_ends_reasoning`: `prompt_ends_reasoning`
        of its prompt (prefill) or as prefill found it (decode)."""
        waits = self.reasoning_ids is not None and not prompt_ends_reasoning
        end_id = self.reasoning_ids[1] if waits and self.reasoning_ids is not None else None
        return GrammarState(self._compiled, self.vocab_size, end_id)


class GrammarState:
    """One request's place in its constraint (an xgrammar matcher) and its token bitmask."""

    def __init__(self, compiled: Any, vocab_size: int, reasoning_end_id: int | None = None) -> None:
        """reasoning_end_id: the token the constraint waits for (`</think>`): until the model has
        generated it nothing is masked and no token advances the matcher; None: it holds now."""
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
        self._waits_for = reasoning_end_id

    @property
    def masking(self) -> bool:
        """The constraint holds (it waits for no end of reasoning, or that end was generated)."""
        return self._waits_for is None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] float32 -> a copy with every token the constraint does not allow next at
        -inf (the input, maybe a row of decode's batch, is left as it is); the input itself while
        the constraint waits for the end of the reasoning."""
        import torch

        if self._waits_for is not None:
            return logits
        self._matcher.fill_next_token_bitmask(self._bitmask)
        if logits.device.type == "cpu" and sys.byteorder == "little":
            # Bit i of int32 word j is token 32 j + i: the words' bytes unpacked little-endian
            # first are the tokens in order. 7x faster than xgrammar's CPU kernel on a 152k
            # vocabulary (bench/bench_structured.py), the same result (tested).
            bits = np.unpackbits(
                self._bitmask.numpy().view(np.uint8), count=logits.shape[-1], bitorder="little"
            )
            return torch.where(torch.from_numpy(bits.view(np.bool_)), logits, float("-inf"))
        masked = logits.clone().unsqueeze(0)  # [1, vocab]
        self._xgr.apply_token_bitmask_inplace(
            masked, self._bitmask.to(masked.device), vocab_size=self.vocab_size
        )  # CUDA: xgrammar's kernel
        return masked[0]

    def accept(self, token_id: int, chosen_here: bool = True) -> None:
        """Advance by the token the sampler chose (`chosen_here`), or by one chosen elsewhere
        (decode's first token, prefill's choice): SamplingFailed when the constraint refuses it.
        While the constraint waits for the end of the reasoning, a token only tells whether it is
        that end (vLLM's grammar never sees the reasoning nor its end marker)."""
        if self._waits_for is not None:
            if token_id == self._waits_for:
                self._waits_for = None
            return
        if self._matcher.accept_token(token_id):
            return
        if not chosen_here:
            raise InvalidConstraint(
                f"token {token_id} does not keep to the structured-output constraint: prefill and decode "
                "serve different models"
            )
        raise self.nothing_allowed()

    @staticmethod
    def nothing_allowed() -> SamplingFailed:
        """Every token the constraint allows was held back by another setting (min_tokens holds
        back the end-of-sequence token a complete answer needs)."""
        return SamplingFailed(
            "no token both keeps to the structured-output constraint and passes this request's other "
            "settings at this step; lower min_tokens (it holds back the end-of-sequence token that "
            "ends a complete answer) or drop the stop_token_ids the constraint needs"
        )

    @property
    def terminated(self) -> bool:
        """The constraint is complete and its end (the end-of-sequence token) was accepted."""
        return bool(self._matcher.is_terminated())
