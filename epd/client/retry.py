"""When a call is tried again: UNAVAILABLE (server not up yet, connection lost, model loading)
before the first token, a bounded number of times, with exponential backoff.

Never after a token arrived: the caller has already seen part of an answer, and a second run
could answer differently (sampling) or repeat text. Stage events of a failed attempt may have
been seen already; the retried attempt sends its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 5
    """Calls in all, the first included; 1 turns retries off."""
    initial_backoff_s: float = 0.25
    """Wait before the second attempt."""
    max_backoff_s: float = 4.0
    """Longest wait between two attempts."""
    multiplier: float = 2.0
    """Each wait is this many times the previous one."""
    retryable: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,)
    """Status codes that may be retried (before the first token only). RESOURCE_EXHAUSTED, when
    listed, is retried only when the server marked it busy (`EpdError.retry_after_s`: a full queue,
    a client's requests in flight; HTTP's 429), never for a limit that no retry fixes (an upload or
    prompt too large; HTTP's 413); the wait is then at least the server's `retry_after_s`."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1 (1 = no retries)")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s or self.multiplier < 1:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s and multiplier >= 1")

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))

    def should_retry(self, code: grpc.StatusCode, attempt: int, saw_token: bool, busy: bool = False) -> bool:
        """busy: the server said when to retry (`EpdError.retry_after_s` is set)."""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not busy:
            return False
        return not saw_token and code in self.retryable and attempt < self.max_attempts


NO_RETRY = RetryPolicy(max_attempts=1)
