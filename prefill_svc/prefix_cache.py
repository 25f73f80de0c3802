"""Prefix KV cache: a follow-up question about the same video prefills only its new tokens.

No gRPC, no model: bookkeeping over entries the prefill engine puts after a prefill and looks up
before the next one (unit-tested with fake entries, tests/unit/stages/test_prefix_cache.py).

    entry = (key, prompt token ids [L], the prompt's KV cache, bytes, last use, created)
    key   = what makes two prompts' KV differ besides their token ids: the model, the media as
            encoded (hash, grid, sampling, encoder pruning, a digest of the embeddings) and the
            request's question-independent settings (`kv_dtype`); built by the engine
            (`prefix_key.prefix_cache_key`) and opaque here

    lookup(key, ids, min_reuse) -> among the entries of `key`, the one whose ids share the longest
            common prefix (LCP) with `ids`; reused length = min(LCP, len(ids) - 1) (at least one
            token is computed, for the first token's logits; vLLM backs off the same way). It is a
            hit only if that length covers `min_reuse` tokens (every visual token of the prompt:
            placeholders share one token id, so an LCP ending inside them proves nothing) and
            `min_reuse_tokens` (16): a shorter reuse is the chat template's preamble that every
            conversation shares, and is neither used nor counted (vLLM reuses whole 16-token
            blocks only). Ties go to the most recently used entry.
            `also=PrefixView(other key, max_tokens)`: entries of another key hold the same KV for
            at most the first `max_tokens` tokens (a text-only turn's, for the text before the
            media of a conversation whose video came later); they serve up to that many.
    put(key, ids, cache, num_bytes, also) -> the tokens written (those past the prefix an entry
            held already: OpenAI's `cache_write_tokens`), kept under a byte budget. `also=PrefixView(other
            key, max_tokens)`: the entry serves that key's lookups too, up to `max_tokens` tokens (a
            media prompt's text before its first visual token, under the text-only key). An entry that
            the new one supersedes (every key it is found under, the new one is too, its ids up to
            that key's bound a prefix of the new ids: turn n's entry by turn n+1's, a text-only
            turn's by the turn that brings the video) leaves; a new one that an entry supersedes
            (a prompt that begins a cached one) is not kept, and renews that entry instead (one
            copy of the same KV); then least recently used entries
            leave until the new one fits; entries unused for `ttl_s` leave at the next call.

Counted per lookup (`stats`): a hit or a miss, and in tokens, as vLLM's `prefix_cache_queries` and
`prefix_cache_hits`: the prompt's tokens (queried) and those reused (hit).

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
from typing import Any, NamedTuple

import torch


class PrefixView(NamedTuple):
    """A key an entry is found under, and how many of its first tokens serve that key's lookups."""

    key: Hashable
    max_tokens: int


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
    also: PrefixView | None = None
    """Another key whose lookups find this entry too, for its first `max_tokens` tokens."""

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    def views(self) -> list[PrefixView]:
        """Every key it is found under, with how many of its first tokens serve that key's lookups."""
        own = [PrefixView(self.key, self.num_tokens)]
        return (
            own
            if self.also is None
            else [*own, PrefixView(self.also.key, min(self.also.max_tokens, self.num_tokens))]
        )


@dataclass(frozen=True)
class PrefixHit:
    entry: PrefixEntry
    num_reused_tokens: int
    """Tokens [0, this) of the new prompt whose KV is `entry.cache`'s first ones."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since start (hits, misses, tokens, evictions) and what is held now (entries, bytes)."""

    num_hits: int = 0
    """Lookups that reused at least `min_reuse_tokens` (and every visual token)."""
    num_misses: int = 0
    num_query_tokens: int = 0
    """Prompt tokens of every lookup (vLLM's `prefix_cache_queries`)."""
    num_hit_tokens: int = 0
    """Prompt tokens whose KV lookups took from an entry (vLLM's `prefix_cache_hits`)."""
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


MIN_REUSE_TOKENS = 16
"""A hit reuses at least this many tokens. Every chat prompt starts with its template's preamble
(Qwen2-VL's default system message and `<|im_start|>user\n`: 14 tokens), so a shorter LCP with
another conversation's entry is no reuse worth the name: it would count a hit and renew that
entry (keeping a dead conversation's KV from its LRU and TTL) for a dozen tokens' compute. vLLM's
default block size: vLLM reuses whole blocks only, so it reuses nothing shorter either."""


def _ids(token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(token_ids, dtype=torch.long).flatten()


class PrefixCache:
    """Thread-safe (lookups and puts on the model thread, stats from the event loop)."""

    def __init__(
        self,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        min_reuse_tokens: int = MIN_REUSE_TOKENS,
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.min_reuse_tokens = max(min_reuse_tokens, 1)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        """By insertion id, least recently used first."""
        self._next_id = 0
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
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
        also: PrefixView | None = None,
    ) -> PrefixHit | None:
        """The entry found under `key` sharing the longest prefix with `token_ids`, if it covers
        at least `min_reuse` tokens, `min_reuse_tokens`, and leaves one to compute; or, when none
        does, the entry found under `also`'s key sharing the longest prefix, reused up to `also`'s
        max_tokens. Counted once, as a hit or a miss, and in tokens."""
        ids = _ids(token_ids)
        with self._lock:
            self._expire()
            self.num_query_tokens += int(ids.numel())
            best: tuple[int, int] | None = None  # (reused tokens, entry id)
            # Most recently used first: a prefix many entries share renews the one in use already.
            for entry_id, entry in reversed(self._entries.items()):
                reused = self._reusable(entry, key, ids, min_reuse, also)
                if reused > 0 and (best is None or reused > best[0]):
                    best = (reused, entry_id)
            if best is None:
                self.num_misses += 1
                return None
            entry = self._entries[best[1]]
            entry.last_used_s = self._clock()
            self._entries.move_to_end(best[1])
            self.num_hits += 1
            self.num_hit_tokens += best[0]
            return PrefixHit(entry, best[0])

    def _reusable(
        self, entry: PrefixEntry, key: Hashable, ids: torch.Tensor, min_reuse: int, also: PrefixView | None
    ) -> int:
        """Tokens of `ids` `entry` may serve to a lookup of `key` (and `also`), 0 if too few."""
        common = -1  # computed once, for the first view that applies
        best = 0
        for view_key, bound in entry.views():
            if view_key == key:
                limit, floor = bound, max(min_reuse, self.min_reuse_tokens)
            elif also is not None and view_key == also.key:
                limit, floor = min(bound, also.max_tokens), self.min_reuse_tokens
            else:
                continue
            if common < 0:
                common = common_prefix_length(entry.token_ids, ids)
            reused = min(common, int(ids.numel()) - 1, limit)
            if reused >= floor:
                best = max(best, reused)
        return best

    def put(
        self,
        key: Hashable,
        token_ids: torch.Tensor | Sequence[int],
        cache: Any,
        num_bytes: int,
        also: PrefixView | None = None,
    ) -> int:
        """Keep `cache` (the KV of `token_ids`) under `key`, and under `also.key` for its first
        `also.max_tokens` tokens. Returns the tokens it wrote: those of `token_ids` past the
        longest prefix whose KV an entry held already, as lookups of `key` (and `also`) find it
        (a first turn: all of them; a follow-up: the ones after the turn it continues). 0 when it
        cannot fit at all (or the cache is off), or when an entry supersedes it: its ids begin that
        entry's (a continued assistant message whose conversation's next turn is cached, a turn
        asked again), so that entry is renewed and the same KV is not kept twice. Entries it
        supersedes leave (`_superseded`)."""
        if num_bytes > self.max_bytes:
            return 0
        ids = _ids(token_ids)
        now = self._clock()
        new = PrefixEntry(key, ids.clone(), cache, num_bytes, now, now, also)
        with self._lock:
            self._expire()
            holder = next((i for i, e in self._entries.items() if _superseded(new, e)), None)
            if holder is not None:
                self._entries[holder].last_used_s = now
                self._entries.move_to_end(holder)
                return 0
            num_held = max((self._num_held(e, key, ids, also) for e in self._entries.values()), default=0)
            for entry_id in [i for i, e in self._entries.items() if _superseded(e, new)]:
                self._drop(entry_id)
            while self._entries and self.num_bytes + num_bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.num_evictions += 1
            self._entries[self._next_id] = new
            self._next_id += 1
            self.num_bytes += num_bytes
            return new.num_tokens - num_held

    @staticmethod
    def _num_held(entry: PrefixEntry, key: Hashable, ids: torch.Tensor, also: PrefixView | None) -> int:
        """Tokens [0, this) of `ids` whose KV `entry` holds, as lookups of `key` (and `also`)
        would find it (no minimum: what `put` did not write, not what a lookup would reuse)."""
        held = 0
        for view_key, bound in entry.views():
            if view_key == key:
                limit = bound
            elif also is not None and view_key == also.key:
                limit = min(bound, also.max_tokens)
            else:
                continue
            held = max(held, min(common_prefix_length(entry.token_ids, ids), limit))
        return held

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.num_bytes = 0

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            self._expire()
            return PrefixCacheStats(
                self.num_hits,
                self.num_misses,
                self.num_query_tokens,
                self.num_hit_tokens,
                self.num_evictions,
                len(self._entries),
                self.num_bytes,
                self.max_bytes,
            )

    def _drop(self, entry_id: int) -> None:
        self.num_bytes -= self._entries.pop(entry_id).num_bytes

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        for entry_id in [i for i, e in self._entries.items() if e.last_used_s <= deadline]:
            self._drop(entry_id)
            self.num_evictions += 1


def _superseded(old: PrefixEntry, new: PrefixEntry) -> bool:
    """Whether `new` serves every lookup `old` serves, at least as far: under each key `old` is
    found (its bound b), `new` is found with a bound >= b and `old`'s first b ids begin `new`'s
    ids. Then for any prompt, `new`'s LCP within b is at least `old`'s, so dropping `old` loses no
    reuse. Turn n's entry by turn n+1's (one key); a text-only turn's entry by the entry of the
    turn that brings the video, found under the text-only key up to its first visual token (the
    same ids at the same positions: the same KV)."""
    views = dict(new.views())
    common = common_prefix_length(old.token_ids, new.token_ids)
    return all(key in views and bound <= min(views[key], common) for key, bound in old.views())
