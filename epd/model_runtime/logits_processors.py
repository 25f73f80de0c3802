"""What a request's vLLM / OpenAI sampling options do to its logits before a token is chosen.

One `LogitsProcessors` per request that asks for one (`GenerationConfig.processes_logits`); a
request that asks for none never builds it, so the default step stays the bare argmax or draw.
The order is vLLM v1's sampler's:

  1. logit_bias: bias[t] added to logit[t];
  2. min_tokens: end-of-sequence (unless ignore_eos) and stop_token_ids at -inf while fewer than
     min_tokens tokens are out;
  3. repetition_penalty over the prompt's and the output's tokens (positive logits divided by it,
     negative ones multiplied), then frequency_penalty x count and presence_penalty x (count > 0)
     subtracted over the output's tokens;
  4. greedy argmax, or: temperature, then min_p (`min_p`), then top-k and top-p, then the draw.

State is kept dense over the vocabulary ([vocab] tensors, made at the first step, once the
logits say how large the vocabulary is), so a step costs a few vector operations whatever the
length of the prompt or the output.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from epd.model_runtime.sampling import GenerationConfig


class LogitsProcessors:
    def __init__(
        self, config: GenerationConfig, prompt_token_ids: Sequence[int], eos_token_ids: Collection[int]
    ) -> None:
        """prompt_token_ids: the prompt's token ids (repeats allowed), read only for
        repetition_penalty; eos_token_ids: the model's, held back by min_tokens unless ignore_eos."""
        self.config = config
        self.num_output_tokens = 0
        self._output: list[int] = []  # tokens seen before the state exists (the first step makes it)
        self._prompt_token_ids = list(prompt_token_ids) if config.repetition_penalty != 1.0 else []
        held = set(config.stop_token_ids) | (set() if config.ignore_eos else set(eos_token_ids))
        self._held_back = torch.tensor(sorted(held), dtype=torch.long)  # [S]
        self._bias_ids = torch.tensor([t for t, _ in config.logit_bias], dtype=torch.long)  # [N]
        self._bias = torch.tensor([b for _, b in config.logit_bias], dtype=torch.float32)  # [N]
        self._counts: torch.Tensor | None = None  # [vocab] float32: occurrences in the output
        self._repeated: torch.Tensor | None = None  # [vocab] bool: in the prompt or the output

    def seen(self, token_id: int) -> None:
        """One more token of the output (chosen by this request's sampler or, for decode's, by prefill's)."""
        self.num_output_tokens += 1
        if self._counts is None:
            self._output.append(token_id)
            return
        self._counts[token_id] += 1
        if self._repeated is not None:
            self._repeated[token_id] = True

    def before_sampling(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] float32 -> a new [vocab] float32 tensor with steps 1-3 applied (the
        input, which may be a row of the decode batch's logits, is left as it is)."""
        c = self.config
        if self._counts is None:
            self._make_state(logits.shape[0], logits.device)
        assert self._counts is not None
        logits = logits.clone()
        if self._bias_ids.numel():
            logits.index_add_(0, self._bias_ids, self._bias)
        if self.num_output_tokens < c.min_tokens and self._held_back.numel():
            logits[self._held_back] = float("-inf")
        if self._repeated is not None:
            penalised = torch.where(logits > 0, logits / c.repetition_penalty, logits * c.repetition_penalty)
            logits = torch.where(self._repeated, penalised, logits)
        if c.frequency_penalty:
            logits -= c.frequency_penalty * self._counts
        if c.presence_penalty:
            logits -= c.presence_penalty * (self._counts > 0).float()
        return logits

    def min_p(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] after temperature -> the same with every token whose probability is below
        min_p x the top token's at -inf (vLLM's min_p; it keeps the top token)."""
        if not self.config.min_p:
            return logits
        probs = torch.softmax(logits, dim=-1)
        return logits.masked_fill(probs < self.config.min_p * probs.max(), float("-inf"))

    def _make_state(self, vocab_size: int, device: torch.device) -> None:
        ids = [*self._prompt_token_ids, *self._output]
        if ids and not 0 <= min(ids) <= max(ids) < vocab_size:  # the stages check first; never index out of range
            raise ValueError(f"a prompt or output token id is outside this model's vocabulary of {vocab_size}")
        self._held_back, self._bias_ids, self._bias = (
            t.to(device) for t in (self._held_back, self._bias_ids, self._bias)
        )
        self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        output = torch.tensor(self._output, dtype=torch.long, device=device)
        self._counts.index_add_(0, output, torch.ones(len(self._output), device=device))
        if self.config.repetition_penalty != 1.0:
            self._repeated = self._counts > 0
            self._repeated[torch.tensor(self._prompt_token_ids, dtype=torch.long, device=device)] = True
        self._output = []
        self._prompt_token_ids = []
