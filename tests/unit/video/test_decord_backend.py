"""The optional decord backend: same frames as PyAV where its FFmpeg agrees; a hang is killed."""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import os
import signal
import time

import grpc
import numpy as np
import pytest

from epd.transport.errors import status_of
from epd.video import simple_decoder
from epd.video.budget import MIN_PIXELS_PER_FRAME
from epd.video.decord_backend import DecordConfig, DecordDecoder, decord_available
from epd.video.types import DecodeLimits, DecoderCrashed, MediaError, MediaLimitError, SamplingOptions

# Never import decord into the test process: it breaks PyAV's own codecs (see decord_backend).
pytestmark = pytest.mark.skipif(not decord_available(), reason="decord is an optional backend")

SMALL = dict(size=(96, 64), fps=10.0, seconds=3.0, gop=10)


@pytest.fixture(scope="module")
def decord_decoder():
    dec = DecordDecoder()
    yield dec
    dec.close()


def _is_decord2() -> bool:
    """decord2 (the maintained fork, which the set-up pins) rather than decord 0.6: both install
    the `decord` module, which this process never imports."""
    try:
        importlib.metadata.version("decord2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize(
    "codec,suffix",
    [("h264", ".mp4"), ("h264", ".mkv"), ("vp9", ".webm"), ("mjpeg", ".avi"), ("hevc", ".mp4")],
)
def test_decord_frames_identical_to_reference(video_factory, decord_decoder, codec, suffix):
    """96 px wide: decord2 pads these frames' rows and mis-shapes them (`_read_frames`). HEVC: after a
    seek decord returns the next frame, so its frames are read in order (start_time_s 0.2 and six
    frames of 30 make it seek)."""
    data = video_factory(suffix, codec=codec, **SMALL)
    opts = SamplingOptions(num_frames=6, start_time_s=0.2)
    got = decord_decoder.decode(data, opts)
    expected = simple_decoder.decode(data, opts)
    assert np.array_equal(got.frames, expected.frames)
    assert got.timestamps_s == expected.timestamps_s


LONG = dict(size=(96, 64), fps=10.0, seconds=60.0, gop=10)  # 600 frames, a keyframe every second
NEAR_THE_END = SamplingOptions(num_frames=4, start_time_s=55.0)
BUDGET = DecodeLimits(max_decoded_pixels=100 * MIN_PIXELS_PER_FRAME)  # 100 of these frames


def test_a_long_hevc_video_asked_near_its_end_is_handed_to_pyav(video_factory, decord_decoder, decoder):
    """decord reads HEVC from the first frame (its seeks land one frame late): ~600 frames for four
    near the end, past a budget of 100, where PyAV seeks and decodes one keyframe interval per
    target. Such a request is PyAV's (`hands_over`: the encoder then decodes it with PyAV); H.264,
    an image, or HEVC whose targets need every frame anyway stay with decord."""
    hevc = video_factory(".mp4", codec="hevc", **LONG)
    with pytest.raises(MediaLimitError, match="would take 59[0-9] frames of 96x64"):
        decord_decoder.decode(hevc, NEAR_THE_END, BUDGET)
    assert decord_decoder.hands_over(hevc, NEAR_THE_END, BUDGET)
    pyav = decoder.decode(hevc, NEAR_THE_END, BUDGET)  # the encoder's PyAV decoder: within the budget
    assert np.array_equal(pyav.frames, simple_decoder.decode(hevc, NEAR_THE_END).frames)
    assert not decord_decoder.hands_over(video_factory(".mp4", codec="h264", **LONG), NEAR_THE_END, BUDGET)
    short = video_factory(".mp4", codec="hevc", **SMALL)  # 30 frames, keyframes at 0, 10, 20
    assert not decord_decoder.hands_over(short, SamplingOptions(num_frames=30))
    assert decord_decoder.hands_over(short, SamplingOptions(num_frames=2, start_time_s=2.0))


def test_decord_applies_rotation(video_factory, decord_decoder):
    data = video_factory(".mp4", codec="h264", rotation_deg=90, **SMALL)
    opts = SamplingOptions(num_frames=3)
    assert np.array_equal(decord_decoder.decode(data, opts).frames, simple_decoder.decode(data, opts).frames)


def test_decord_refuses_what_it_cannot_decode(video_factory, decord_decoder):
    """AVI with B-frames: decord's frame table disagrees with the demux index."""
    data = video_factory(".avi", codec="mpeg4", bframes=2, **SMALL)
    with pytest.raises(MediaError, match="use the default PyAV backend"):
        decord_decoder.decode(data, SamplingOptions(num_frames=3))


def test_decord2_decodes_av1_and_mpeg4_as_pyav_does(video_factory, decord_decoder):
    """decord 0.6's FFmpeg 4 cannot open AV1 and its MPEG-4 Part 2 decoder is +-1 off FFmpeg 8's;
    decord2 bundles FFmpeg 8."""
    opts = SamplingOptions(num_frames=6, start_time_s=0.2)
    av1 = video_factory(".webm", codec="av1", **SMALL)
    mpeg4 = video_factory(".avi", codec="mpeg4", **SMALL)
    if not _is_decord2():
        with pytest.raises(MediaError, match="use the default PyAV backend"):
            decord_decoder.decode(av1, opts)
        return
    for data in (av1, mpeg4):
        got = decord_decoder.decode(data, opts)
        assert np.array_equal(got.frames, simple_decoder.decode(data, opts).frames)


def test_decord_hang_is_killed_and_backend_restarts(video_factory):
    data = video_factory(".mp4", codec="h264", **SMALL)
    with DecordDecoder(DecordConfig(timeout_s=0.001)) as dec:
        # The child cannot even start within 1 ms: it is treated as hung and killed.
        with pytest.raises(MediaError, match="did not answer within"):
            dec.decode(data, SamplingOptions(num_frames=3))
        assert dec.num_restarts == 1 and dec._proc is None
        dec.config = DecordConfig(timeout_s=60)
        got = dec.decode(data, SamplingOptions(num_frames=3))
    assert np.array_equal(got.frames, simple_decoder.decode(data, SamplingOptions(num_frames=3)).frames)


@pytest.mark.parametrize("rotation_deg", [0, 90, 180, 270])
@pytest.mark.parametrize("max_pixels", [48 * 32, 50 * 34], ids=["48x32", "50x32"])
def test_decord_downscales_rotated_clips_to_pyavs_shapes(
    video_factory, decord_decoder, rotation_deg, max_pixels
):
    """max_pixels on a clip with a display rotation: the shapes PyAV gives (scaled, then turned:
    [48, 32, 3] for a 96x64 clip turned 90 degrees at 48x32 pixels), pixels within swscale's
    rounding of PyAV's. decord's own scaler failed here (it takes the size after rotation, and a
    48 px wide output fails in it whatever the rotation)."""
    data = video_factory(".mp4", codec="h264", rotation_deg=rotation_deg, **SMALL)
    opts = SamplingOptions(num_frames=4, max_pixels=max_pixels)
    expected = simple_decoder.decode(data, opts).frames  # [4, h, w, 3]
    got = decord_decoder.decode(data, opts).frames
    assert got.shape == expected.shape
    # 2.5-3.2 here (swscale on RGB against on YUV before turning); a neighbouring frame differs by ~50
    assert np.abs(got.astype(np.int16) - expected).mean() < 8.0


class _ChildKiller:
    """The decoder's pipe to its child, which SIGKILLs the child (as a crash or the OOM killer
    would) `when` the request is sent ("send": the child is dead before it gets the request) or
    as the parent starts waiting for the answer ("wait": the child has the request)."""

    def __init__(self, decoder: DecordDecoder, when: str):
        self.decoder, self.when, self.conn = decoder, when, decoder._conn

    def _kill(self) -> None:
        proc = self.decoder._proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)

    def send(self, msg) -> None:
        if self.when == "send":
            self._kill()
        self.conn.send(msg)

    def poll(self, timeout_s: float) -> bool:
        if self.when == "wait":
            self._kill()
        return self.conn.poll(timeout_s)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def _kill_in_next_request(decoder: DecordDecoder, when: str) -> None:
    """The next request's child (the running one, or the fresh one started for it) is killed
    `when` (see _ChildKiller); later requests run as usual."""
    start_child = decoder._ensure_child

    def start_and_arm() -> None:
        start_child()
        decoder._conn = _ChildKiller(decoder, when)
        del decoder._ensure_child  # back to the class's method

    decoder._ensure_child = start_and_arm  # type: ignore[method-assign]


def _decord_children(others: set) -> set:
    """This process's live (unreaped) decord children, but `others` (other tests' decoders)."""
    return {p for p in multiprocessing.active_children() if p.name == "decord"} - others


@pytest.mark.parametrize("when", ["send", "wait"])
def test_a_decord_child_that_dies_mid_request_is_unavailable_and_replaced(video_factory, when):
    """UNAVAILABLE ("retry"), not INVALID_ARGUMENT blaming the video (a child dead while it worked)
    nor INTERNAL (BrokenPipeError on the send); the dead child is reaped and the next request
    gets a fresh one and its frames, also after two such deaths in a row."""
    data = video_factory(".mp4", codec="h264", **SMALL)
    opts = SamplingOptions(num_frames=3)
    others = _decord_children(set())
    with DecordDecoder() as dec:
        dec.decode(data, opts)  # the child is up
        dead = dec._proc
        _kill_in_next_request(dec, when)
        with pytest.raises(DecoderCrashed) as failed:
            dec.decode(data, opts)
        assert status_of(failed.value) == (
            grpc.StatusCode.UNAVAILABLE,
            "the decoder process failed; retry the request",
        )
        assert dec.num_restarts == 1 and dec._proc is None
        assert dead is not None and not dead.is_alive() and dead not in _decord_children(others)

        _kill_in_next_request(dec, when)  # the fresh child dies too
        with pytest.raises(DecoderCrashed, match="the decoder process failed; retry the request"):
            dec.decode(data, opts)
        assert dec.num_restarts == 2 and _decord_children(others) == set()

        got = dec.decode(data, opts)
        assert np.array_equal(got.frames, simple_decoder.decode(data, opts).frames)
        assert _decord_children(others) == {dec._proc}
    assert _decord_children(others) == set()


def test_a_hung_decord_child_does_not_outlive_its_killed_server(video_factory, tmp_path):
    """The server (here a process that started the child, then is SIGKILLed) dies while its child
    hangs (stopped: it cannot read the closed pipe): the child must go too. It stayed, orphaned,
    since it noticed its server only by the pipe, between requests."""
    import subprocess
    import sys

    import psutil

    from tests.stack import ROOT, child_env

    video = tmp_path / "clip.mp4"
    video.write_bytes(video_factory(".mp4", **SMALL))
    # One decode first: the child is then in its request loop, past its start-up.
    code = (
        "import sys, time; from epd.video.decord_backend import DecordDecoder; "
        "from epd.video.types import SamplingOptions; d = DecordDecoder(); "
        "d.decode(open(sys.argv[1], 'rb').read(), SamplingOptions(num_frames=2)); "
        "print(d._proc.pid, flush=True); time.sleep(60)"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", code, str(video)], stdout=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT
    )
    child = psutil.Process(int(server.stdout.readline()))
    try:
        child.suspend()  # SIGSTOP: a decode that hangs
        server.kill()
        server.wait(timeout=10)
        gone, _ = psutil.wait_procs([child], timeout=10)
        assert gone, f"the decord child {child.pid} outlived its server ({child.status()})"
    finally:
        if child.is_running():
            child.kill()


def test_close_is_bounded_while_a_decode_holds_the_child(video_factory):
    """`close(wait_s)` is one part of its owner's one close deadline (`close_in_turn`): a decode
    still running in the child (here a child stopped mid-request, as a hung decode) must not hold
    it for the decode's own bound (`DecordConfig.timeout_s`). Past `wait_s` the child is killed,
    and the decode fails as a crashed child. Before, close waited for the decoder's lock, so for
    the whole decode."""
    import threading

    import psutil

    data = video_factory(".mp4", codec="h264", **SMALL)
    opts = SamplingOptions(num_frames=3)
    guard_s = 60.0
    with DecordDecoder(DecordConfig(timeout_s=10 * guard_s)) as dec:
        dec.decode(data, opts)  # the child is up, in its request loop
        assert dec._proc is not None
        child = psutil.Process(dec._proc.pid)
        child.suspend()  # the next decode hangs in it
        outcome: list = []

        def decode() -> None:
            try:
                outcome.append(dec.decode(data, opts))
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                outcome.append(exc)

        decoding = threading.Thread(target=decode)
        decoding.start()
        try:
            deadline = time.monotonic() + guard_s
            while not dec._lock.locked():  # the decode holds the child
                assert time.monotonic() < deadline, "the decode never reached the child"
                time.sleep(0.01)
            closing = threading.Thread(target=dec.close, args=(0.2,))
            closing.start()
            closing.join(guard_s)
            assert not closing.is_alive(), "close waited for the decode running in the child"
            decoding.join(guard_s)
            assert not decoding.is_alive()
        finally:
            if child.is_running():
                child.kill()
        assert len(outcome) == 1 and isinstance(outcome[0], DecoderCrashed), outcome
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def _without_frame_size(mp4: bytes) -> bytes:
    """`mp4` (H.264) with its sample entry's width and height 0 and its decoder configuration
    (the SPS, which also gives the size) zeroed: FFmpeg opens it, and its video stream has no size."""
    data = bytearray(mp4)
    entry = data.find(b"avc1")
    size_at = entry + 4 + 6 + 2 + 16  # after reserved bytes, the data reference index, pre-defined
    data[size_at : size_at + 4] = bytes(4)
    config = data.find(b"avcC")
    data[config + 4 : config + 40] = bytes(36)
    return bytes(data)


def test_a_video_without_a_frame_size_is_invalid_argument_not_an_internal_error(
    video_factory, decord_decoder
):
    """Found by the media fuzz (test_media_fuzz.py): the shared buffer for the frames is sized by
    the header's frame size, and a header of none made a 0-byte one, a ValueError (INTERNAL)."""
    data = _without_frame_size(
        video_factory(".mov", codec="h264", size=(48, 32), fps=10.0, seconds=1.2, gop=5)
    )
    with pytest.raises(MediaError) as info:
        decord_decoder.decode(data, SamplingOptions(num_frames=2))
    assert status_of(info.value) == (grpc.StatusCode.INVALID_ARGUMENT, simple_decoder.CORRUPT_MEDIA_MESSAGE)
    with pytest.raises(MediaError, match="could not decode the media"):  # as the PyAV backend says
        simple_decoder.decode(data, SamplingOptions(num_frames=2))
