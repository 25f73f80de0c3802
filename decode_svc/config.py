"""Settings of the Decode service."""

from __future__ import annotations

from dataclasses import dataclass, field

from epd.decode_svc.kv_sources import parse_allow_list
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import MAX_NEW_TOKENS
from epd.stages.scheduling import check_scheduling_policy
from epd.stages.server_config import ServerConfig

DEFAULT_PORT = 50053
TTFT_FIRST_DECODE_NICE = 5
"""The stack's decoders' nice with `epd serve --schedule ttft-first`. At nice 5 a busy decode
thread gets about a quarter of a core that an encode or prefill thread also wants (the kernel's
weights 335 against 1,024), so decode slows but never stops (docs/benchmarks.md, "First tokens
first in the stack")."""


@dataclass(frozen=True)
class DecodeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    max_new_tokens_limit: int = MAX_NEW_TOKENS
    max_transfer_bytes: int = 2 << 30
    """Largest single KV cache accepted from prefill."""
    kv_budget_bytes: int = 4 << 30
    """KV memory of the running batch (rows x the longest final length x bytes per token);
    requests wait for room beyond it (`decode_svc/kv_memory.py`)."""
    max_running_requests: int = 64
    """Requests decoding together in one batch at most."""
    max_waiting_requests: int = 256
    """Requests waiting for KV room at most; more are refused with RESOURCE_EXHAUSTED."""
    scheduling_policy: str = "fcfs"
    """vLLM's --scheduling-policy: requests wait for KV room in arrival order (fcfs), or by their
    priority first (priority); a running request is never preempted (`epd.stages.scheduling`)."""
    nice: int = 0
    """Added to the process's nice value at start (0-19; a lower CPU priority): where the stages
    share a host's cores, encode and prefill steps then go before decode steps, so first tokens
    come sooner and each token after them later (the stack's `--schedule ttft-first` gives its
    decoders `TTFT_FIRST_DECODE_NICE`)."""
    pull_timeout_s: float = 60.0
    allow_kv_from: tuple[str, ...] = ("127.0.0.1:*", "localhost:*", "[::1]:*")
    """Prefill servers this decoder may pull KV caches from, each `HOST:PORT`: HOST an exact DNS
    name, an IPv4 address or network (`10.0.0.0/8`), or an IPv6 address or network in brackets
    (`[::1]`, `[fd00::/8]`); PORT a number or `*` for any port. There is no any-host wildcard.
    A request's address must be exactly one `HOST:PORT` (IPv6 in brackets, no scheme, list or
    path); IP addresses compare by value, and an IPv4-mapped IPv6 address does not match an IPv4
    entry. Other addresses are refused: a client must not make us connect anywhere. Grammar in
    `decode_svc/kv_sources.py`."""

    def __post_init__(self) -> None:
        check_scheduling_policy(self.scheduling_policy)
        if not 0 <= self.nice <= 19:
            raise ValueError(f"--nice must be 0-19 (added to the process's nice value); got {self.nice}")
        parse_allow_list(self.allow_kv_from)  # ValueError names the entry and --allow-kv-from
        if self.kv_budget_bytes <= 0 or self.max_running_requests < 1 or self.max_waiting_requests < 0:
            raise ValueError(
                "--kv-budget-bytes must be > 0, --max-running-requests >= 1 and --max-waiting-requests >= 0; "
                f"got {self.kv_budget_bytes}, {self.max_running_requests}, {self.max_waiting_requests}"
            )
