"""The multimodal token cache: an encoder's output, stored under everything that determines it.

EPD's "cache multimedia tokens": a request whose key is cached skips decoding and encoding.
The key is a sha256 over a canonical JSON of
    {"v": <format version>, "family": <model_type>, "content_sha256": <sha256 of the media bytes>,
     "params": {...}}
(plus "salt": the request's `cache_salt`, its tenant, when not empty)
where `params` must hold everything else that changes the output: sampling (fps, max/min/num
frames, start/end), preprocessing (max_pixels, resize rule), the model id and its revision, and
the token-dropping settings. `make_cache_key` hashes any JSON-able dict canonically (sorted keys,
dataclasses as dicts, tuples as lists), so a change to any part is a different key.

The values are the encoder's boundary type, `EncodedMedia`, stored as its one plain-data form
(`EncodedMedia.to_record()`: named tensors + a JSON-able dict keyed like the wire's EncodeResult).
Each `get` builds a fresh EncodedMedia from the record; its tensors are shared with the cache:
treat them as read-only.

Two tiers: memory (LRU within `memory_budget_bytes`) and, optionally, a directory of
`<key>.safetensors` + `<key>.json` pairs that survives a restart (LRU by file mtime within
`disk_budget_bytes`). The json sidecar is written last and is the commit marker: a pair without it
is ignored. An entry that does not read back as an EncodedMedia (corrupt, or written in an older
format) is a miss and is deleted. No gRPC here; thread-safe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epd.stages.contracts import EncodedMedia, MediaRecord

log = logging.getLogger(__name__)

_KEY_VERSION = 4  # bump when the meaning or the format of cached values changes
"""2: values are `EncodedMedia.to_record()`. 3: the record also holds DeepStack features
("deepstack.{k}" tensors, `num_deepstack_features`) and `group_timestamps_s`, and the key names the
model family. 4: the key holds the model's dtype, device type and linear kernel, and a hub model's
snapshot (version 3's could hand a bfloat16 encoder float32 embeddings, or the reverse). Entries of an older version are never looked up (their keys differ): a miss, and
the disk tier's LRU deletes their files in time."""


@dataclass(frozen=True)
class TokenCacheConfig:
    memory_budget_bytes: int = 2 * 1024**3
    """Bytes of tensors kept in memory; least recently used entries are evicted beyond it."""
    disk_dir: str | None = None
    """Directory of the disk tier; None disables it."""
    disk_budget_bytes: int = 20 * 1024**3
    """Bytes of safetensors files kept on disk; least recently used files are deleted beyond it."""

    def __post_init__(self) -> None:
        if self.memory_budget_bytes < 0 or self.disk_budget_bytes < 0:
            raise ValueError("cache budgets must be >= 0 bytes")


_FACTS_FIELD = "cache_facts"
"""The record field (not one of `EncodedMedia.to_record`'s, which ignores it) holding `put`'s facts."""


def _facts(record: MediaRecord) -> dict[str, float]:
    facts = record.fields.get(_FACTS_FIELD)
    try:
        return {str(k): float(v) for k, v in facts.items()} if isinstance(facts, dict) else {}
    except (TypeError, ValueError):  # a foreign sidecar: as if it recorded nothing
        return {}


def _nbytes(record: MediaRecord) -> int:
    return sum(t.numel() * t.element_size() for t in record.tensors.values())


@dataclass
class TokenCacheStats:
    num_hits: int = 0
    num_disk_hits: int = 0
    """Hits served from the disk tier (also counted in num_hits)."""
    num_misses: int = 0
    num_evictions: int = 0
    """Entries dropped from memory to stay within the memory budget."""
    num_disk_evictions: int = 0
    num_entries: int = 0
    memory_bytes: int = 0
    disk_bytes: int = 0


def _canonical(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _canonical(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"cache key parameters must be finite numbers, got {value}")
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"cache key parameter of type {type(value).__name__} is not JSON-able")


def make_cache_key(
    content_sha256: str, params: dict[str, Any], family: str = "", cache_salt: str = ""
) -> str:
    """Hex sha256 of the media hash plus every parameter that changes the encoder's output.
    `family` (the model's `model_type`, e.g. "qwen3_vl") is its own part of the key: families
    put different things in an entry (Qwen3-VL's DeepStack features), so an entry made by one
    family is never served to another, whatever else the parameters say. `cache_salt` is the
    request's tenant: another salt is another key, so a tenant neither hits nor learns of (by
    hash) what another cached. The empty salt adds nothing: the shared tenant keeps the keys it
    had before salts existed (and its disk entries)."""
    if len(content_sha256) != 64 or any(c not in "0123456789abcdef" for c in content_sha256):
        raise ValueError("content_sha256 must be a lower-case hex sha256 digest of the media bytes")
    doc = {
        "v": _KEY_VERSION,
        "family": family,
        "content_sha256": content_sha256,
        "params": _canonical(params),
    }
    if cache_salt:
        doc["salt"] = cache_salt
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


class TokenCache:
    """Memory LRU over an optional disk tier, keyed by `make_cache_key`."""

    def __init__(self, config: TokenCacheConfig | None = None):
        self.config = config or TokenCacheConfig()
        self._lock = threading.Lock()
        self._memory: OrderedDict[str, MediaRecord] = OrderedDict()
        self._memory_bytes = 0
        self._stats = TokenCacheStats()
        self._disk_dir = Path(self.config.disk_dir) if self.config.disk_dir else None
        if self._disk_dir is not None:
            self._disk_dir.mkdir(parents=True, exist_ok=True)

    # -- lookups ----------------------------------------------------------------------------
    def get(self, key: str) -> EncodedMedia | None:
        """The media stored under `key`, as it was put (`cache_hit` and the timings included)."""
        entry = self.get_entry(key)
        return None if entry is None else entry[0]

    def get_entry(self, key: str) -> tuple[EncodedMedia, dict[str, float]] | None:
        """(the media, the facts it was put with: {} for none) stored under `key`."""
        with self._lock:
            record = self._memory.get(key)
            if record is not None:
                self._memory.move_to_end(key)
                self._stats.num_hits += 1
                return EncodedMedia.from_record(record), _facts(record)
        loaded = self._load_from_disk(key)
        with self._lock:
            if loaded is None:
                self._stats.num_misses += 1
                return None
            record, media = loaded
            self._stats.num_hits += 1
            self._stats.num_disk_hits += 1
            self._insert_memory(key, record)
        return media, _facts(record)

    def __contains__(self, key: str) -> bool:
        """True if `get(key)` would hit; does not touch the counters or the LRU order."""
        with self._lock:
            if key in self._memory:
                return True
        return self._disk_dir is not None and self._sidecar(key).exists()

    def put(self, key: str, media: EncodedMedia, facts: dict[str, float] | None = None) -> None:
        """Store a copy of `media` (its tensors moved to CPU, contiguous) under `key`, with `facts`:
        what the caller must know of the media on a later hit that the tokens do not say (the
        encoder: its video's duration, to hold a hit to the limits of the day)."""
        record = media.to_record()
        fields = {**record.fields, _FACTS_FIELD: dict(facts or {})}
        json.dumps(fields)  # fail now, not at load time, on a non-JSON-able value
        record = MediaRecord(
            {name: t.detach().to("cpu").contiguous().clone() for name, t in record.tensors.items()},
            fields,
        )
        with self._lock:
            self._insert_memory(key, record)
        if self._disk_dir is not None:
            self._write_to_disk(key, record)

    def stats(self) -> TokenCacheStats:
        with self._lock:
            stats = dataclasses.replace(self._stats)
            stats.num_entries = len(self._memory)
            stats.memory_bytes = self._memory_bytes
        if self._disk_dir is not None:
            stats.disk_bytes = sum(p.stat().st_size for p in self._disk_dir.glob("*.safetensors"))
        return stats

    # -- memory tier (caller holds the lock) ------------------------------------------------
    def _insert_memory(self, key: str, record: MediaRecord) -> None:
        budget = self.config.memory_budget_bytes
        old = self._memory.pop(key, None)
        if old is not None:
            self._memory_bytes -= _nbytes(old)
        if _nbytes(record) > budget:
            return  # larger than the whole tier: the disk tier (if any) still holds it
        self._memory[key] = record
        self._memory_bytes += _nbytes(record)
        while self._memory_bytes > budget:
            _, evicted = self._memory.popitem(last=False)
            self._memory_bytes -= _nbytes(evicted)
            self._stats.num_evictions += 1

    # -- disk tier --------------------------------------------------------------------------
    def _tensor_file(self, key: str) -> Path:
        assert self._disk_dir is not None
        return self._disk_dir / f"{key}.safetensors"

    def _sidecar(self, key: str) -> Path:
        assert self._disk_dir is not None
        return self._disk_dir / f"{key}.json"

    def _write_to_disk(self, key: str, record: MediaRecord) -> None:
        from safetensors.torch import save_file

        tensor_file, sidecar = self._tensor_file(key), self._sidecar(key)
        suffix = f".tmp{os.getpid()}.{threading.get_ident()}"
        try:
            save_file(record.tensors, str(tensor_file) + suffix)
            os.replace(str(tensor_file) + suffix, tensor_file)
            side = {"key": key, "fields": record.fields, "nbytes": _nbytes(record), "written_at": time.time()}
            Path(str(sidecar) + suffix).write_text(json.dumps(side))
            os.replace(str(sidecar) + suffix, sidecar)  # commit marker, written last
        except OSError as exc:  # a full disk must not fail the request
            log.warning("token cache: could not write %s: %r", key, exc)
            for path in (Path(str(tensor_file) + suffix), Path(str(sidecar) + suffix)):
                path.unlink(missing_ok=True)
            return
        self._evict_disk()

    def _load_from_disk(self, key: str) -> tuple[MediaRecord, EncodedMedia] | None:
        if self._disk_dir is None:
            return None
        from safetensors.torch import load_file

        tensor_file, sidecar = self._tensor_file(key), self._sidecar(key)
        try:
            side = json.loads(sidecar.read_text())
            record = MediaRecord(load_file(str(tensor_file)), side["fields"])
            media = EncodedMedia.from_record(record)
            os.utime(sidecar)  # LRU order on disk is the sidecar's mtime
        except FileNotFoundError:
            return None
        # corrupt or foreign pair (SafetensorError, bad json, missing field): drop it
        except Exception as exc:
            log.warning("token cache: dropping unreadable entry %s: %r", key, exc)
            tensor_file.unlink(missing_ok=True)
            sidecar.unlink(missing_ok=True)
            return None
        return record, media

    def _evict_disk(self) -> None:
        assert self._disk_dir is not None
        entries = []
        for sidecar in self._disk_dir.glob("*.json"):
            tensor_file = sidecar.with_suffix(".safetensors")
            try:
                entries.append((sidecar.stat().st_mtime, tensor_file.stat().st_size, sidecar, tensor_file))
            except FileNotFoundError:
                continue  # removed by another thread or half-written
        used = sum(size for _, size, _, _ in entries)
        for _, size, sidecar, tensor_file in sorted(entries, key=lambda e: e[0]):
            if used <= self.config.disk_budget_bytes:
                break
            sidecar.unlink(missing_ok=True)
            tensor_file.unlink(missing_ok=True)
            used -= size
            with self._lock:
                self._stats.num_disk_evictions += 1
