"""Untrusted media: only allow-listed containers reach FFmpeg, nothing opens a file or URL by name,
and the work one request makes the decoder do is bounded while it decodes (issue #21)."""

from __future__ import annotations

import ast
import io
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from epd.video import budget, simple_decoder
from epd.video.decord_backend import DecordDecoder
from epd.video.keyframe_index import KeyframeIndexCache, build_video_index, content_sha256
from epd.video.media_open import _open_av, open_video, sniff_container
from epd.video.parallel_decode_config import ParallelDecodeConfig
from epd.video.parallel_decoder import ParallelDecoder
from epd.video.types import DecodeLimits, MediaError, MediaLimitError, SamplingOptions
from tests.local_http import recording_server
from tests.media import make_audio_flood, make_packet_flood, make_resolution_change, make_video, remux_mpegts
from tests.unit.video.entry_points import _entry_points

ROOT = Path(__file__).resolve().parents[3]
SECRET = "EPD-UNIT-SECRET-7f3a"
SMALL = dict(size=(96, 64), fps=10.0, seconds=3.0, gop=10)
HLS = "#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\n{}\n#EXT-X-ENDLIST\n"


@pytest.fixture()
def local_server():
    with recording_server() as server:
        yield server


@pytest.fixture()
def planted(tmp_path, monkeypatch, video_factory):
    """A secret text file and a video in the working directory, named relatively, as an attacker
    would name files beside the server (FFmpeg's playlist safe mode allows relative names)."""
    (tmp_path / "secret.txt").write_text((SECRET + "\n") * 40)
    (tmp_path / "local.mp4").write_bytes(video_factory(".mp4", codec="h264", **SMALL))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _payloads(port: int) -> dict[str, bytes]:
    return {
        "ffconcat_text": b"ffconcat version 1.0\nfile secret.txt\n",
        "ffconcat_video": b"ffconcat version 1.0\nfile local.mp4\nfile local.mp4\n",
        "hls_local": HLS.format("local.mp4").encode(),
        "hls_http": HLS.format(f"http://127.0.0.1:{port}/segment.ts").encode(),
        "tty_text": (SECRET + "\n").encode() * 40,
        "image2_pattern": b"img-%03d.png",
        "subfile": b"subfile,,start,0,end,0,,:secret.txt",
        "concat_protocol": b"concat:local.mp4|local.mp4",
        "data_uri": b"data:video/mp4;base64,AAAA",
    }


@pytest.mark.parametrize(
    "kind", ["ffconcat_text", "ffconcat_video", "hls_local", "hls_http", "tty_text", "image2_pattern",
             "subfile", "concat_protocol", "data_uri"],
)  # fmt: skip
def test_names_in_the_bytes_are_refused_by_every_entry_point(planted, local_server, decoder, kind):
    data = _payloads(local_server.port)[kind]
    for name, entry in _entry_points(decoder).items():
        with pytest.raises(MediaError, match="unsupported container") as info:
            entry(data)
        text = str(info.value)
        assert SECRET not in text and str(planted) not in text and "secret.txt" not in text, (name, text)
        assert "send MP4/MOV, Matroska/WebM, AVI or MPEG-TS video" in text
    with DecordDecoder() as dec:  # refused before decord (or its child process) sees a byte
        with pytest.raises(MediaError, match="unsupported container"):
            dec.decode(data, SamplingOptions(num_frames=2))
        assert dec._proc is None
    assert local_server.seen == []


def test_the_payloads_are_live_without_the_guard(planted, local_server):
    """What the old `av.open(io.BytesIO(data))` did with them: the checks above can fail."""
    import av

    payloads = _payloads(local_server.port)
    with av.open(io.BytesIO(payloads["ffconcat_video"])) as container:  # probed: concat
        assert sum(1 for _ in container.decode(video=0)) == 60  # local.mp4, twice
    with av.open(io.BytesIO(payloads["hls_local"]), format="hls") as container:
        assert sum(1 for _ in container.decode(video=0)) == 30
    with pytest.raises(av.FFmpegError):
        av.open(io.BytesIO(payloads["hls_http"]), format="hls")  # 404, but it asked
    assert local_server.seen == ["/segment.ts"]


@pytest.mark.parametrize(
    "kind,demuxer", [("ffconcat_video", "concat"), ("hls_local", "hls"), ("hls_http", "hls")]
)
def test_whitelists_refuse_nested_opens_even_with_the_playlist_demuxer(planted, local_server, kind, demuxer):
    """Defence in depth: the options open_video passes stop a demuxer that opens things by name
    (an MP4 data reference would be one) from opening a local file or a URL. Both whitelists
    count: without protocol_whitelist the HLS demuxer fetches the URL; without format_whitelist
    the nested demuxer of a local file is any FFmpeg has."""
    import av

    data = _payloads(local_server.port)[kind]
    try:
        with _open_av(data, demuxer, DecodeLimits()) as container:
            num_packets = sum(1 for _ in container.demux())
    except av.FFmpegError:
        num_packets = 0
    assert num_packets == 0
    assert local_server.seen == []


def test_sniffing_allows_only_the_listed_containers(video_factory):
    from PIL import Image

    assert sniff_container(video_factory(".mp4", codec="h264", **SMALL)).demuxer == "mp4"
    assert sniff_container(video_factory(".mov", codec="h264", **SMALL)).demuxer == "mp4"
    assert sniff_container(video_factory(".mkv", codec="h264", **SMALL)).demuxer == "matroska"
    assert sniff_container(video_factory(".webm", codec="vp9", **SMALL)).demuxer == "matroska"
    assert sniff_container(video_factory(".avi", codec="mjpeg", **SMALL)).demuxer == "avi"
    ts = remux_mpegts(video_factory(".mp4", codec="h264", **SMALL))
    assert sniff_container(ts).demuxer == "mpegts"
    m2ts = b"".join(b"\0\0\0\0" + ts[i : i + 188] for i in range(0, len(ts), 188))  # 192-byte packets
    assert sniff_container(m2ts).demuxer == "mpegts"
    for fmt, name in (("JPEG", "jpeg"), ("PNG", "png"), ("WEBP", "webp")):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, format=fmt)
        assert sniff_container(buf.getvalue()).name == name
        assert sniff_container(buf.getvalue()).is_image
    for fmt in ("GIF", "BMP", "TIFF"):  # Pillow reads these; this server does not
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, format=fmt)
        with pytest.raises(MediaError, match="unsupported container"):
            simple_decoder.decode(buf.getvalue(), SamplingOptions())
    for junk in (b"G" * 100, b"\x00" * 5000, b"#EXTM3U\n", b"RIFF\0\0\0\0WAVEfmt "):
        with pytest.raises(MediaError, match="unsupported container"):
            sniff_container(junk)


def test_mpegts_decodes_like_mp4(video_factory, decoder):
    data = remux_mpegts(video_factory(".mp4", codec="h264", **SMALL))
    opts = SamplingOptions(num_frames=5)
    expected = simple_decoder.decode(data, opts)
    assert expected.frames.shape == (5, 64, 96, 3)
    assert np.array_equal(decoder.decode(data, opts).frames, expected.frames)


def test_no_other_av_open_reads_bytes():
    """Every read of media goes through epd.video.media_open; only write-mode av.open remains."""
    offenders = []
    tops = [
        p
        for p in ROOT.iterdir()
        if p.is_dir() and not p.name.startswith(".") and p.name not in ("tests", "build")
    ]
    # resolve(): epd/video etc. are symlinks to the top-level folders; read each file once.
    files = {p.resolve() for p in ROOT.glob("*.py")} | {
        p.resolve() for top in tops for p in top.rglob("*.py")
    }
    for path in sorted(f for f in files if f.is_relative_to(ROOT)):
        rel = path.relative_to(ROOT)
        if rel == Path("video/media_open.py") or "site-packages" in rel.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(rel))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "av"
                and any(a.name == "open" for a in node.names)
            ):
                offenders.append(f"{rel}:{node.lineno} imports av.open")
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "open"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "av"):  # fmt: skip
                continue
            mode = (
                node.args[1]
                if len(node.args) > 1
                else next((k.value for k in node.keywords if k.arg == "mode"), None)
            )
            if not (
                isinstance(mode, ast.Constant) and isinstance(mode.value, str) and mode.value.startswith("w")
            ):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == [], f"open untrusted media with epd.video.media_open.open_video: {offenders}"


# -- frames: decoded once, repeated by reference ----------------------------------------------


def test_one_frame_1080p_asked_for_256_frames_stays_small(tmp_path):
    """7-50 KB of H.264 that decodes to one 1920x1080 frame. Before, the output held 256 copies
    (~1.6 GB); now the decoder holds the one frame and each group is a copy of its 2 slots."""
    data = Path(make_video(tmp_path / "one.mp4", size=(1920, 1080), fps=1.0, seconds=1.0, gop=1)).read_bytes()
    reference = simple_decoder.decode(data, SamplingOptions(num_frames=1)).frames[0]  # [H, W, 3]
    frame_bytes = reference.nbytes  # ~6 MB
    with ParallelDecoder(ParallelDecodeConfig(num_workers=2)) as dec:
        tracemalloc.start()
        try:
            with dec.iter_groups(data, SamplingOptions(num_frames=256), group_size=2) as stream:
                assert stream.num_frames == 256
                num_frames = 0
                for group in stream:
                    assert group.frames.shape == (2, 1080, 1920, 3)
                    assert all(np.array_equal(f, reference) for f in group.frames)
                    num_frames += len(group.frames)
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert num_frames == 256
    assert stream.stats["num_decoded_frames"] == 1
    assert peak_bytes < 8 * frame_bytes, f"peak {peak_bytes / 2**20:.0f} MiB"  # was 256 frames


def test_repeated_frames_match_the_reference_in_groups_and_whole(video_factory, decoder):
    data = video_factory(".mp4", codec="h264", size=(96, 64), fps=10.0, seconds=0.3, gop=10)  # 3 frames
    opts = SamplingOptions(num_frames=8)
    expected = simple_decoder.decode(data, opts)
    assert len({f.tobytes() for f in expected.frames}) == 3
    with decoder.iter_groups(data, opts, group_size=2) as stream:
        groups = list(stream)
    assert np.array_equal(np.concatenate([g.frames for g in groups]), expected.frames)
    got = decoder.decode(data, opts)
    assert np.array_equal(got.frames, expected.frames) and got.timestamps_s == expected.timestamps_s


def test_groups_without_repeats_are_views_of_one_output(video_factory, decoder):
    data = video_factory(".mp4", codec="h264", **SMALL)
    with decoder.iter_groups(data, SamplingOptions(num_frames=6), group_size=2) as stream:
        groups = list(stream)
        whole = stream.result()
    assert all(np.shares_memory(g.frames, whole.frames) for g in groups)


# -- the frame size, on every decoded frame ---------------------------------------------------


@pytest.mark.parametrize(
    "second_size,refused_by_ffmpeg",
    [((1024, 1024), True), ((160, 160), False)],
    ids=["over-ffmpeg-guard", "between-limit-and-guard"],
)
def test_resolution_growing_mid_stream_is_refused_on_every_path(
    tmp_path, monkeypatch, second_size, refused_by_ffmpeg
):
    """Header and first 20 frames 64x48, the last 4 bigger. Limit 128x128: FFmpeg's guard (twice
    the limit) refuses 1024x1024 before allocating it; 160x160 decodes and the per-frame check
    refuses it before conversion."""
    from epd.video import budget

    data = make_resolution_change(tmp_path / "grow.ts", [(64, 48), second_size], [20, 4]).read_bytes()
    limits = DecodeLimits(max_source_pixels=128 * 128)
    assert build_video_index(data, limits).width == 64  # the header passes
    seen_sizes = set()
    real_charge = budget.DecodeBudget.charge

    def charge(self, frame):
        seen_sizes.add((frame.width, frame.height))
        return real_charge(self, frame)

    monkeypatch.setattr(budget.DecodeBudget, "charge", charge)
    opts = SamplingOptions(num_frames=6)  # the last targets are in the big part
    with ParallelDecoder(ParallelDecodeConfig(num_workers=2)) as dec:
        for entry in (
            lambda: simple_decoder.decode(data, opts, limits),
            lambda: dec.decode(data, opts, limits),
            lambda: list(dec.iter_groups(data, opts, limits, group_size=2)),
        ):
            with pytest.raises(MediaLimitError, match=r"is \d+x\d+, over this server's limit of 16384 pixels per frame"
                                                      r" \(encoder flag --max-source-pixels\)"):  # fmt: skip
                entry()
    assert (second_size in seen_sizes) is not refused_by_ffmpeg


def test_a_resolution_change_is_refused_where_the_frame_resize_would_hide_it(tmp_path):
    """Frames of two sizes that a resize makes one size (LLaVA-OneVision's fixed square always
    does; Qwen's bounds often do) are still the stream the reference decoder refuses (np.stack of
    unequal frames): the parallel decoder compares its frames as decoded, not as resized."""
    data = make_resolution_change(tmp_path / "change.ts", [(64, 48), (96, 64)], [20, 4]).read_bytes()
    opts = SamplingOptions(num_frames=6)  # the last targets are in the 96x64 part

    def to_square(clip_num_frames: int):
        return lambda rgb: np.zeros((16, 16, 3), np.uint8)  # [H, W, 3] -> [16, 16, 3]

    with pytest.raises(MediaError, match="could not decode the media"):
        simple_decoder.decode(data, opts)
    with ParallelDecoder(ParallelDecodeConfig(num_workers=2)) as dec:
        with pytest.raises(MediaError, match="could not decode the media"):
            with dec.iter_groups(data, opts, group_size=2, frame_resizer=to_square) as stream:
                list(stream)
        assert dec.decode(data, SamplingOptions(num_frames=2, end_time_s=1.0)).frames.shape == (2, 48, 64, 3)


def test_ffmpeg_max_pixels_guard_is_set_on_the_decoder(video_factory):
    data = video_factory(".mp4", codec="h264", **SMALL)
    with open_video(data, DecodeLimits(max_source_pixels=1000)) as container:
        assert container.streams.video[0].codec_context.options == {"max_pixels": "2000"}
        import av

        with pytest.raises(av.FFmpegError):  # 96x64 is over the guard: the decoder will not open
            next(container.decode(video=0))


# -- budgets of work ---------------------------------------------------------------------------


def test_packet_flood_stops_at_the_demux_time_limit(decoder):
    data = make_packet_flood(20_000)
    assert build_video_index(data).num_frames == 20_000  # a valid file, only long to demux
    limits = DecodeLimits(max_demux_s=0.001)
    match = r"limit of 0.001 s \(encoder flag --max-demux-s\)"
    with pytest.raises(MediaLimitError, match=match):
        build_video_index(data, limits)
    with pytest.raises(MediaLimitError, match=match):
        simple_decoder.decode(data, SamplingOptions(num_frames=2), limits)
    with pytest.raises(MediaLimitError, match=match):
        decoder.iter_groups(data, SamplingOptions(num_frames=2), limits)


AUDIO_FLOOD_PACKETS = 30_000
"""Tiny audio packets between the 2 video frames of `make_audio_flood`: ~240 KB, ~8 reads of
32 KiB, every one of them inside av.open's probe and inside one step of a video-only demux loop."""


def test_cancel_is_seen_between_packets_of_other_streams():
    """The demux pass asked the stop callback (the request's cancel flag, or "this file's index is
    cached after all") only every 256 video packets: here it asked once, at the first, and read
    the whole file. Now FFmpeg's every read of the file asks first (`ReadGuard`)."""
    data = make_audio_flood(AUDIO_FLOOD_PACKETS)
    assert build_video_index(data).num_frames == 2  # a valid file
    num_calls = 0

    def stop_at_second_call() -> bool:
        nonlocal num_calls
        num_calls += 1
        return num_calls >= 2

    with pytest.raises(simple_decoder.DemuxStopped):
        build_video_index(data, stop=stop_at_second_call)
    assert num_calls == 2  # stopped where it was told to, not at the end of the file


def test_demux_deadline_is_checked_between_packets_of_other_streams(monkeypatch, decoder):
    """A clock that moves 1 s each time it is read: with --max-demux-s 3, the pass must be refused
    at the first check past 3 s. It was checked at the first video packet only, and the index of
    this file was built, however long its audio took to read."""
    data = make_audio_flood(AUDIO_FLOOD_PACKETS)
    limits = DecodeLimits(max_demux_s=3.0)
    match = r"limit of 3 s \(encoder flag --max-demux-s\)"
    for demux in (
        lambda: build_video_index(data, limits),
        lambda: simple_decoder.decode(data, SamplingOptions(num_frames=2), limits),
        lambda: decoder.iter_groups(data, SamplingOptions(num_frames=2), limits),
    ):
        num_reads = 0

        def one_second_per_read() -> float:
            nonlocal num_reads
            num_reads += 1
            return float(num_reads)

        monkeypatch.setattr(budget, "time", SimpleNamespace(monotonic=one_second_per_read))
        with pytest.raises(MediaLimitError, match=match):
            demux()
        # Read at the start (deadline = 1 + 3 s, and the decode budget's start), then once per check.
        assert num_reads <= 6


def test_decode_workers_check_the_time_limit_between_packets_of_other_streams(monkeypatch, decoder):
    """A parallel worker opens the file again (av.open's probe reads all of it here) and reads the
    audio between the two frames inside one demux call. It looked at --max-decode-s only at each
    decoded frame: 2 looks, and the request was served however long the reads took. With a clock
    moving 1 s per look and a 3 s limit, it is now refused at its reads."""
    data = make_audio_flood(AUDIO_FLOOD_PACKETS)
    sha256 = content_sha256(data)
    decoder.index_cache.get_or_build(data, DecodeLimits(), sha256)  # indexed on the real clock
    start_s = time.monotonic()
    num_looks = 0

    def one_second_per_look() -> float:
        nonlocal num_looks
        num_looks += 1
        return start_s + num_looks

    monkeypatch.setattr(budget, "time", SimpleNamespace(monotonic=one_second_per_look))
    with pytest.raises(MediaLimitError, match=r"limit of 3 s \(encoder flag --max-decode-s\)"):
        decoder.decode(data, SamplingOptions(num_frames=2), DecodeLimits(max_decode_s=3.0), sha256=sha256)
    assert num_looks <= 10  # both workers, refused within a few looks past the limit


def test_decoded_pixel_budget_counts_every_decoded_frame(video_factory, decoder):
    data = video_factory(".mp4", codec="h264", **SMALL)  # 96x64: each frame is charged 256x256
    opts = SamplingOptions(num_frames=3)
    full = simple_decoder.decode(data, opts)
    # The last target is frame 25: the reference decodes 26 frames, targets or not.
    assert full.stats["num_decoded_frames"] >= 26
    assert full.stats["num_decoded_pixels"] == full.stats["num_decoded_frames"] * 65536
    limits = DecodeLimits(max_decoded_pixels=10 * 65536)
    match = r"limit of 655360 decoded pixels .*\(.*encoder flag --max-decoded-pixels\)"
    with pytest.raises(MediaLimitError, match=match):
        simple_decoder.decode(data, opts, limits)
    with ParallelDecoder(ParallelDecodeConfig(num_workers=1, skip_nonref_frames=False)) as dec:
        with pytest.raises(MediaLimitError, match=match):
            dec.decode(data, opts, limits)
        # Within budget, the pool reports what it charged.
        got = dec.decode(data, opts)
    assert got.stats["num_decoded_pixels"] == got.stats["num_decoded_frames"] * 65536


def test_decode_wall_time_limit_stops_every_decode_path(video_factory, decoder):
    """--max-decode-s: a limit any decode exceeds (1 ns) refuses the request in the simple and
    the parallel decoder alike, naming the flag; the same decoder then serves within the default."""
    data = video_factory(".mp4", codec="h264", **SMALL)
    opts = SamplingOptions(num_frames=3)
    limits = DecodeLimits(max_decode_s=1e-9)
    match = r"took longer than this server's limit of 1e-09 s \(encoder flag --max-decode-s\)"
    with pytest.raises(MediaLimitError, match=match):
        simple_decoder.decode(data, opts, limits)
    with ParallelDecoder(ParallelDecodeConfig(num_workers=2)) as dec:
        with pytest.raises(MediaLimitError, match=match):
            dec.decode(data, opts, limits)
        assert dec.decode(data, opts).frames.shape[0] == 3  # within the default limit
    with pytest.raises(ValueError, match="max_decode_s must be > 0"):
        DecodeLimits(max_decode_s=0)


def test_index_cache_is_bounded_in_bytes(video_factory):
    datas = [
        video_factory(".mp4", codec="h264", size=(96, 64), fps=10.0, seconds=s, gop=10)
        for s in (1.0, 2.0, 3.0)
    ]
    sizes = [build_video_index(d).num_bytes for d in datas]
    cache = KeyframeIndexCache(max_entries=100, max_bytes=sizes[1] + sizes[2])
    for d in datas:
        cache.get_or_build(d, DecodeLimits())
    assert cache.num_bytes == sizes[1] + sizes[2] <= cache.max_bytes
    assert len(cache._entries) == 2  # the least recently used (the first) was evicted
    cache.get_or_build(datas[1], DecodeLimits())  # a hit: now most recently used
    cache.get_or_build(datas[0], DecodeLimits())  # evicts datas[2], the least recently used
    assert cache.num_hits == 1 and cache.num_bytes == sizes[0] + sizes[1]
    tiny = KeyframeIndexCache(max_bytes=sizes[0] - 1)
    index = tiny.get_or_build(datas[0], DecodeLimits())  # too large to keep: used, not cached
    assert index.num_frames == 10 and tiny.num_bytes == 0 and not tiny._entries


def _png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height and holds almost no data: Pillow reads the size from IHDR."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 100))
        + chunk(b"IEND", b"")
    )


def test_image_over_the_pixel_limit_is_refused_before_decoding():
    with pytest.raises(
        MediaLimitError, match=r"5000x5000, over this server's limit of 8294400 pixels .*--max-source-pixels"
    ):
        simple_decoder.decode(_png_header(5000, 5000), SamplingOptions())
    with pytest.raises(MediaLimitError, match="over this server's limit .*--max-source-pixels"):
        simple_decoder.decode(_png_header(20000, 20000), SamplingOptions())  # Pillow's bomb check


def test_cli_flags_reach_the_encoder_config():
    from epd.cli.configs import encoder_config
    from epd.cli.parsers.root import build_parser

    args = build_parser().parse_args(["serve", "encoder", "--max-source-pixels", "1000000", "--max-decoded-pixels",
                                      "123456789", "--max-demux-s", "2.5", "--index-cache-bytes", "4096",
                                      "--max-decode-s", "7.5"])  # fmt: skip
    config = encoder_config(args)
    assert config.limits.max_source_pixels == 1_000_000
    assert config.limits.max_decoded_pixels == 123_456_789
    assert config.limits.max_demux_s == 2.5
    assert config.limits.max_decode_s == 7.5
    assert config.decode.index_cache_bytes == 4096
    defaults = encoder_config(build_parser().parse_args(["serve", "encoder"]))
    assert defaults.limits == DecodeLimits() and defaults.decode.index_cache_bytes == 64 << 20


# -- what the bytes declare: codecs FFmpeg cannot decode, sample tables, compressed headers, scans


def _mp4_with_sample_count(data: bytes, box: bytes, count: int) -> bytes:
    """`data` with its first `box` (stsz: constant sample size 1; trun) declaring `count` samples,
    in place: the box keeps its size, so no parent box changes. FFmpeg sizes its index by it."""
    out = bytearray(data)
    payload = out.index(box) + 4  # after the type: version/flags first
    if box == b"stsz":
        out[payload + 4 : payload + 8] = (1).to_bytes(4, "big")  # one constant size: no table to read
        out[payload + 8 : payload + 12] = count.to_bytes(4, "big")
    else:
        out[payload + 4 : payload + 8] = count.to_bytes(4, "big")
    return bytes(out)


def _fragmented(data: bytes) -> bytes:
    """`data` remuxed as fragmented MP4 (moof/traf/trun per keyframe), as a live stream writes it."""
    import av

    out = io.BytesIO()
    with (
        open_video(data) as src,
        av.open(out, "w", format="mp4", options={"movflags": "frag_keyframe+empty_moov"}) as dst,
    ):
        stream = dst.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                dst.mux(packet)
    return out.getvalue()


def test_sample_tables_that_declare_millions_of_samples_are_refused_before_ffmpeg_reads_them(
    video_factory, decoder
):
    """A 2 KB file declaring 60 million samples made FFmpeg's demuxer allocate 3 GB inside av.open
    (run-length coded tables cost no bytes per sample); a fragmented file does it with a track run.
    Refused by every entry point, before FFmpeg allocates; the same files as they were still decode."""
    from epd.video.mp4_boxes import MAX_DECLARED_SAMPLES

    plain = video_factory(".mp4", codec="h264", **SMALL)
    fragmented = _fragmented(plain)
    assert b"trun" in fragmented
    for data, box in ((plain, b"stsz"), (fragmented, b"trun")):
        assert simple_decoder.decode(data, SamplingOptions(num_frames=2)).frames.shape[0] == 2
        bomb = _mp4_with_sample_count(data, box, MAX_DECLARED_SAMPLES + 1)
        for entry in _entry_points(decoder).values():
            with pytest.raises(
                MediaLimitError,
                match=rf"declare \d+ frames and audio packets, over this "
                rf"server's limit of {MAX_DECLARED_SAMPLES}",
            ):
                entry(bomb)


def test_a_compressed_movie_header_is_refused(video_factory, decoder):
    """QuickTime's cmov is inflated into a buffer of the size it declares; no current file has one."""
    data = video_factory(".mp4", codec="h264", **SMALL).replace(b"mvhd", b"cmov", 1)
    for entry in _entry_points(decoder).values():
        with pytest.raises(
            MediaError, match=r"compressed movie headers \(QuickTime cmov\) are not supported"
        ):
            entry(data)


@pytest.mark.parametrize(
    ("suffix", "name", "unknown"),
    [(".mp4", b"avc1", b"zzz1"), (".mkv", b"V_MPEG4/ISO/AVC", b"V_ZZZZZ/ISO/ZZZ")],
)
def test_a_codec_ffmpeg_cannot_decode_is_invalid_argument_not_an_internal_error(
    video_factory, decoder, suffix, name, unknown
):
    """FFmpeg opens the stream with no decoder (codec_context None); it was an AttributeError, HTTP 500."""
    data = video_factory(suffix, codec="h264", **SMALL).replace(name, unknown)
    for entry_name, entry in _entry_points(decoder).items():
        if entry_name == "probe_rotation":
            continue  # reads the display matrix only, no decoder
        with pytest.raises(MediaError, match="the video's codec is not one this server decodes; send H.264"):
            entry(data)


def _jpeg(img, **save) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", **save)
    return out.getvalue()


def test_a_jpeg_of_thousands_of_scans_is_refused_before_pillow_decodes_it(decoder):
    """Each scan of a progressive JPEG refines the whole image in one uninterruptible libjpeg call:
    30,000 tiny scans (631 KB) took 25 s of CPU past every deadline. A progressive JPEG as encoders
    write it (about ten scans) decodes."""
    from PIL import Image

    from epd.video.media_open import MAX_JPEG_SCANS

    progressive = _jpeg(Image.new("RGB", (64, 48), (200, 30, 30)), progressive=True)
    assert 1 < progressive.count(b"\xff\xda") < 20
    assert simple_decoder.decode(progressive, SamplingOptions()).frames.shape == (1, 48, 64, 3)
    scan = b"\xff\xda\x00\x08\x01\x01\x00\x01\x3f\x00" + b"\x00" * 20  # an AC refinement scan header + data
    bomb = progressive[:-2] + scan * MAX_JPEG_SCANS + progressive[-2:]
    entries = {
        "simple": lambda d: simple_decoder.decode(d, SamplingOptions()),
        "parallel": lambda d: list(decoder.iter_groups(d, SamplingOptions(), group_size=2)),
    }
    num_scans = bomb.count(b"\xff\xda")
    for entry in entries.values():
        with pytest.raises(
            MediaLimitError,
            match=f"the JPEG has {num_scans} scans, over this server's limit of {MAX_JPEG_SCANS}",
        ):
            entry(bomb)


def test_a_16_bit_greyscale_png_is_scaled_to_8_bits_as_ffmpeg_does_not_clipped_to_white():
    from PIL import Image

    levels = np.array([[0, 1000, 32768, 65535]], dtype=np.uint16).repeat(4, axis=0)  # [4, 4]
    out = io.BytesIO()
    Image.fromarray(levels).save(out, "PNG")
    frame = simple_decoder.decode(out.getvalue(), SamplingOptions()).frames[0]  # [4, 4, 3]
    assert frame[0, :, 0].tolist() == [0, 3, 128, 255]  # the top byte: 1000 >> 8 = 3
    assert (frame == frame[..., :1]).all()  # grey


def test_an_image_is_turned_upright_as_its_exif_orientation_says():
    """As a video's display matrix turns its frames: a photo taken upright on its side."""
    from PIL import Image

    img = Image.new("RGB", (80, 40), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 10, 40))  # a red band on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: show it turned 90 degrees clockwise
    frame = simple_decoder.decode(_jpeg(img, exif=exif, quality=95), SamplingOptions()).frames[0]
    assert frame.shape == (80, 40, 3)
    assert frame[2, 20, 0] > 200 and frame[-3, 20, 2] > 200  # the left band now on top
