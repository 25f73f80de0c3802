"""The multimodal token cache: key sensitivity, LRU budget, disk tier across a restart, and
entries that do not read back (corrupt, or an older format) as misses."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
import torch

from epd.encoder_svc.token_cache import TokenCache, TokenCacheConfig, make_cache_key
from epd.model_runtime.adapter import VisualMeta
from epd.stages.contracts import EncodedMedia

SHA = hashlib.sha256(b"video bytes").hexdigest()
PARAMS = {
    "sampling": {
        "fps": 2.0,
        "max_frames": 32,
        "min_frames": 2,
        "num_frames": None,
        "start_time_s": 0.0,
        "end_time_s": None,
    },
    "preprocessing": {"max_pixels": 200704, "rule": "nearest-at-or-before"},
    "model": {"id": "Qwen/Qwen2-VL-2B-Instruct", "revision": "abc123"},
    "token_dropping": {"method": "none", "keep_ratio": 1.0},
}


def _entry(seed: int, num_tokens: int = 16) -> EncodedMedia:
    g = torch.Generator().manual_seed(seed)
    return EncodedMedia(
        embeds=torch.randn(num_tokens, 8, generator=g).to(torch.bfloat16),
        meta=VisualMeta("video", (1, 8, 8), 2.0, num_tokens),
        num_frames=2,
        frame_timestamps_s=[0.0, 0.5],
        decode_ms=3.0,
        encode_ms=4.0,
        sha256=SHA,
    )


def _size(media: EncodedMedia) -> int:
    return media.embeds.numel() * media.embeds.element_size()


def _changed(path: tuple[str, str], value) -> dict:
    params = {k: dict(v) for k, v in PARAMS.items()}
    params[path[0]][path[1]] = value
    return params


@pytest.mark.parametrize(
    "params",
    [
        _changed(("sampling", "fps"), 1.0),
        _changed(("sampling", "max_frames"), 64),
        _changed(("sampling", "end_time_s"), 10.0),
        _changed(("preprocessing", "max_pixels"), 100352),
        _changed(("model", "id"), "Qwen/Qwen2-VL-7B-Instruct"),
        _changed(("model", "revision"), "def456"),
        _changed(("token_dropping", "method"), "mustdrop"),
        _changed(("token_dropping", "keep_ratio"), 0.5),
    ],
    ids=["fps", "max_frames", "end_time", "max_pixels", "model", "revision", "drop-method", "keep-ratio"],
)
def test_changing_any_key_part_misses(params):
    cache = TokenCache()
    cache.put(make_cache_key(SHA, PARAMS), _entry(0))
    assert cache.get(make_cache_key(SHA, params)) is None
    assert cache.stats().num_misses == 1


def test_other_media_bytes_miss_and_key_is_canonical():
    other = hashlib.sha256(b"other bytes").hexdigest()
    assert make_cache_key(other, PARAMS) != make_cache_key(SHA, PARAMS)
    reordered = dict(reversed(list(PARAMS.items())))
    assert make_cache_key(SHA, reordered) == make_cache_key(SHA, PARAMS)
    with pytest.raises(ValueError, match="hex sha256"):
        make_cache_key("not-a-hash", PARAMS)
    with pytest.raises(ValueError, match="finite"):
        make_cache_key(SHA, {"fps": float("nan")})


def test_hit_returns_the_stored_media():
    cache = TokenCache()
    key = make_cache_key(SHA, PARAMS)
    media = _entry(1)
    cache.put(key, media)
    media.embeds.zero_()  # the cache keeps its own copy
    hit = cache.get(key)
    assert hit is not None
    assert torch.equal(hit.embeds, _entry(1).embeds)
    assert (hit.meta, hit.num_frames, hit.frame_timestamps_s) == (media.meta, 2, [0.0, 0.5])
    assert (cache.stats().num_hits, cache.stats().num_misses) == (1, 0)


def test_memory_budget_evicts_least_recently_used():
    size = _size(_entry(0))
    cache = TokenCache(TokenCacheConfig(memory_budget_bytes=2 * size))
    keys = [make_cache_key(SHA, {"i": i}) for i in range(3)]
    cache.put(keys[0], _entry(0))
    cache.put(keys[1], _entry(1))
    assert cache.get(keys[0]) is not None  # keys[0] is now the most recently used
    cache.put(keys[2], _entry(2))  # over budget: evicts keys[1]
    assert keys[1] not in cache
    assert keys[0] in cache and keys[2] in cache
    stats = cache.stats()
    assert (stats.num_evictions, stats.num_entries, stats.memory_bytes) == (1, 2, 2 * size)


def test_disk_tier_survives_restart(tmp_path):
    key = make_cache_key(SHA, PARAMS)
    first = TokenCache(TokenCacheConfig(disk_dir=str(tmp_path)))
    first.put(key, _entry(3))
    del first
    restarted = TokenCache(TokenCacheConfig(disk_dir=str(tmp_path)))  # empty memory tier
    hit = restarted.get(key)
    assert hit is not None
    assert torch.equal(hit.embeds, _entry(3).embeds)
    assert hit.embeds.dtype == torch.bfloat16
    assert (hit.meta, hit.frame_timestamps_s) == (_entry(3).meta, [0.0, 0.5])
    assert restarted.stats().num_disk_hits == 1
    assert restarted.get(make_cache_key(SHA, {**PARAMS, "model": "x"})) is None


def test_an_entry_in_the_old_format_is_a_miss_and_is_removed(tmp_path):
    """Format 1 stored loose metadata beside the tensors; its files, found under a key, read back
    as nothing: a miss, not an error, and the pair is deleted."""
    from safetensors.torch import save_file

    key = make_cache_key(SHA, PARAMS)
    save_file(
        {"visual_embeds": _entry(0).embeds, "token_index": torch.arange(16)},
        str(tmp_path / f"{key}.safetensors"),
    )
    old_metadata = {
        "modality": "video",
        "grid_thw": [1, 8, 8],
        "second_per_grid_t": 2.0,
        "frame_timestamps_s": [0.0, 0.5],
        "pruning_stages": [],
        "num_key_tokens": 0,
    }
    (tmp_path / f"{key}.json").write_text(json.dumps({"key": key, "metadata": old_metadata, "nbytes": 256}))
    cache = TokenCache(TokenCacheConfig(disk_dir=str(tmp_path)))
    assert cache.get(key) is None
    assert cache.stats().num_misses == 1
    assert not (tmp_path / f"{key}.json").exists() and not (tmp_path / f"{key}.safetensors").exists()
    cache.put(key, _entry(0))  # and the key is usable again
    assert TokenCache(TokenCacheConfig(disk_dir=str(tmp_path))).get(key) is not None


def test_disk_budget_and_corrupt_files(tmp_path):
    size = _size(_entry(0))
    cache = TokenCache(
        TokenCacheConfig(
            memory_budget_bytes=0, disk_dir=str(tmp_path), disk_budget_bytes=int(2.5 * (size + 200))
        )
    )
    keys = [make_cache_key(SHA, {"i": i}) for i in range(4)]
    for i, key in enumerate(keys):
        cache.put(key, _entry(i))
    assert cache.stats().num_disk_evictions >= 1
    assert cache.get(keys[-1]) is not None  # the newest survives
    (tmp_path / f"{keys[-1]}.safetensors").write_bytes(b"garbage")
    assert cache.get(keys[-1]) is None  # a corrupt pair is a miss and is removed
    assert not (tmp_path / f"{keys[-1]}.json").exists()


def test_thread_safe_under_concurrent_use():
    one = _entry(0)
    size = _size(one)
    cache = TokenCache(TokenCacheConfig(memory_budget_bytes=5 * size))
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(200):
                key = make_cache_key(SHA, {"i": (worker * 7 + i) % 12})
                if cache.get(key) is None:
                    cache.put(key, one)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = cache.stats()
    assert errors == []
    assert stats.memory_bytes <= 5 * size and stats.num_entries <= 5
    assert stats.num_hits + stats.num_misses == 800
