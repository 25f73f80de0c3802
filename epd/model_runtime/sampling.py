"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator."""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # imported where sampling runs: the gateway reads GenerationConfig without torch


MAX_NEW_TOKENS = 4096
"""The stages' default bound on a request's max_new_tokens (OpenAI's max_tokens): decode reserves
KV room for the prompt plus all of them before it pulls the cache, so one request asking for the
whole context would hold that room for its whole life (vLLM's paged cache grows as tokens come)."""

GREEDY_BELOW_TEMPERATURE = 1e-5
"""vLLM's `_SAMPLING_EPS`: a temperature this small is greedy. Dividing by a tinier one (1e-45
passes every check of a finite number >= 0) sends the logits to inf and the sampler to NaN."""

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
    """0 is greedy, and so is anything below `GREEDY_BELOW_TEMPERATURE`; above it samples from
    softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 is off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 is off."""
    seed: int | None = None
    """Seed of the sampler (prefill's for the first token, decode's for the rest: two streams of
    it, `stream_seed`); None is a fresh random draw for each request, as OpenAI's and vLLM's
    (the front door draws it once, `with_drawn_seed`, so a repeated prefill draws the same)."""
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

    def with_drawn_seed(self) -> GenerationConfig:
        """This config with a random seed in place of None, when it samples (drawn once where a
        request comes in: prefill and decode, and a prefill repeated on another replica, then
        sample from the same seed)."""
        if self.seed is not None or self.temperature < GREEDY_BELOW_TEMPERATURE:
            return self
        return replace(self, seed=secrets.randbits(63))


def stream_seed(seed: int, stream: int) -> int:
    """The generator seed of one sampling stream (0: prefill's first token, 1: decode's tokens)
    of a request's seed. torch's CPU generator (mt19937) keeps only the low 32 bits of its seed,
    so `seed + stream` made seeds 7 and 2**32 + 7 draw the same tokens, and seed s's decode stream
    seed s + 1's prefill stream; a hash of both spreads every pair over those 32 bits."""
    digest = hashlib.blake2b(f"{seed}/{stream}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class Sampler:
    """Chooses the next token from logits. One sampler per request (it owns the RNG state)."""

    def __init__(self, config: GenerationConfig, stream: int = 0) -> None:
        import torch

        self.config = config
        self._generator: torch.Generator | None = None
        if config.temperature >= GREEDY_BELOW_TEMPERATURE:
            self._generator = torch.Generator(device="cpu")
            if config.seed is None:  # a stage called without the front door's draw
                self._generator.seed()
            else:
                self._generator.manual_seed(stream_seed(config.seed, stream))

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] (any float dtype) -> token id."""
        import torch

        logits = logits.float()
        if self._generator is None:
            return int(torch.argmax(logits))
        # Shifted first, so the largest is 0 and nothing overflows whatever the temperature.
        logits = (logits - logits.max()) / self.config.temperature
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
