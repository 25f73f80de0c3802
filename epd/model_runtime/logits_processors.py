"""What a request's vLLM / OpenAI sampling options do to its logits before a token is chosen.

One `LogitsProcessors` per request that asks for one (`GenerationConfig.processes_logits`); a
request that asks for none never builds it, so the default step stays the bare argmax or draw.
The order is vLLM v1's sampler's:

  1. allowed_token_ids: every other logit at -inf;
  2. bad_words: the tokens that would complete a bad word at -inf (`epd.model_runtime.bad_words`);
  3. logit_bias: bias[t] added to logit[t] (a token at -inf stays there);
  4. min_tokens: every end-of-sequence id of the model and stop_token_ids at -inf while fewer than
     min_tokens tokens are out (under ignore_eos too, as vLLM's);
  5. repetition_penalty over the prompt's and the output's tokens (positive logits divided by it,
     negative ones multiplied), then frequency_penalty x count and presence_penalty x (count > 0)
     subtracted over the output's tokens;
  6. greedy argmax, or: temperature, then min_p (`min_p`), then top-k and top-p, then the draw.

State is kept sparse: the distinct ids a penalty touches (the prompt's and the output's, as
[k] index tensors grown by one id when a new one comes out) and the output's counts, so a step
costs a few operations over those k ids, not over the vocabulary (151,936 for Qwen2-VL),
whatever the length of the prompt or the output. allowed_token_ids costs one fill of the row.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from epd.model_runtime.bad_words import BadWords
from epd.model_runtime.sampling import GenerationConfig


class LogitsProcessors:
    def __init__(
        self,
        config: GenerationConfig,
        prompt_token_ids: Sequence[int],
        eos_token_ids: Collection[int],
        bad_words_token_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """prompt_token_ids: the prompt's token ids (repeats allowed), read only for
        repetition_penalty; eos_token_ids: the model's, held back by min_tokens (ignore_eos too);
        bad_words_token_ids: config.bad_words tokenised (`tokenize_bad_words`)."""
        self.config = config
        self.num_output_tokens = 0
        self._device = torch.device("cpu")  # of the tensors below; the logits' once they are seen
        self._allowed_ids = _ids(sorted(set(config.allowed_token_ids)))  # [A]
        self._bad_words = BadWords(bad_words_token_ids)
        self._always_banned = _ids(self._bad_words.always)  # [W] the bad words of one token
        self.masks_tokens = bool(config.allowed_token_ids or bad_words_token_ids)
        """Whether allowed_token_ids or bad_words may leave a step no token (`Sampler` checks)."""
        # vLLM's MinTokensLogitsProcessor holds back its `all_stop_token_ids`, which gains the model's
        # end-of-sequence ids whatever ignore_eos says: ignore_eos lets them through after
        # min_tokens, not before it.
        held = set(config.stop_token_ids) | set(eos_token_ids)
        self._held_back = _ids(sorted(held))  # [S]
        self._bias_ids = _ids([t for t, _ in config.logit_bias])  # [N]
        self._bias = torch.tensor([b for _, b in config.logit_bias], dtype=torch.float32)  # [N]
        self._output_index: dict[int, int] = {}  # distinct output id -> its place in the two below
        self._output_ids = _ids([])  # [n] distinct output ids, first seen first
        self._output_counts = torch.zeros(0, dtype=torch.float32)  # [n] their occurrences
        self._repeated: set[int] | None = None  # the ids repetition_penalty covers (None: off)
        self._repeated_ids = _ids([])  # [k] the same ids
        if config.repetition_penalty != 1.0:
            self._repeated = set(prompt_token_ids)
            self._repeated_ids = _ids(sorted(self._repeated))

    def seen(self, token_id: int) -> None:
        """One more token of the output (chosen by this request's sampler or, for decode's, by prefill's)."""
        self.num_output_tokens += 1
        self._bad_words.seen(token_id)
        at = self._output_index.get(token_id)
        if at is not None:
            self._output_counts[at] += 1
            return
        self._output_index[token_id] = len(self._output_index)
        new = _ids([token_id], self._device)
        self._output_ids = torch.cat([self._output_ids, new])
        self._output_counts = torch.cat([self._output_counts, torch.ones(1, device=self._device)])
        if self._repeated is not None and token_id not in self._repeated:
            self._repeated.add(token_id)
            self._repeated_ids = torch.cat([self._repeated_ids, new])

    def before_sampling(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] float32 -> a new [vocab] float32 tensor with steps 1-5 applied (the
        input, which may be a row of the decode batch's logits, is left as it is)."""
        c = self.config
        if logits.device != self._device:
            self._move_to(logits.device)
        if self._allowed_ids.numel():
            allowed = logits[self._allowed_ids]  # [A] (a copy)
            logits = torch.full_like(logits, float("-inf"))
            logits[self._allowed_ids] = allowed
        else:
            logits = logits.clone()
        if self._always_banned.numel():
            logits[self._always_banned] = float("-inf")
        if banned := self._bad_words.banned_now():
            logits[_ids(banned, self._device)] = float("-inf")
        if self._bias_ids.numel():
            logits.index_add_(0, self._bias_ids, self._bias)
        if self.num_output_tokens < c.min_tokens and self._held_back.numel():
            logits[self._held_back] = float("-inf")
        if self._repeated is not None and self._repeated_ids.numel():
            repeated = logits[self._repeated_ids]  # [k]
            penalty = c.repetition_penalty
            logits[self._repeated_ids] = torch.where(repeated > 0, repeated / penalty, repeated * penalty)
        if c.frequency_penalty and self._output_ids.numel():
            logits.index_add_(0, self._output_ids, self._output_counts * -c.frequency_penalty)
        if c.presence_penalty and self._output_ids.numel():
            logits.index_add_(0, self._output_ids, torch.full_like(self._output_counts, -c.presence_penalty))
        return logits

    def min_p(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] after temperature -> the same with every token whose probability is below
        min_p x the top token's at -inf (vLLM's min_p; it keeps the top token)."""
        if not self.config.min_p:
            return logits
        probs = torch.softmax(logits, dim=-1)
        return logits.masked_fill(probs < self.config.min_p * probs.max(), float("-inf"))

    def _move_to(self, device: torch.device) -> None:
        self._device = device
        for name in (
            "_held_back", "_bias_ids", "_bias", "_output_ids", "_output_counts", "_repeated_ids",
            "_allowed_ids", "_always_banned",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name).to(device))


def _ids(ids: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long, device=device)
