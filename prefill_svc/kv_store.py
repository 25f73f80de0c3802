"""KV caches waiting to be pulled by a decoder: a byte budget and a time-to-live. No gRPC here.

Handover over the network is two steps, so that a broken pull loses nothing: `lease` gives the
cache to a decoder and keeps it here (a pull that breaks half way, or a decoder that dies before
it has the whole cache, can be pulled again, by the same or another decoder); `confirm` (the
decoder assembled all of it) drops it. In-process (the embedded mode) `take` does both at once.
A request with n choices (OpenAI's `n`) stores its cache once for n decoders: it leaves at the
n-th confirm (or take); each choice's decoder pulls it as a request's would.

An entry leaves by one of four doors: `confirm` (its decoder has it), `take`, `release` (its
request ended before a decoder had it: cancelled, failed, or its decoder could not pull), or its
TTL, which bounds what a decoder that leased and died, or a gateway that died, can leave behind.
The gateway releases on every exit path of a request, so the store holds only requests in flight.
The store's bytes drop at whichever comes first; a lease changes nothing in them.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from dataclasses import dataclass

from epd.model_runtime.kv_cache import KvCache
from epd.stages.errors import Busy, InvalidRequest, NotFound

_HANDLE = re.compile(r"[0-9a-f]{32}")


def check_handle(handle: str) -> str:
    """A caller's handle ("" = the store picks one): 32 lowercase hex digits, as the store's
    own (a random 128 bits, uuid4: it is what lets a decoder pull the cache)."""
    if handle and not _HANDLE.fullmatch(handle):
        raise InvalidRequest("kv_handle must be 32 lowercase hex digits (a random 128-bit id), or empty")
    return handle


@dataclass(frozen=True)
class KvStoreStats:
    """What the store holds now (caches, bytes, budget) and the caches it dropped before a
    decoder confirmed them, since start (its /metrics, `EngineLoad.kv_store_*`)."""

    num_caches: int
    num_bytes: int
    max_bytes: int
    num_expired: int
    """At their TTL: a decoder or gateway died, or decode did not pull in time."""
    num_released: int
    """Their request ended first (cancelled, failed, or its decoder could not pull)."""
    num_refused: int = 0
    """Not stored: the store was full (`put` raised Busy; the request failed RESOURCE_EXHAUSTED)."""


@dataclass
class _Entry:
    cache: KvCache
    num_bytes: int
    expires_at_s: float
    num_leases: int = 0
    """Pulls begun (`lease`); more than the choices means an earlier pull broke or was not confirmed."""
    num_choices: int = 1
    """Decoders that will pull it: one per choice of its request (OpenAI's `n`)."""
    num_handovers_left: int = 1
    """Confirms (or takes) until the entry goes: the request's choices not yet handed over."""


class KvStore:
    """put() -> handle; lease(handle) + confirm(handle) hand the cache over (take: both at once);
    release(handle) drops it. Thread-safe."""

    def __init__(self, max_bytes: int, ttl_s: float, clock=time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self.num_bytes = 0
        self.num_expired = 0
        self.num_released = 0
        self.num_confirmed = 0
        self.num_refused = 0

    def put(self, cache: KvCache, handle: str = "", num_choices: int = 1) -> str:
        """Store `cache` under `handle` (the caller's, `check_handle`) or a new one; returns it.
        `num_choices`: how many decoders will confirm (or take) it before it goes; its bytes count
        once, as it is held once."""
        size = cache.num_bytes
        with self._lock:
            self._expire()
            if handle in self._entries:
                raise InvalidRequest("that kv_handle already names a stored KV cache; send a new random one")
            if self.num_bytes + size > self.max_bytes:
                self.num_refused += 1
                raise Busy(
                    f"prefill holds {self.num_bytes} bytes of KV caches waiting for decoders and this "
                    f"one needs {size} more (limit {self.max_bytes}, prefill flag --kv-store-bytes); retry "
                    "shortly or add decode capacity"
                )
            handle = handle or uuid.uuid4().hex
            self._entries[handle] = _Entry(
                cache, size, self._clock() + self.ttl_s, 0, num_choices, num_choices
            )
            self.num_bytes += size
            return handle

    def lease(self, handle: str) -> tuple[KvCache, int]:
        """(the cache of `handle`, how many pulls of it began, this one included, past its other
        choices' first pulls: more than 1 means an earlier pull broke or was not confirmed) for a
        decoder that will `confirm` receipt; the entry stays until then, `release` or its TTL."""
        with self._lock:
            self._expire()
            entry = self._entries.get(handle)
            if entry is None:
                raise NotFound(f"KV cache {handle!r} is unknown or expired (TTL {self.ttl_s:.0f} s)")
            entry.num_leases += 1
            return entry.cache, max(1, entry.num_leases - entry.num_choices + 1)

    def confirm(self, handle: str) -> bool:
        """The decoder has the whole cache of `handle`: drop it here, once every choice's decoder
        has confirmed. False when it is unknown, expired or gone already (released by the gateway,
        or confirmed by every choice)."""
        with self._lock:
            self._expire()
            entry = self._entries.get(handle)
            if entry is None:
                return False
            entry.num_handovers_left -= 1
            if entry.num_handovers_left <= 0:
                self._drop(handle)
                self.num_confirmed += 1
            return True

    def is_leased(self, handle: str) -> bool:
        with self._lock:
            entry = self._entries.get(handle)
            return entry is not None and entry.num_leases > 0

    def take(self, handle: str) -> KvCache:
        """Lease and confirm at once: the in-process handover, which cannot break half way.
        The last choice's take gets the stored cache; an earlier one a copy (its decoder extends
        what it takes in place)."""
        with self._lock:
            self._expire()
            entry = self._entries.get(handle)
            if entry is None:
                raise NotFound(f"KV cache {handle!r} is unknown or expired (TTL {self.ttl_s:.0f} s)")
            entry.num_handovers_left -= 1
            if entry.num_handovers_left > 0:
                return entry.cache.clone()
            self._drop(handle)
            return entry.cache

    def release(self, handle: str) -> bool:
        """Drop the cache of `handle`; False when it is unknown, expired or already taken."""
        with self._lock:
            if self._drop(handle) is None:
                return False
            self.num_released += 1
            return True

    def _drop(self, handle: str) -> _Entry | None:
        """Under the lock: remove `handle`'s entry (after expiring old ones) and its bytes."""
        self._expire()
        entry = self._entries.pop(handle, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
        return entry

    def stats(self) -> KvStoreStats:
        with self._lock:
            # Expiry is otherwise lazy (at the next put or pull): an idle store would go on
            # showing caches whose TTL has passed, and not count them as expired.
            self._expire()
            return KvStoreStats(
                len(self._entries),
                self.num_bytes,
                self.max_bytes,
                self.num_expired,
                self.num_released,
                self.num_refused,
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _expire(self) -> None:
        now = self._clock()
        for handle in [h for h, e in self._entries.items() if e.expires_at_s <= now]:
            self.num_bytes -= self._entries.pop(handle).num_bytes
            self.num_expired += 1
