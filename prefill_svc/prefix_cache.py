"""Prefix KV cache: a follow-up question about the same video prefills only its new tokens.

No gRPC, no model: bookkeeping over entries the prefill engine puts after a prefill and looks up
before the next one (unit-tested with fake entries, tests/unit/stages/test_prefix_cache.py).

    entry = (key, prompt token ids [L], the prompt's KV cache, bytes, last use, created)
    key   = what makes two prompts' KV differ besides their token ids: the model, the media as
            encoded (hash, grid, sampling, encoder pruning, a digest of the embeddings) and the
            request's question-independent settings (`kv_dtype`); built by the engine
            (`PrefillEngine._prefix_key`) and opaque here

    lookup(key, ids, min_reuse) -> among the entries of `key`, the one whose ids share the longest
            common prefix (LCP) with `ids`; reused length = min(LCP, len(ids) - 1) (at least one
            token is computed, for the first token's logits; vLLM backs off the same way). It is a
            hit only if that length covers `min_reuse` tokens (every visual token of the prompt:
            placeholders share one token id, so an LCP ending inside them proves nothing).
            `also=(other key, max_reuse)`: entries of another key hold the same KV for at most the
            first `max_reuse` tokens (a text-only turn's, for the text before the media of a
            conversation whose video came later); they serve up to that many.
    put(key, ids, cache, num_bytes) -> kept under a byte budget: an entry whose ids are a prefix
            of the new one's (same key) is replaced by it, then least recently used entries leave
            until the new one fits; entries unused for `ttl_s` leave at the next call.

Conversations are stateless (every request sends its whole history, as OpenAI's and vLLM's
APIs): turn n+1's prompt starts with turn n's prompt, so its LCP with turn n's entry is all of it.
The entry's tensors are never written here nor by a hit: the engine continues from a copy of
KV[:reused] (`KvCache.to_dynamic` copies; transformers' DynamicCache grows by `torch.cat`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PrefixEntry:
    key: Hashable
    token_ids: torch.Tensor
    """[L] int64: the prompt whose KV `cache` holds (tokens [0, L))."""
    cache: Any
    """The prompt's KV cache (`KvCache`; any object here), read-only once stored."""
    num_bytes: int
    last_used_s: float
    created_s: float

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())


@dataclass(frozen=True)
class PrefixHit:
    entry: PrefixEntry
    num_reused_tokens: int
    """Tokens [0, this) of the new prompt whose KV is `entry.cache`'s first ones."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since start (hits, misses, evictions) and what is held now (entries, bytes)."""

    num_hits: int = 0
    num_misses: int = 0
    num_evictions: int = 0
    """Entries dropped for room (LRU) or age (TTL); replaced ones are not counted."""
    num_entries: int = 0
    num_bytes: int = 0
    max_bytes: int = 0


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D integer tensors."""
    n = min(int(a.numel()), int(b.numel()))
    differ = (a[:n] != b[:n]).nonzero()
    return n if differ.numel() == 0 else int(differ[0])


def _ids(token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(token_ids, dtype=torch.long).flatten()


class PrefixCache:
    """Thread-safe (lookups and puts on the model thread, stats from the event loop)."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        """By insertion id, least recently used first."""
        self._next_id = 0
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def lookup(
        self,
        key: Hashable,
        token_ids: torch.Tensor | Sequence[int],
        min_reuse: int,
        also: tuple[Hashable, int] | None = None,
    ) -> PrefixHit | None:
        """The entry of `key` sharing the longest prefix with `token_ids`, if it covers at least
        `min_reuse` tokens (and leaves one to compute); or, when none does, the entry of `also`'s
        key sharing the longest prefix, reused up to `also`'s max_reuse tokens. Counted once, as
        a hit or a miss."""
        ids = _ids(token_ids)
        max_reuse = int(ids.numel()) - 1
        with self._lock:
            self._expire()
            best: tuple[int, int] | None = None  # (reused tokens, entry id)
            for entry_id, entry in self._entries.items():
                if entry.key == key:
                    reused = min(common_prefix_length(entry.token_ids, ids), max_reuse)
                    if reused < max(min_reuse, 1):
                        continue
                elif also is not None and entry.key == also[0]:
                    reused = min(common_prefix_length(entry.token_ids, ids), max_reuse, also[1])
                else:
                    continue
                if best is None or reused > best[0]:
                    best = (reused, entry_id)
            if best is None or best[0] < 1:
                self.num_misses += 1
                return None
            entry = self._entries[best[1]]
            entry.last_used_s = self._clock()
            self._entries.move_to_end(best[1])
            self.num_hits += 1
            return PrefixHit(entry, best[0])

    def put(self, key: Hashable, token_ids: torch.Tensor | Sequence[int], cache: Any, num_bytes: int) -> bool:
        """Keep `cache` (the KV of `token_ids`) under `key`; False when it cannot fit at all (or
        the cache is off). Entries of `key` whose ids are a prefix of `token_ids` are replaced."""
        if num_bytes > self.max_bytes:
            return False
        ids = _ids(token_ids)
        with self._lock:
            self._expire()
            for entry_id in [
                i
                for i, e in self._entries.items()
                if e.key == key and e.num_tokens <= ids.numel() and common_prefix_length(e.token_ids, ids) == e.num_tokens
            ]:
                self._drop(entry_id)
            while self._entries and self.num_bytes + num_bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.num_evictions += 1
            now = self._clock()
            self._entries[self._next_id] = PrefixEntry(key, ids.clone(), cache, num_bytes, now, now)
            self._next_id += 1
            self.num_bytes += num_bytes
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.num_bytes = 0

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            self._expire()
            return PrefixCacheStats(
                self.num_hits, self.num_misses, self.num_evictions, len(self._entries), self.num_bytes, self.max_bytes
            )

    def _drop(self, entry_id: int) -> None:
        self.num_bytes -= self._entries.pop(entry_id).num_bytes

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        for entry_id in [i for i, e in self._entries.items() if e.last_used_s <= deadline]:
            self._drop(entry_id)
            self.num_evictions += 1
