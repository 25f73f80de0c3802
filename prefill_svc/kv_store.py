"""KV caches waiting to be pulled by a decoder: a byte budget and a time-to-live. No gRPC here.

An entry leaves by one of three doors: `take` (a decoder pulls it), `release` (its request ended
before a decoder took it: cancelled, failed, or its decoder could not pull), or its TTL. The
gateway releases on every exit path of a request, so the store holds only requests in flight.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

from epd.model_runtime.kv_cache import KvCache
from epd.stages.errors import Busy, NotFound


@dataclass
class _Entry:
    cache: KvCache
    num_bytes: int
    expires_at_s: float


class KvStore:
    """put() -> handle; take(handle) hands the cache over once; release(handle) drops it. Thread-safe."""

    def __init__(self, max_bytes: int, ttl_s: float, clock=time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self.num_bytes = 0
        self.num_expired = 0
        self.num_released = 0

    def put(self, cache: KvCache) -> str:
        size = cache.num_bytes
        with self._lock:
            self._expire()
            if self.num_bytes + size > self.max_bytes:
                raise Busy(
                    f"prefill holds {self.num_bytes} bytes of KV caches waiting for decoders and this "
                    f"one needs {size} more (limit {self.max_bytes}); retry shortly or add decode capacity"
                )
            handle = uuid.uuid4().hex
            self._entries[handle] = _Entry(cache, size, self._clock() + self.ttl_s)
            self.num_bytes += size
            return handle

    def take(self, handle: str) -> KvCache:
        with self._lock:
            self._expire()
            entry = self._entries.pop(handle, None)
            if entry is None:
                raise NotFound(f"KV cache {handle!r} is unknown or expired (TTL {self.ttl_s:.0f} s)")
            self.num_bytes -= entry.num_bytes
            return entry.cache

    def release(self, handle: str) -> bool:
        """Drop the cache of `handle`; False when it is unknown, expired or already taken."""
        with self._lock:
            self._expire()
            entry = self._entries.pop(handle, None)
            if entry is None:
                return False
            self.num_bytes -= entry.num_bytes
            self.num_released += 1
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _expire(self) -> None:
        now = self._clock()
        for handle in [h for h, e in self._entries.items() if e.expires_at_s <= now]:
            self.num_bytes -= self._entries.pop(handle).num_bytes
            self.num_expired += 1
