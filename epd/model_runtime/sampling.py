"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # imported where sampling runs: the gateway reads GenerationConfig without torch


MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
"""At most this many stop strings of at most this many characters each: each is compared with the
end of the answer after every token (OpenAI takes 4; vLLM has no bound, and a list of megabytes
would pass its way to every stage)."""


def check_stop_strings(stop: tuple[str, ...] | list[str]) -> None:
    """ValueError naming the bound a request's stop strings pass."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are accepted")
    if (longest := max((len(s) for s in stop), default=0)) > MAX_STOP_CHARS:
        raise ValueError(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are accepted")


@dataclass(frozen=True)
class GenerationConfig:
    """How tokens are generated. The defaults are greedy and match `generate(do_sample=False)`."""

    max_new_tokens: int = 32
    """Most tokens to generate, the first token (made by prefill) included."""
    temperature: float = 0.0
    """0 is greedy; > 0 samples from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 is off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 is off."""
    seed: int = 0
    """Seed of the sampler; prefill uses it for the first token and decode uses seed + 1."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Stop when the text ends with one of these strings (the string is cut from the answer)."""
    ignore_eos: bool = False
    """Keep going past end-of-sequence (benchmarks)."""

    def validate(self, max_new_tokens_limit: int) -> None:
        if not 1 <= self.max_new_tokens <= max_new_tokens_limit:
            raise ValueError(
                f"max_new_tokens must be between 1 and {max_new_tokens_limit} (the OpenAI API's max_tokens "
                f"or max_completion_tokens), got {self.max_new_tokens}"
            )
        check_stop_strings(self.stop)
        # A NaN temperature passes `< 0` (every comparison with NaN is false).
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


class Sampler:
    """Chooses the next token from logits. One sampler per request (it owns the RNG state)."""

    def __init__(self, config: GenerationConfig, seed_offset: int = 0) -> None:
        import torch

        self.config = config
        self._generator: torch.Generator | None = None
        if config.temperature > 0:
            self._generator = torch.Generator(device="cpu")
            self._generator.manual_seed(config.seed + seed_offset)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] (any float dtype) -> token id."""
        import torch

        logits = logits.float()
        if self._generator is None:
            return int(torch.argmax(logits))
        logits = logits / self.config.temperature
        if self.config.top_k > 0:
            k = min(self.config.top_k, logits.shape[-1])
            kth = torch.topk(logits, k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.config.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep tokens until the mass before them reaches top_p (the first is always kept).
            drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= self.config.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        token = torch.multinomial(probs.cpu(), 1, generator=self._generator)
        return int(token)
