"""The demux-only index: keyframes, frame count, duration; cached per content hash. The rotation probe."""

from __future__ import annotations

import time

import numpy as np
import pytest

from epd.video.keyframe_index import KeyframeIndexCache, build_video_index, content_sha256, probe_rotation
from epd.video.types import DecodeLimits, MediaError, MediaLimitError


@pytest.mark.parametrize("codec,suffix", [("h264", ".mp4"), ("vp9", ".webm"), ("hevc", ".mkv")])
def test_index_finds_every_keyframe(video_factory, codec, suffix):
    data = video_factory(suffix, codec=codec, size=(96, 64), fps=10.0, seconds=3.0, gop=10)
    index = build_video_index(data)
    assert index.num_frames == 30
    assert index.num_keyframes == 3
    assert np.allclose(index.frames.keyframe_pts_s - index.frames.pts_s[0], [0.0, 1.0, 2.0])
    assert index.duration_s == pytest.approx(3.0, abs=0.01)
    assert index.source_fps == pytest.approx(10.0)
    assert (index.width, index.height) == (96, 64)
    assert index.content_sha256 == content_sha256(data)


@pytest.mark.parametrize("rotation", [0, 90, 270])
def test_rotation_probe_reads_the_display_matrix(video_factory, rotation):
    data = video_factory(".mp4", codec="h264", size=(96, 64), seconds=1.0, rotation_deg=rotation)
    assert probe_rotation(data) == rotation


def test_cache_hits_by_content_and_rechecks_limits(video_factory):
    data = video_factory(".mp4", codec="h264", size=(96, 64), seconds=1.0)
    cache = KeyframeIndexCache(max_entries=1)
    first = cache.get_or_build(data, DecodeLimits())
    assert cache.get_or_build(data, DecodeLimits()) is first
    assert (cache.num_hits, cache.num_misses) == (1, 1)
    with pytest.raises(MediaLimitError, match="lasts 1 s"):
        cache.get_or_build(data, DecodeLimits(max_duration_s=0.5))  # a cached index still obeys limits


@pytest.mark.parametrize("with_hash", [True, False], ids=["sha256-given", "hashed-beside-demux"])
def test_the_cache_is_per_tenant(video_factory, with_hash):
    """Keyed by (cache salt, content hash): another tenant's request for the same bytes builds
    the index again (a hit would show in its decode time), the same tenant's finds it."""
    data = video_factory(".mp4", codec="h264", size=(96, 64), seconds=1.0)
    sha256 = content_sha256(data) if with_hash else None
    cache = KeyframeIndexCache()
    alice = cache.get_or_build(data, DecodeLimits(), sha256, cache_salt="alice")
    bob = cache.get_or_build(data, DecodeLimits(), sha256, cache_salt="bob")
    assert bob is not alice and (cache.num_hits, cache.num_misses) == (0, 2)
    assert cache.get_or_build(data, DecodeLimits(), sha256, cache_salt="alice") is alice
    assert cache.get_or_build(data, DecodeLimits(), sha256, cache_salt="bob") is bob
    shared = cache.get_or_build(data, DecodeLimits(), sha256)  # the shared tenant is one of its own
    assert shared is not alice and shared is not bob
    assert (cache.num_hits, cache.num_misses) == (2, 3)


def test_text_file_is_rejected():
    with pytest.raises(MediaError, match="not a supported container"):
        build_video_index(b"hello, not a video\n" * 100)


def test_index_built_while_hashing_equals_the_plain_one_and_hits_stop_early(video_factory, monkeypatch):
    """Without a hash the cache hashes beside the demux pass: the same index, keyed by the
    content hash; a second call for the same bytes is a hit whose demux pass is cut short."""
    from epd.video import keyframe_index

    data = video_factory(".mp4", codec="h264", size=(96, 64), fps=10.0, seconds=60.0, gop=10)
    cache = KeyframeIndexCache()
    built = cache.get_or_build(data, DecodeLimits())
    plain = build_video_index(data)
    assert built.content_sha256 == content_sha256(data)
    assert np.array_equal(built.frame_pts, plain.frame_pts) and np.array_equal(
        built.keyframe_pts, plain.keyframe_pts
    )
    assert (cache.num_hits, cache.num_misses) == (0, 1)

    checks = []
    real_demux = keyframe_index.demux_pts

    def demux_after_the_hash(container, stream, stop=None):
        deadline = time.monotonic() + 5
        while stop is not None and not stop() and time.monotonic() < deadline:
            time.sleep(0.01)  # a long file: the hash is done before the demux gets far

        def counting_stop():
            checks.append(1)
            return stop() if stop is not None else False

        return real_demux(container, stream, counting_stop)

    monkeypatch.setattr(keyframe_index, "demux_pts", demux_after_the_hash)
    assert cache.get_or_build(data, DecodeLimits()) is built
    assert (cache.num_hits, cache.num_misses) == (1, 1)
    assert len(checks) <= 1  # stopped at its first check, or before it: at a read (ReadGuard)
    with pytest.raises(MediaLimitError, match="lasts 60 s"):
        cache.get_or_build(data, DecodeLimits(max_duration_s=10))  # a hit still obeys limits
    with pytest.raises(MediaError):
        cache.get_or_build(b"\x00" * 5000, DecodeLimits())
