"""A finished decode leaves nothing behind: its request (which owns every decoded frame) is freed by
reference counting when the caller lets go, without waiting for Python's cyclic GC, which may not
run for many requests (a serving encoder then held ~270 MB of 720p frames after one large request).
"""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from epd.video.types import SamplingOptions


@pytest.fixture
def no_cyclic_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def wait_until_freed(ref: weakref.ref, bound_s: float = 10.0) -> bool:
    """A decode thread returns to its queue just after the caller has its frames: give it time."""
    deadline = time.monotonic() + bound_s
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    return ref() is None


def test_streamed_decode_frees_its_request(decoder, video_factory, no_cyclic_gc):
    data = video_factory(size=(96, 64), seconds=2.0, gop=5)
    with decoder.iter_groups(data, SamplingOptions(num_frames=8), group_size=2) as stream:
        groups = [g.frames.copy() for g in stream]
        request = weakref.ref(stream._request)
    del stream
    assert len(groups) == 4
    assert wait_until_freed(request), "the request (and its frames) outlived the decode"


def test_whole_decode_frees_its_request(decoder, video_factory, no_cyclic_gc):
    data = video_factory(size=(96, 64), seconds=2.0, gop=5)
    seen: list[weakref.ref] = []
    original = decoder.iter_groups

    def spy(*args, **kwargs):
        stream = original(*args, **kwargs)
        seen.append(weakref.ref(stream._request))
        return stream

    decoder.iter_groups = spy
    try:
        video = decoder.decode(data, SamplingOptions(num_frames=8))
    finally:
        del decoder.iter_groups
    assert video.frames.shape[0] == 8
    assert wait_until_freed(seen[0]), "the request (and its frames) outlived the decode"


def test_cancelled_decode_frees_its_request(decoder, video_factory, no_cyclic_gc):
    data = video_factory(size=(96, 64), seconds=4.0, gop=5)
    with decoder.iter_groups(data, SamplingOptions(num_frames=16), group_size=2) as stream:
        next(iter(stream))
        request = weakref.ref(stream._request)
    del stream  # left after the first group: the rest is cancelled
    assert wait_until_freed(request), "a cancelled request (and its frames) outlived the decode"
