"""Bad input fails with a clear MediaError; crashed and hung workers are replaced without leaks."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from epd.video import parallel_decoder, simple_decoder
from epd.video.parallel_decode_config import ParallelDecodeConfig
from epd.video.parallel_decoder import ParallelDecoder
from epd.video.types import MediaError, SamplingOptions

SMALL = dict(size=(96, 64), fps=10.0, seconds=3.0, gop=10)
OPTS = SamplingOptions(num_frames=6)


def _num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _decode_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("video-decode-")]


@pytest.mark.parametrize(
    "make_bad,match",
    [
        (lambda good: b"", "empty"),
        (lambda good: b"this is a text file, not a video\n" * 50, "corrupt, truncated"),
        (lambda good: good[: len(good) // 2], "corrupt, truncated"),  # MP4 without its moov
        (lambda good: good[:200], "corrupt, truncated"),
    ],
    ids=["zero-bytes", "text-named-mp4", "truncated-half", "truncated-header"],
)
def test_bad_input_fails_cleanly(video_factory, decoder, make_bad, match):
    bad = make_bad(video_factory(".mp4", codec="h264", **SMALL))
    with pytest.raises(MediaError, match=match):
        decoder.decode(bad, OPTS)
    with pytest.raises(MediaError, match=match):
        simple_decoder.decode(bad, OPTS)


@pytest.mark.parametrize("suffix,codec", [(".mkv", "h264"), (".webm", "vp9")])
def test_truncated_streamable_container_matches_reference(video_factory, decoder, suffix, codec):
    """Documented choice: a truncated MKV/WebM yields the frames that are still there (as the
    reference does: the index only holds the packets that arrived), or fails like it does."""
    data = video_factory(suffix, codec=codec, **SMALL)
    cut = data[: int(len(data) * 0.6)]
    try:
        expected = simple_decoder.decode(cut, OPTS)
    except MediaError as exc:
        with pytest.raises(MediaError, match=str(exc)[:30]):
            decoder.decode(cut, OPTS)
        return
    got = decoder.decode(cut, OPTS)
    assert np.array_equal(got.frames, expected.frames)
    assert got.duration_s < 2.5  # fewer seconds than the 3 s that were encoded


def test_no_fd_or_thread_leak_across_good_and_bad_requests(video_factory):
    good = video_factory(".mp4", codec="h264", **SMALL)
    others = set(_decode_threads())  # pools of other test modules
    fds_before = _num_fds()
    with ParallelDecoder(ParallelDecodeConfig(num_workers=2, seek_cost_frames=0)) as dec:
        for _ in range(5):
            dec.decode(good, OPTS)
            with pytest.raises(MediaError):
                dec.decode(good[: len(good) // 2], OPTS)
        assert len(set(_decode_threads()) - others) == 2
    assert set(_decode_threads()) - others == set()
    assert _num_fds() <= fds_before


def test_worker_exception_fails_request_and_pool_recovers(video_factory, monkeypatch):
    good = video_factory(".mp4", codec="h264", **SMALL)
    real = parallel_decoder.decode_share
    calls = {"n": 0}

    def flaky(task, retired, *rest):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected decoder failure with /secret/path")
        return real(task, retired, *rest)

    monkeypatch.setattr(parallel_decoder, "decode_share", flaky)
    with ParallelDecoder(ParallelDecodeConfig(num_workers=2, seek_cost_frames=0)) as dec:
        with pytest.raises(MediaError, match="could not decode the media") as info:
            dec.decode(good, OPTS)
        assert "secret" not in str(info.value)  # decoder text never reaches the client
        assert np.array_equal(dec.decode(good, OPTS).frames, simple_decoder.decode(good, OPTS).frames)


class _ThreadDeath(BaseException):
    """Something that ends a worker thread outright (not an ordinary Exception)."""


def test_crashed_worker_thread_is_replaced(video_factory, monkeypatch):
    good = video_factory(".mp4", codec="h264", **SMALL)
    real = parallel_decoder.decode_share
    calls = {"n": 0}

    def crashing(task, retired, *rest):
        calls["n"] += 1
        if calls["n"] == 1:
            raise _ThreadDeath()
        return real(task, retired, *rest)

    monkeypatch.setattr(parallel_decoder, "decode_share", crashing)
    threading_excepthook = threading.excepthook
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # keep pytest output quiet
    with ParallelDecoder(ParallelDecodeConfig(num_workers=2, seek_cost_frames=0)) as dec:
        with pytest.raises(MediaError, match="worker crashed"):
            dec.decode(good, OPTS)
        for worker in list(dec._workers):  # let the dead thread finish exiting
            worker.join(timeout=0.2)
        assert dec.num_replaced_workers == 1
        assert dec.num_live_workers == 2
        assert np.array_equal(dec.decode(good, OPTS).frames, simple_decoder.decode(good, OPTS).frames)
    assert threading_excepthook is not None


def test_hung_worker_times_out_and_is_replaced(video_factory, monkeypatch):
    good = video_factory(".mp4", codec="h264", **SMALL)
    real = parallel_decoder.decode_share
    release = threading.Event()
    calls = {"n": 0}

    def hanging(task, retired, *rest):
        calls["n"] += 1
        if calls["n"] == 1:
            task.request.take(task.share)  # it holds an interval (the others cannot steal it)...
            release.wait(timeout=30)  # ...and is stuck inside FFmpeg
            return None
        return real(task, retired, *rest)

    monkeypatch.setattr(parallel_decoder, "decode_share", hanging)
    others = set(_decode_threads())
    dec = ParallelDecoder(ParallelDecodeConfig(num_workers=2, seek_cost_frames=0, stall_timeout_s=0.5))
    try:
        with pytest.raises(MediaError, match="made no progress for 0.5 s"):
            dec.decode(good, OPTS)
        assert dec.num_replaced_workers >= 1
        assert dec.num_live_workers == 2
        # The pool keeps serving while the stuck thread is still stuck.
        assert np.array_equal(dec.decode(good, OPTS).frames, simple_decoder.decode(good, OPTS).frames)
    finally:
        release.set()
        dec.close()
    for thread in set(_decode_threads()) - others:
        thread.join(timeout=5)
    assert set(_decode_threads()) - others == set()  # the stuck thread exits once it returns


def test_request_timeout(video_factory, monkeypatch):
    good = video_factory(".mp4", codec="h264", **SMALL)
    release = threading.Event()
    monkeypatch.setattr(parallel_decoder, "decode_share", lambda task, retired, *rest: release.wait(30))
    dec = ParallelDecoder(ParallelDecodeConfig(num_workers=1, request_timeout_s=0.3, stall_timeout_s=60))
    try:
        with pytest.raises(MediaError, match="did not finish within 0.3 s"):
            dec.decode(good, OPTS)
    finally:
        release.set()
        dec.close()


def test_a_late_worker_share_is_stolen_and_frames_stay_identical(video_factory, monkeypatch):
    """A task that starts late (a busy core) finds its intervals taken by the other task, which
    ran out of its own: the request finishes without it, with the reference frames."""
    good = video_factory(".mp4", codec="h264", **SMALL)
    real = parallel_decoder.decode_share
    taken: dict[int, int] = {}

    def late_or_counting(task, retired, *rest):
        if task.share == 0:
            time.sleep(1.0)
        before = task.num_decoded_frames
        real(task, retired, *rest)
        taken[task.share] = task.num_decoded_frames - before

    monkeypatch.setattr(parallel_decoder, "decode_share", late_or_counting)
    with ParallelDecoder(ParallelDecodeConfig(num_workers=2, seek_cost_frames=0)) as dec:
        got = dec.decode(good, OPTS)
    assert np.array_equal(got.frames, simple_decoder.decode(good, OPTS).frames)
    assert taken.get(0, 0) == 0 and taken[1] > 0
