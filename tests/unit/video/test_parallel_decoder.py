"""The parallel decoder returns exactly what the sequential reference decoder returns."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from epd.video import simple_decoder
from epd.video.types import DecodeCancelled, DecodeLimits, SamplingOptions

# (codec, container suffix): every container and codec of the issue, as far as FFmpeg muxes them.
COMBOS = [
    ("h264", ".mp4"),
    ("h264", ".mkv"),
    ("h264", ".mov"),
    ("h264", ".avi"),
    ("hevc", ".mp4"),
    ("hevc", ".mkv"),
    ("vp9", ".webm"),
    ("vp9", ".mp4"),
    ("av1", ".mp4"),
    ("av1", ".webm"),
    ("av1", ".mkv"),
    ("mpeg4", ".avi"),
    ("mpeg4", ".mp4"),
    ("mjpeg", ".avi"),
    ("mjpeg", ".mov"),
]
# 3 s at 10 fps, a keyframe every 10 frames: 3 GOPs, so the plan has several intervals.
SMALL = dict(size=(96, 64), fps=10.0, seconds=3.0, gop=10)


def assert_same(expected, got) -> None:
    assert got.frames.shape == expected.frames.shape
    assert got.frames.dtype == np.uint8
    assert np.array_equal(got.frames, expected.frames)
    assert got.timestamps_s == expected.timestamps_s
    assert got.sampled_fps == pytest.approx(expected.sampled_fps)
    assert got.duration_s == pytest.approx(expected.duration_s)
    assert got.source_fps == pytest.approx(expected.source_fps)


@pytest.mark.parametrize("codec,suffix", COMBOS, ids=[f"{c}{s}" for c, s in COMBOS])
def test_frames_identical_to_reference(video_factory, decoder, codec, suffix):
    data = video_factory(suffix, codec=codec, **SMALL)
    for opts in (
        SamplingOptions(num_frames=6),
        SamplingOptions(fps=2.0, max_frames=8),
        SamplingOptions(num_frames=5, start_time_s=0.7, end_time_s=2.6),
    ):
        got = decoder.decode(data, opts)
        assert_same(simple_decoder.decode(data, opts), got)
        # The targets span 3 GOPs; mjpeg (all keyframes) gets one interval per distinct target.
        # H.264 with B-frames in AVI (decode-order pts) is one sequential decode: test_presented_frames.
        assert got.stats["num_intervals"] >= 2 or (codec, suffix) == ("h264", ".avi")


def test_iter_groups_yields_time_ordered_groups_with_metadata_first(video_factory, decoder):
    data = video_factory(".mkv", codec="h264", **SMALL)
    opts = SamplingOptions(num_frames=7)
    expected = simple_decoder.decode(data, opts)
    with decoder.iter_groups(data, opts, group_size=2) as stream:
        # Known before any frame is decoded, so the encoder can size its work up front.
        assert stream.num_frames == 7
        assert stream.timestamps_s == expected.timestamps_s
        assert stream.sampled_fps == pytest.approx(expected.sampled_fps)
        groups = list(stream)
    assert [g.first_index for g in groups] == [0, 2, 4, 6]
    assert [len(g.timestamps_s) for g in groups] == [2, 2, 2, 1]
    assert np.array_equal(np.concatenate([g.frames for g in groups]), expected.frames)
    assert sum((g.timestamps_s for g in groups), []) == expected.timestamps_s
    assert stream.stats["num_decoded_frames"] > 0


FRAME_PIXELS = SMALL["size"][0] * SMALL["size"][1]


@pytest.mark.parametrize(
    "merge_up_to, max_pixels, sizes",
    [
        (0, 1 << 62, [2, 2, 2, 2, 2, 1]),
        (8, 1 << 62, [8, 3]),
        (4, 1 << 62, [4, 4, 3]),
        (3, 1 << 62, [2, 2, 2, 2, 3]),
        (8, 5 * FRAME_PIXELS, [4, 4, 3]),
        (8, FRAME_PIXELS, [2, 2, 2, 2, 2, 1]),
    ],
)
def test_iter_groups_merges_the_groups_already_decoded(
    video_factory, decoder, merge_up_to, max_pixels, sizes
):
    """With `merge_up_to`, a group takes the next whole groups that are decoded when it is asked for,
    up to that many frames and `merge_up_to_pixels` pixels (whole groups only: 3 frames merge just
    the last, shorter group; room for 5 frames' pixels gives groups of 4; for 1, no merging). One
    keyframe: one interval, so every frame is decoded by the time the first group is. The frames
    are the same."""
    data = video_factory(".mp4", codec="h264", **{**SMALL, "gop": 1000})
    opts = SamplingOptions(num_frames=11)
    expected = simple_decoder.decode(data, opts)
    with decoder.iter_groups(
        data, opts, group_size=2, merge_up_to=merge_up_to, merge_up_to_pixels=max_pixels
    ) as stream:
        groups = list(stream)
    assert stream.stats["num_intervals"] == 1
    assert [len(g.timestamps_s) for g in groups] == sizes
    assert [g.first_index for g in groups] == [sum(sizes[:i]) for i in range(len(sizes))]
    assert np.array_equal(np.concatenate([g.frames for g in groups]), expected.frames)
    assert sum((g.timestamps_s for g in groups), []) == expected.timestamps_s


def test_iter_groups_closed_early_leaves_pool_usable(video_factory, decoder):
    data = video_factory(".mp4", codec="h264", **SMALL)
    stream = decoder.iter_groups(data, SamplingOptions(num_frames=8), group_size=1)
    first = next(stream)
    assert first.first_index == 0
    stream.close()
    opts = SamplingOptions(num_frames=4)
    assert_same(simple_decoder.decode(data, opts), decoder.decode(data, opts))


def test_caller_cancel_stops_the_wait_and_leaves_pool_usable(video_factory, decoder):
    """The caller's flag, set from another thread while the consumer waits, ends the wait with
    DecodeCancelled (not a MediaError: nothing is wrong with the media)."""
    data = video_factory(".mp4", codec="h264", **SMALL)
    cancel = threading.Event()
    stream = decoder.iter_groups(data, SamplingOptions(num_frames=8), group_size=1, cancel=cancel)
    assert next(stream).first_index == 0
    cancel.set()
    with pytest.raises(DecodeCancelled, match="cancelled while waiting"):
        next(stream)
    stream.close()
    opts = SamplingOptions(num_frames=4)
    assert_same(simple_decoder.decode(data, opts), decoder.decode(data, opts))


@pytest.mark.parametrize("with_hash", [True, False], ids=["sha256-given", "hashed-beside-demux"])
def test_caller_cancel_before_the_demux_pass_builds_no_index(video_factory, decoder, with_hash):
    # bytes no other test indexes
    data = video_factory(".mkv", codec="h264", size=(80, 48), fps=10.0, seconds=2.5, gop=10)
    cancel = threading.Event()
    cancel.set()
    sha256 = hashlib.sha256(data).hexdigest() if with_hash else None
    with pytest.raises(DecodeCancelled, match="demux pass"):
        decoder.iter_groups(data, SamplingOptions(num_frames=4), sha256=sha256, cancel=cancel)
    assert ("", hashlib.sha256(data).hexdigest()) not in decoder.index_cache._entries


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(codec="h264", pix_fmt="yuv420p10le"),  # 10-bit
        dict(codec="hevc", pix_fmt="yuv420p10le"),
        dict(codec="h264", pix_fmt="yuv444p", size=(95, 63)),  # odd dimensions
        dict(codec="vp9", size=(95, 63)),
        dict(codec="h264", vfr=True),  # variable frame rate
        dict(codec="h264", gop=1000),  # a single keyframe: one sequential interval
        dict(codec="h264", rotation_deg=90),
    ],
    ids=["h264-10bit", "hevc-10bit", "h264-odd", "vp9-odd", "vfr", "single-keyframe", "rotated"],
)
def test_special_streams_identical_to_reference(video_factory, decoder, kwargs):
    params = {**SMALL, **kwargs}
    suffix = ".webm" if params["codec"] == "vp9" else ".mp4"
    data = video_factory(suffix, **params)
    opts = SamplingOptions(num_frames=6)
    got = decoder.decode(data, opts)
    assert_same(simple_decoder.decode(data, opts), got)
    if kwargs.get("gop") == 1000:
        assert got.stats["num_intervals"] == 1


def test_vfr_timestamps_follow_the_stream(video_factory, decoder):
    data = video_factory(".mkv", codec="h264", vfr=True, **SMALL)
    got = decoder.decode(data, SamplingOptions(num_frames=30))
    # Frame durations cycle 0.1/0.2/0.3 s, so the chosen timestamps are not evenly spaced.
    assert len(set(np.round(np.diff(sorted(set(got.timestamps_s))), 3))) > 1


def test_rotation_metadata_is_applied(video_factory, decoder):
    plain = video_factory(".mp4", codec="h264", **SMALL)
    rotated = video_factory(".mp4", codec="h264", rotation_deg=90, **SMALL)
    opts = SamplingOptions(num_frames=4)
    upright = decoder.decode(plain, opts).frames
    turned = decoder.decode(rotated, opts).frames
    assert turned.shape == (4, 96, 64, 3)  # height and width swapped

    # Two separate lossy encodes of the same frames: equal up to coding noise (x264's output
    # varies a little with the process's earlier encodes), far from any other orientation.
    def error(k: int) -> float:
        return float(np.abs(np.rot90(upright, k=k, axes=(1, 2)).astype(int) - turned).mean())

    assert error(1) < 3.0 < error(3)


def test_downscale_identical_to_reference(video_factory, decoder):
    data = video_factory(".mp4", codec="h264", **SMALL)
    opts = SamplingOptions(num_frames=4, max_pixels=48 * 32)
    got = decoder.decode(data, opts)
    assert got.frames.shape[1:3] == (32, 48)
    assert_same(simple_decoder.decode(data, opts), got)


def test_concurrent_requests_share_the_pool(video_factory, decoder):
    from concurrent.futures import ThreadPoolExecutor

    videos = [
        video_factory(s, codec=c, **SMALL) for c, s in (("h264", ".mp4"), ("vp9", ".webm"), ("hevc", ".mkv"))
    ]
    opts = SamplingOptions(num_frames=6)
    with ThreadPoolExecutor(3) as ex:
        results = list(ex.map(lambda d: decoder.decode(d, opts), videos * 2))
    for data, got in zip(videos * 2, results):
        assert_same(simple_decoder.decode(data, opts), got)


def test_image_is_one_frame(decoder):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((20, 30, 3), 200, np.uint8)).save(buf, format="PNG")
    got = decoder.decode(buf.getvalue(), SamplingOptions())
    assert got.is_image and got.frames.shape == (1, 20, 30, 3)
    # Writable like a video's frames: transformers' processors warn on a read-only array (writing
    # into one is undefined behaviour), and Pillow's `np.asarray(image)` is read-only.
    assert got.frames.flags.writeable
    groups = list(decoder.iter_groups(buf.getvalue(), SamplingOptions(), group_size=2))
    assert len(groups) == 1 and groups[0].frames.shape == (1, 20, 30, 3)
    assert groups[0].frames.flags.writeable


def test_index_cache_hits_on_same_bytes(video_factory, decoder):
    data = video_factory(".webm", codec="vp9", **SMALL)
    before = decoder.index_cache.num_hits
    decoder.decode(data, SamplingOptions(num_frames=3))
    decoder.decode(data, SamplingOptions(num_frames=5))
    assert decoder.index_cache.num_hits >= before + 1


def test_limits_are_enforced(video_factory, decoder):
    from epd.video.types import MediaLimitError

    data = video_factory(".mp4", codec="h264", **SMALL)
    with pytest.raises(MediaLimitError, match="accepts at most 100"):
        decoder.decode(data, SamplingOptions(), DecodeLimits(max_bytes=100))
    with pytest.raises(MediaLimitError, match="over this server's limit of 2 s"):
        decoder.decode(data, SamplingOptions(), DecodeLimits(max_duration_s=2.0))
    with pytest.raises(MediaLimitError, match="pixels per frame"):
        decoder.decode(data, SamplingOptions(), DecodeLimits(max_source_pixels=64 * 64))
    with pytest.raises(MediaLimitError, match="at most 4"):
        decoder.decode(data, SamplingOptions(num_frames=8), DecodeLimits(max_frames=4))


@pytest.mark.parametrize("codec", ["h264", "hevc"])
def test_non_reference_frames_are_skipped_without_changing_any_frame(video_factory, codec):
    """Long GOPs with B-frames: most frames between targets are decoded only because they are on
    the way. Skipping the non-reference ones must leave every returned frame identical."""
    from epd.video.parallel_decode_config import ParallelDecodeConfig
    from epd.video.parallel_decoder import ParallelDecoder

    data = video_factory(".mp4", codec=codec, size=(96, 64), fps=10.0, seconds=6.0, gop=60, bframes=3)
    opts = SamplingOptions(num_frames=5)
    expected = simple_decoder.decode(data, opts)
    decoded = {}
    for skip in (False, True):
        with ParallelDecoder(ParallelDecodeConfig(num_workers=1, skip_nonref_frames=skip)) as dec:
            got = dec.decode(data, opts)
        assert_same(expected, got)
        decoded[skip] = got.stats["num_decoded_frames"]
    # One interval from the only keyframe to the last target (~54 frames); with 3 B-frames per
    # P-frame and x264's B-pyramid, 2 of every 4 frames are non-reference.
    assert decoded[True] < 0.75 * decoded[False], decoded


def test_process_pool_variant_of_the_benchmark_returns_the_reference_frames(video_factory):
    """bench/process_decoder.py (threads vs processes, issue #3) must decode what the threads do."""
    from epd.bench.process_decoder import ProcessShareDecoder

    data = video_factory(".mp4", codec="h264", size=(96, 64), fps=10.0, seconds=6.0, gop=20, bframes=3)
    dec = ProcessShareDecoder(2, seek_cost_frames=0)
    try:
        for opts in (SamplingOptions(num_frames=7), SamplingOptions(fps=2.0, max_frames=5, start_time_s=1.5)):
            assert np.array_equal(dec.decode(data, opts), simple_decoder.decode(data, opts).frames)
    finally:
        dec.close()


@pytest.mark.parametrize("kwargs", [dict(codec="h264"), dict(codec="hevc", pix_fmt="yuv420p10le")])
@pytest.mark.parametrize("max_pixels", [None, 48 * 32])
def test_frame_to_rgb_reuses_one_converter_with_pyav_own_pixels(video_factory, kwargs, max_pixels):
    """The per-thread swscale context gives exactly what PyAV's per-frame conversion gives, also
    when sizes and formats alternate between calls on one thread, and on a second thread."""
    import io
    import threading

    import av

    from epd.video.simple_decoder import frame_to_rgb, scaled_size

    small = video_factory(".mkv", size=(96, 64), fps=10.0, seconds=1.0, gop=10, **kwargs)
    other = video_factory(".mp4", codec="h264", size=(64, 48), fps=10.0, seconds=1.0, gop=10)
    with av.open(io.BytesIO(small)) as c:
        frames = list(c.decode(c.streams.video[0]))
    with av.open(io.BytesIO(other)) as c:
        others = list(c.decode(c.streams.video[0]))
    for frame, between in zip(frames, others):
        w, h = scaled_size(frame.width, frame.height, max_pixels)
        assert np.array_equal(
            frame_to_rgb(frame, max_pixels), frame.to_ndarray(format="rgb24", width=w, height=h)
        )
        frame_to_rgb(between, None)  # another size and format in between: the context re-inits
    from epd.video.simple_decoder import _reformatter

    results = []
    worker = threading.Thread(
        target=lambda: results.append((frame_to_rgb(frames[0], max_pixels), _reformatter()))
    )
    worker.start()
    worker.join()
    assert np.array_equal(results[0][0], frame_to_rgb(frames[0], max_pixels))
    assert _reformatter() is _reformatter() and results[0][1] is not _reformatter()  # one per thread


def test_a_threads_converter_starts_no_threads_of_its_own(video_factory):
    """A decode thread's converter (kept for the thread's life) converts on that thread: swscale's
    default started one thread per core for each, kept idle beside every decode worker (a pool of
    one worker a core held cores x cores of them). The process's threads, before and after a thread
    converts frames (scaled and not), while it still runs: the same."""
    import io
    import os

    import av

    from epd.video.simple_decoder import frame_to_rgb

    with av.open(
        io.BytesIO(video_factory(".mp4", codec="h264", size=(96, 64), fps=10.0, seconds=1.0, gop=10))
    ) as c:
        frames = list(c.decode(c.streams.video[0]))
    started: list[str] = []

    def convert() -> None:  # measured on the thread: its converter ends with it
        before = set(os.listdir("/proc/self/task"))
        for frame in frames[:3]:
            frame_to_rgb(frame, None)
            frame_to_rgb(frame, 48 * 32)
        started.extend(set(os.listdir("/proc/self/task")) - before)

    worker = threading.Thread(target=convert)
    worker.start()
    worker.join()
    assert started == [], f"threads started by a thread's frame conversions: {started}"


def test_frame_resize_is_applied_to_each_frame_as_it_is_decoded(video_factory, decoder):
    """With `frame_resizer`, the request's frames are stored at the size its resize returns
    ([U, 32, 48, 3] for a 96x64 clip halved), each one what the function gives for the reference
    decoder's frame; every slot, a repeated frame's too, and every group come out resized. The
    resizer is asked once, with the clip's frame count (slots, repeats included: what Qwen3-VL's
    processor sizes the clip by)."""
    data = video_factory(".mp4", **SMALL)  # 30 frames
    calls: list[tuple[int, ...]] = []
    clip_counts: list[int] = []

    def halve(rgb: np.ndarray) -> np.ndarray:  # [H, W, 3] -> [H/2, W/2, 3]
        calls.append(rgb.shape)
        return np.ascontiguousarray(rgb[::2, ::2])

    def resizer(clip_num_frames: int):
        clip_counts.append(clip_num_frames)
        return halve

    for opts in (SamplingOptions(num_frames=6), SamplingOptions(num_frames=40)):  # 40 > 30: repeats
        expected = simple_decoder.decode(data, opts).frames  # [T, 64, 96, 3]
        calls.clear()
        clip_counts.clear()
        with decoder.iter_groups(data, opts, group_size=4, frame_resizer=resizer) as stream:
            groups = [g.frames for g in stream]
        assert clip_counts == [len(expected)] == [stream.num_frames]
        assert all(g.shape[1:] == (32, 48, 3) for g in groups)
        assert np.array_equal(np.concatenate(groups), expected[:, ::2, ::2])
        assert set(calls) == {(64, 96, 3)}  # called on the decoded frames
        # once per distinct frame
        assert len(calls) == len(np.unique(expected.reshape(len(expected), -1), axis=0))


def test_running_out_of_memory_is_the_servers_limit_not_a_corrupt_file(video_factory, decoder, monkeypatch):
    """A MemoryError while decoding (numpy's, or FFmpeg's ENOMEM, av.error.MemoryError) tells the
    client to ask for fewer or smaller frames (RESOURCE_EXHAUSTED), on the parallel decoder's
    workers and the reference decoder; it used to say the file was corrupt (INVALID_ARGUMENT)."""
    import av

    from epd.video.types import MediaLimitError

    data = video_factory(".mp4", **SMALL)

    def raising(error: BaseException):
        def out_of_memory(*args: object, **kwargs: object) -> np.ndarray:
            raise error

        return out_of_memory

    for error in (MemoryError(), av.error.MemoryError(12, "Cannot allocate memory")):
        out_of_memory = raising(error)

        with pytest.raises(
            MediaLimitError, match="ran out of memory decoding this video; ask for fewer or smaller"
        ):
            with decoder.iter_groups(
                data,
                SamplingOptions(num_frames=6),
                group_size=2,
                frame_resizer=lambda clip_num_frames, resize=out_of_memory: resize,
            ) as stream:
                list(stream)
        monkeypatch.setattr(simple_decoder, "frame_to_rgb", out_of_memory)
        with pytest.raises(MediaLimitError, match="ran out of memory decoding this video"):
            simple_decoder.decode(data, SamplingOptions(num_frames=6))
        monkeypatch.undo()
    # The decoder still serves the next request.
    assert decoder.decode(data, SamplingOptions(num_frames=6)).frames.shape[0] == 6


def test_close_waits_once_for_all_stuck_workers(video_factory, monkeypatch):
    """A pool whose workers are all stuck (inside a frame's resize here) is closed within one
    `CLOSE_WAIT_S`, not one per worker: every worker is told to stop before the first join, and
    the joins share one deadline (their timeouts add up to the wait, where 5 s each added N x 5 s
    to a cut drain). The joins are recorded, not timed."""
    from epd.video import parallel_decoder
    from epd.video.parallel_decode_config import ParallelDecodeConfig
    from epd.video.parallel_decoder import DecodeWorker, ParallelDecoder

    wait_s = 0.3
    monkeypatch.setattr(parallel_decoder, "CLOSE_WAIT_S", wait_s)
    dec = ParallelDecoder(ParallelDecodeConfig(num_workers=3, seek_cost_frames=0))
    entered = threading.Semaphore(0)
    release = threading.Event()

    def stuck(rgb: np.ndarray) -> np.ndarray:
        entered.release()
        release.wait()
        return rgb

    joins: list[tuple[float, bool]] = []  # (timeout, every worker retired by then)
    workers = list(dec._workers)
    real_join = DecodeWorker.join

    def recorded_join(self, timeout=None):
        joins.append((timeout, all(w.retired.is_set() for w in workers)))
        real_join(self, timeout)

    monkeypatch.setattr(DecodeWorker, "join", recorded_join)
    stream = dec.iter_groups(
        video_factory(".mp4", **SMALL), SamplingOptions(num_frames=9), frame_resizer=lambda n: stuck
    )
    try:
        for _ in workers:  # every worker inside a resize: three shares of one GOP each
            assert entered.acquire(timeout=60)
        dec.close()
    finally:
        release.set()
        stream.close()
    assert len(joins) == len(workers) == 3
    assert all(retired for _, retired in joins), (
        "a worker was waited for before every worker was told to stop"
    )
    assert sum(timeout for timeout, _ in joins) <= wait_s * 1.5, joins
