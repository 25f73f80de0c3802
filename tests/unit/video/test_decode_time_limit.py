"""--max-decode-s (`DecodeLimits.max_decode_s`): the wall time one request's video decoding may
take, from the start of its decode (its demux pass included) over all its decode workers, in every
decode path. Deterministic: a clock moved by sleeping past the limit (elapsed time is at least the
sleep), a budget whose start lies before the limit, or a worker held inside one "frame" until the
test lets it go; no assertion on how fast anything runs."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from epd.video import decord_backend, parallel_decoder, simple_decoder
from epd.video.budget import DecodeBudget
from epd.video.decord_backend import DecordDecoder, decord_available
from epd.video.parallel_decode_config import ParallelDecodeConfig
from epd.video.parallel_decoder import ParallelDecoder
from epd.video.types import DecodeLimits, MediaLimitError, SamplingOptions

SMALL = dict(size=(96, 64), fps=10.0, seconds=3.0, gop=10)
OPTS = SamplingOptions(num_frames=6)
LIMIT_S = 0.05
MESSAGE = rf"decoding this video took longer than this server's limit of {LIMIT_S:g} s \(encoder flag --max-decode-s\)"


def _decode_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("video-decode-")}


def test_budget_counts_from_the_start_of_the_request_and_names_the_flag():
    frame = SimpleNamespace(width=96, height=64)
    limits = DecodeLimits(max_decode_s=LIMIT_S)
    fresh = DecodeBudget(DecodeLimits(max_decode_s=3600.0))
    fresh.charge(frame)
    fresh.check_time()
    assert 0 < fresh.remaining_s() <= 3600.0
    late = DecodeBudget(limits, started_s=time.monotonic() - 2 * LIMIT_S)  # began before the limit
    assert late.remaining_s() == 0.0
    with pytest.raises(
        MediaLimitError, match=MESSAGE + "; send a shorter clip, a lower resolution, or ask for fewer"
    ):
        late.check_time()
    with pytest.raises(MediaLimitError, match=MESSAGE):
        late.charge(frame)
    assert late.num_decoded_frames == 1  # charged, then refused: the pixel budget still counts it


def _slow_demux(monkeypatch, module, name: str) -> None:
    """The demux pass of `module.name` takes longer than LIMIT_S (it sleeps past it first)."""
    real = getattr(module, name)

    def slow(*args, **kwargs):
        time.sleep(2 * LIMIT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, slow)


def test_the_demux_pass_counts_in_the_simple_decoder(video_factory, monkeypatch):
    data = video_factory(".mp4", codec="h264", **SMALL)
    _slow_demux(monkeypatch, simple_decoder, "build_frame_index")
    with pytest.raises(MediaLimitError, match=MESSAGE):
        simple_decoder.decode(data, OPTS, DecodeLimits(max_decode_s=LIMIT_S))
    assert simple_decoder.decode(data, OPTS).num_frames == 6  # the default limit: served


def test_the_demux_pass_counts_in_the_parallel_decoder(video_factory, monkeypatch):
    data = video_factory(".mp4", codec="h264", **SMALL)
    with ParallelDecoder(ParallelDecodeConfig(num_workers=2, seek_cost_frames=0)) as dec:
        _slow_demux(monkeypatch, dec.index_cache, "get_or_build")
        with pytest.raises(MediaLimitError, match=MESSAGE):
            dec.decode(data, OPTS, DecodeLimits(max_decode_s=LIMIT_S))
        assert dec.decode(data, OPTS).num_frames == 6
        assert dec.num_live_workers == 2


def test_workers_stuck_inside_a_frame_do_not_hold_the_request_past_the_limit(video_factory, monkeypatch):
    """Every worker is inside one endless "frame" (they charge nothing): the waiting consumer
    fails the request at --max-decode-s, long before the stall (600 s) and request (600 s)
    timeouts; the stuck workers are replaced, so the pool keeps serving, and each exits once its
    frame returns."""
    data = video_factory(".mp4", codec="h264", **SMALL)
    real = parallel_decoder.decode_share
    release = threading.Event()
    stuck = {"on": True}

    def inside_one_frame(task, retired, *rest):
        if not stuck["on"]:
            return real(task, retired, *rest)
        task.request.take(task.share)  # it holds an interval (no other worker can steal it)
        release.wait(timeout=60)
        return None

    monkeypatch.setattr(parallel_decoder, "decode_share", inside_one_frame)
    others = _decode_threads()
    dec = ParallelDecoder(ParallelDecodeConfig(num_workers=2, seek_cost_frames=0, stall_timeout_s=600,
                                               request_timeout_s=600))  # fmt: skip
    try:
        with pytest.raises(MediaLimitError, match=MESSAGE):
            dec.decode(data, OPTS, DecodeLimits(max_decode_s=LIMIT_S))
        assert not release.is_set()  # refused while the workers were still stuck
        assert dec.num_replaced_workers >= 1 and dec.num_live_workers == 2
        stuck["on"] = False
        expected = simple_decoder.decode(data, OPTS).frames
        assert np.array_equal(dec.decode(data, OPTS).frames, expected)  # the fresh workers serve
    finally:
        release.set()
        dec.close()
    for thread in _decode_threads() - others:
        thread.join(timeout=10)
    assert _decode_threads() - others == set()  # no thread outlives its pool


def test_a_decode_another_backend_began_gets_what_is_left_of_its_budget(video_factory):
    """The encoder's decord fallback: PyAV's attempt after decord's child crashed counts from the
    start of the request's decode (`decode_started_s`), not from its own, which gave the request a
    second --max-decode-s. Nothing left: refused before a worker takes it; some left: its budget
    ends where the request's does."""
    data = video_factory(".mp4", codec="h264", **SMALL)
    limits = DecodeLimits(max_decode_s=60.0)
    with ParallelDecoder(ParallelDecodeConfig(num_workers=2, seek_cost_frames=0)) as dec:
        with pytest.raises(MediaLimitError, match=r"limit of 60 s \(encoder flag --max-decode-s\)"):
            dec.iter_groups(data, OPTS, limits, decode_started_s=time.monotonic() - 61.0)
        begun_s = time.monotonic() - 30.0
        with dec.iter_groups(data, OPTS, limits, decode_started_s=begun_s) as stream:
            assert stream._request is not None and stream._request.budget.deadline_s == begun_s + 60.0
            assert np.array_equal(stream.result().frames, simple_decoder.decode(data, OPTS).frames)
        assert dec.num_live_workers == 2


@pytest.mark.skipif(not decord_available(), reason="decord is an optional backend")
def test_decord_counts_from_the_start_the_encoder_gives_it(video_factory):
    """`started_s`: the encoder's start of the request's decode (before `hands_over`'s demux
    pass); a request whose budget is spent by then never reaches the child."""
    data = video_factory(".mp4", codec="h264", **SMALL)
    with DecordDecoder() as dec:
        with pytest.raises(MediaLimitError, match=r"limit of 60 s \(encoder flag --max-decode-s\)"):
            dec.decode(data, OPTS, DecodeLimits(max_decode_s=60.0), started_s=time.monotonic() - 61.0)
        assert dec._proc is None and dec.num_restarts == 0


@pytest.mark.skipif(not decord_available(), reason="decord is an optional backend")
def test_decord_child_is_stopped_at_the_limit(video_factory, monkeypatch):
    """decord decodes in a child, all at once: the parent waits only what is left of the limit,
    then kills the child (the next request starts a fresh one). A request with nothing left
    never reaches the child."""
    data = video_factory(".mp4", codec="h264", **SMALL)
    with DecordDecoder() as dec:
        with pytest.raises(MediaLimitError, match=r"limit of 1e-09 s \(encoder flag --max-decode-s\)"):
            dec.decode(data, OPTS, DecodeLimits(max_decode_s=1e-9))
        assert dec._proc is None and dec.num_restarts == 0  # refused before the child was started

        class NothingLeft(DecodeBudget):
            """Time is up just as the frames are asked for: the index pass took it all."""

            def check_time(self) -> None:
                pass

            def remaining_s(self) -> float:
                return 0.0

        monkeypatch.setattr(decord_backend, "DecodeBudget", NothingLeft)
        with pytest.raises(MediaLimitError, match=r"\(encoder flag --max-decode-s\)"):
            dec.decode(data, OPTS)  # a fresh child cannot start and answer in 0 s
        assert dec._proc is None and dec.num_restarts == 1  # killed
        monkeypatch.undo()
        assert np.array_equal(dec.decode(data, OPTS).frames, simple_decoder.decode(data, OPTS).frames)


def test_a_cancel_flag_stops_the_reference_decoder_in_its_demux_pass_and_between_frames(
    video_factory, monkeypatch
):
    """The web demo's decode (simple_decoder.decode) stops once its client's flag is set: before
    the demux pass, or at the next decoded frame (the flag is looked at with the decode's clock)."""
    from epd.video.types import DecodeCancelled

    data = video_factory(".mp4", codec="h264", **SMALL)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(DecodeCancelled, match="demux pass"):
        simple_decoder.decode(data, OPTS, cancel=cancel)
    cancel.clear()
    charged = []
    real_charge = DecodeBudget.charge

    def charge_then_cancel(self, frame):  # the client leaves after the third decoded frame
        charged.append(frame.pts)
        if len(charged) == 3:
            cancel.set()
        real_charge(self, frame)

    monkeypatch.setattr(DecodeBudget, "charge", charge_then_cancel)
    with pytest.raises(DecodeCancelled, match="after 3 decoded frames"):
        simple_decoder.decode(data, OPTS, cancel=cancel)
    assert len(charged) == 3
