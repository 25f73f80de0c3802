"""Make small real video files for tests and benchmarks, with PyAV's own FFmpeg encoders.

    make_video(path, codec="h264", container=None, size=(96, 64), fps=10.0, seconds=2.0,
               gop=10, pattern="moving") -> Path

`codec` is a short name (h264, hevc, vp9, av1, mpeg4, mjpeg) or an FFmpeg encoder name; the
container comes from the path's suffix (.mp4 .mkv .webm .mov .avi) unless given. Every frame is
different (a moving block plus the frame number drawn as bars) so a wrong frame is caught.
Use `encoder_available(codec)` to skip a test where this FFmpeg lacks an encoder.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from pathlib import Path

import numpy as np

# Short name -> FFmpeg encoder tried in order.
_ENCODERS = {
    "h264": ("libx264",),
    "hevc": ("libx265",),
    "vp9": ("libvpx-vp9",),
    "av1": ("libsvtav1", "libaom-av1", "librav1e"),
    "mpeg4": ("mpeg4",),
    "mjpeg": ("mjpeg",),
}
X264_SAME_BYTES = "mbtree=0"
"""The x264 setting under which the same frames make the same clip every time. x264's macroblock
tree (on under CRF, its default rate control) reads some of its heap memory before writing it, in
its AVX-512 code (capped at AVX2, `asm=avx2`, it does not): with glibc's MALLOC_PERTURB_ set to 0, 1,
85 or 170 one clip came out four different ways (frames 3-19 of the first GOP differed), and in a
long test session, whose heap holds what earlier tests left, now and then a different one, with
different test references (tests/unit/video/test_media_clips.py). Without the tree every value
gives the same clip. Constant-QP encodes (`epd.synth.render`) and the ultrafast preset have none."""
X265_MIN_WIDTH = 64
"""The narrowest frame `make_video` encodes with libx265. libx265 4.2 (PyAV 18.1's wheels) writes past
a heap block in its lookahead on narrow frames: 16 of 20 single encodes at 40x24 aborted (glibc's
"corrupted size vs. prev_size" or "free(): invalid next size"), at widths 34-48 whatever the height,
preset, CTU size or thread pools; only rc-lookahead=0 with bframes=0 (no B-frames, which the tests
of non-reference frames need) avoided it. The abort comes at a later free(), often after
`make_video` has returned, which made it look random. Widths up to 32 and from 50 up encoded
cleanly, also under glibc's malloc checks (MALLOC_CHECK_=3), 64 with a margin; the tests' HEVC clips
are 96 wide."""
_CONTAINER_FORMATS = {".mp4": "mp4", ".mkv": "matroska", ".webm": "webm", ".mov": "mov", ".avi": "avi"}


def encoder_name(codec: str) -> str | None:
    """The FFmpeg encoder this build has for `codec`, or None."""
    import av

    for name in _ENCODERS.get(codec, (codec,)):
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:  # av.codec.codec.UnknownCodecError; type varies across PyAV versions
            continue
    return None


def encoder_available(codec: str) -> bool:
    return encoder_name(codec) is not None


@functools.lru_cache(maxsize=8)
def _texture(width: int, height: int, seed: int) -> np.ndarray:
    """The "texture" pattern's random texture (the same for every frame of a clip): made once per
    clip instead of once per frame, which was a third of the time to make a long 640x480 clip.
    Read-only: frames are copies cut from it."""
    rng = np.random.default_rng(seed)
    tex = rng.integers(0, 256, size=(height // 8 + 2, width // 8 + 2, 3), dtype=np.uint8)
    tex = tex.repeat(8, 0).repeat(8, 1)
    tex.flags.writeable = False
    return tex


@functools.lru_cache(maxsize=8)
def _ramps(width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """The "moving" pattern's horizontal and vertical ramps ([1, W] and [H, 1], 0..255), which every
    frame shifts: made once per size instead of an [H, W] grid per frame (at 720p that grid was
    most of the time to make a clip). Read-only."""
    ramp_x = np.arange(width)[None, :] * 255 // max(width - 1, 1)
    ramp_y = np.arange(height)[:, None] * 255 // max(height - 1, 1)
    ramp_x.flags.writeable = False
    ramp_y.flags.writeable = False
    return ramp_x, ramp_y


def frame_pattern(i: int, width: int, height: int, pattern: str = "moving", seed: int = 0) -> np.ndarray:
    """Frame `i` as [H, W, 3] uint8 RGB. "moving": smooth, cheap to decode; "texture": a fixed
    random texture panning 2 px per frame (camera-like bitrate and decode cost); "noise": new noise
    every frame (worst case); "solid": one colour, every frame the same (static content: a huge
    resolution or hours of it compress to a tiny file, for the work-limit tests); "number": `i` in
    binary as 8 full-height black/white stripes on grey, which `read_frame_number` reads back after
    lossy coding (tests that check which frame came back for a timestamp)."""
    if pattern == "number":
        img = np.full((height, width, 3), 128, np.uint8)
        stripe_w = width // 8
        for bit in range(8):
            img[:, bit * stripe_w : (bit + 1) * stripe_w] = 255 if (i >> bit) & 1 else 0
        return img
    if pattern == "solid":
        return np.full((height, width, 3), (200, 40, 40), np.uint8)
    if pattern == "texture":
        tex = _texture(width, height, seed)
        shift = (2 * i) % 8
        img = np.roll(tex, shift=(i // 4 * 8 % (tex.shape[0]), (i // 4) * 8 % tex.shape[1]), axis=(0, 1))
        img = np.ascontiguousarray(img[shift : shift + height, shift : shift + width])
        _draw_frame_number(img, i)
        return img
    if pattern == "noise":
        rng = np.random.default_rng(seed * 1_000_003 + i)
        base = rng.integers(0, 256, size=(height // 4 + 1, width // 4 + 1, 3), dtype=np.uint8)
        return np.ascontiguousarray(base.repeat(4, 0).repeat(4, 1)[:height, :width])
    ramp_x, ramp_y = _ramps(width, height)
    img = np.empty((height, width, 3), np.uint8)
    img[..., 0] = (ramp_x + 7 * i) % 256
    img[..., 1] = (ramp_y + 3 * i) % 256
    img[..., 2] = (40 * seed) % 256
    side = max(4, min(width, height) // 4)
    bx = (i * 3) % max(width - side, 1)
    by = (i * 2) % max(height - side, 1)
    img[by : by + side, bx : bx + side] = (255, 255, 255)
    _draw_frame_number(img, i)
    return img


def read_frame_number(rgb: np.ndarray) -> int:
    """The number a frame of pattern "number" shows ([H, W, 3] RGB at its encoded size): the
    middle of each stripe, so coding noise at the stripe edges does not matter."""
    stripe_w = rgb.shape[1] // 8
    margin = stripe_w // 4
    return sum(
        1 << bit
        for bit in range(8)
        if rgb[:, bit * stripe_w + margin : (bit + 1) * stripe_w - margin].mean() > 128
    )


def _draw_frame_number(img: np.ndarray, i: int) -> None:
    """The frame number in binary as 8 bars along the bottom, so every frame is distinct."""
    height, width = img.shape[:2]
    bar_w = max(1, width // 8)
    for bit in range(8):
        if (i >> bit) & 1:
            img[height - max(2, height // 8) :, bit * bar_w : (bit + 1) * bar_w] = (0, 0, 0)


def make_video(
    path: str | Path,
    codec: str = "h264",
    container: str | None = None,
    size: tuple[int, int] = (96, 64),
    fps: float = 10.0,
    seconds: float = 2.0,
    gop: int = 10,
    pattern: str = "moving",
    *,
    pix_fmt: str | None = None,
    rotation_deg: int = 0,
    bframes: int | None = None,
    vfr: bool = False,
    single_slice: bool = True,
    crf: int | None = None,
    open_gop: bool = False,
) -> Path:
    """Encode a synthetic video and return its path.

    size: (width, height). gop: frames between keyframes. rotation_deg: display-matrix rotation
    (counter-clockwise, as PyAV reports it). vfr: frame durations alternate 1x/2x/3x the nominal
    period (timestamps only; the encoder sees a fixed rate). single_slice: one slice per frame
    for x264 (camera files usually have one; PyAV's default slice threading writes several).
    """
    import os

    import av

    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner to stderr otherwise
    path = Path(path)
    enc = encoder_name(codec)
    if enc is None:
        raise RuntimeError(f"this FFmpeg has no encoder for {codec}")
    fmt = container or _CONTAINER_FORMATS[path.suffix.lower()]
    width, height = size
    num_frames = max(1, int(round(seconds * fps)))
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), mode="w", format=fmt) as out:
        options: dict[str, str] = {}
        if enc == "libx264":
            params = f"keyint={gop}:min-keyint={gop}:scenecut=0:{X264_SAME_BYTES}"
            if bframes is not None:
                params += f":bframes={bframes}"
            if open_gop:  # keyframes are I frames that B-frames after them in decode order precede
                params += ":open-gop=1"
            options = {"x264-params": params, "preset": "veryfast", "crf": str(crf or 23)}
        elif enc == "libx265":
            if width < X265_MIN_WIDTH:
                raise ValueError(
                    f"libx265 corrupts its heap on frames {width} px wide: make HEVC clips at least "
                    f"{X265_MIN_WIDTH} px wide (tests.media.X265_MIN_WIDTH)"
                )
            params = f"keyint={gop}:min-keyint={gop}:scenecut=0:log-level=none"
            if bframes is not None:
                params += f":bframes={bframes}"
            options = {"x265-params": params, "preset": "ultrafast"}
        elif enc == "libvpx-vp9":
            options = {"cpu-used": "8"}
        elif enc == "libsvtav1":
            options = {"preset": "12", "svtav1-params": f"keyint={gop}"}
        stream = out.add_stream(enc, rate=rate, options=options)
        stream.width, stream.height = width, height
        stream.pix_fmt = pix_fmt or ("yuvj420p" if enc == "mjpeg" else "yuv420p")
        stream.codec_context.gop_size = gop
        if enc == "libx264" and single_slice:
            stream.codec_context.thread_type = "FRAME"
        if enc == "libx264":
            stream.codec_context.thread_count = 1  # one encoder thread (same bytes need X264_SAME_BYTES too)
        if enc in ("mpeg4",):
            stream.codec_context.max_b_frames = bframes or 0
        if rotation_deg:
            stream.set_display_rotation(rotation_deg)
        # Frame pts are in the encoder's time base; 1/(1000*fps) units keep VFR durations exact.
        # (Don't set frame.time_base: the muxer changes stream.time_base when it writes the header.)
        stream.codec_context.time_base = Fraction(1, 1000) / rate if vfr else 1 / rate
        pts = 0
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(frame_pattern(i, width, height, pattern), format="rgb24")
            frame = frame.reformat(format=stream.pix_fmt)
            frame.pts = pts
            pts += 1000 * (1 + i % 3) if vfr else 1
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def make_resolution_change(
    path: str | Path, sizes: list[tuple[int, int]], counts: list[int], fps: float = 10.0
) -> Path:
    """An MPEG-TS H.264 stream whose resolution changes in-band: `counts[i]` frames of
    `sizes[i]` (width, height), one encoder per size, muxed as one stream. FFmpeg's probe reports
    the first size when enough frames come before the change (about 10 or more), so only a check
    on every decoded frame sees the later ones."""
    from fractions import Fraction

    import av

    path = Path(path)
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), mode="w", format="mpegts") as out:
        stream = out.add_stream("libx264", rate=rate, options={"preset": "ultrafast"})
        stream.width, stream.height = sizes[0]
        stream.pix_fmt = "yuv420p"
        offset = 0
        for part, ((width, height), count) in enumerate(zip(sizes, counts)):
            if part == 0:
                enc = stream.codec_context
            else:  # a fresh encoder: new SPS/PPS with the new size, in the same stream
                enc = av.CodecContext.create("libx264", "w")
                enc.width, enc.height, enc.pix_fmt = width, height, "yuv420p"
                enc.time_base, enc.framerate = 1 / rate, rate
                enc.options = {"preset": "ultrafast"}
            for i in range(count + 1):
                frame = None
                if i < count:
                    frame = av.VideoFrame.from_ndarray(
                        frame_pattern(offset + i, width, height), format="rgb24"
                    )
                    frame = frame.reformat(format="yuv420p")
                    frame.pts = offset + i if part == 0 else i
                    frame.time_base = 1 / rate
                for packet in enc.encode(frame):
                    if part:
                        packet.stream, packet.time_base = stream, 1 / rate
                        packet.pts += offset
                        packet.dts += offset
                    out.mux(packet)
            offset += count
    return path


def _tiny_idr_frame(stream) -> bytes:
    """One 16x16 H.264 IDR frame (14 bytes, without x264's SEI) from `stream`'s encoder, which
    this sets to 16x16; the frames it encodes are not muxed."""
    import av

    stream.width = stream.height = 16
    stream.pix_fmt = "yuv420p"
    frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24").reformat(
        format="yuv420p"
    )
    packets = []
    for i in range(3):
        frame.pts = i
        packets += list(stream.encode(frame))
    packets += list(stream.encode(None))
    return bytes(packets[-1])


def _mux_keyframe(out, stream, payload: bytes, pts_ms: int) -> None:
    import av

    packet = av.Packet(payload)
    packet.pts = packet.dts = pts_ms
    packet.time_base = Fraction(1, 1000)
    packet.is_keyframe = True
    packet.stream = stream
    out.mux(packet)


def make_packet_flood(num_packets: int) -> bytes:
    """Matroska holding one 14-byte 16x16 H.264 frame `num_packets` times at 1000 fps: a valid
    file that is only long to demux (about 25 bytes a packet)."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        stream = out.add_stream(
            "libx264", rate=1000, options={"x264-params": "keyint=1", "preset": "ultrafast"}
        )
        payload = _tiny_idr_frame(stream)
        for i in range(num_packets):
            _mux_keyframe(out, stream, payload, pts_ms=i)
    return buf.getvalue()


def cut_with_edit_list(data: bytes, fps: float, first_kept: int, first_shown: int) -> bytes:
    """What `ffmpeg -ss T -c copy -f mp4` makes of `data` (a constant-rate video at `fps`): the
    packets of frames from `first_kept` on (a keyframe), with frame `first_shown` presented at 0;
    the frames before it get negative pts, which the MP4 muxer writes as an edit list, and the
    demuxer reads back as packets flagged discard."""
    import io

    import av

    out_buf = io.BytesIO()
    with av.open(io.BytesIO(data)) as inp, av.open(out_buf, "w", format="mp4") as out:
        src = inp.streams.video[0]
        dst = out.add_stream_from_template(src)
        frame_units = round(1 / (fps * src.time_base))  # pts units per frame
        start = inp.start_time or 0  # x264 B-frames: MKV's first pts may be above 0
        first_pts = round(start / 1_000_000 / src.time_base)
        for packet in inp.demux(src):
            if packet.size == 0 or packet.pts is None:
                continue
            if (packet.pts - first_pts) // frame_units < first_kept:
                continue
            shift = first_pts + first_shown * frame_units
            packet.pts -= shift
            packet.dts -= shift
            packet.stream = dst
            out.mux(packet)
    return out_buf.getvalue()


def remux_mpegts(mp4: bytes) -> bytes:
    """The video packets of `mp4` remuxed into MPEG-TS."""
    import io

    import av

    from epd.video.media_open import open_video

    out_buf = io.BytesIO()
    with open_video(mp4) as src, av.open(out_buf, "w", format="mpegts") as out:
        in_stream = src.streams.video[0]
        stream = out.add_stream_from_template(in_stream)
        for packet in src.demux(in_stream):
            if packet.size:
                packet.stream = stream
                out.mux(packet)
    return out_buf.getvalue()


def drop_first_packets(data: bytes, num_packets: int, container: str) -> bytes:
    """`data` remuxed into `container` without its first `num_packets` packets (decode order): a
    stream cut mid-GOP, whose first frames reference frames that are not there."""
    import io

    import av

    out_buf = io.BytesIO()
    with av.open(io.BytesIO(data)) as inp, av.open(out_buf, "w", format=container) as out:
        src = inp.streams.video[0]
        dst = out.add_stream_from_template(src)
        for position, packet in enumerate(p for p in inp.demux(src) if p.size):
            if position >= num_packets:
                packet.stream = dst
                out.mux(packet)
    return out_buf.getvalue()


def make_audio_flood(num_audio_packets: int) -> bytes:
    """Matroska holding two 16x16 H.264 frames with `num_audio_packets` 2-byte PCM packets between
    them (about 8 bytes a packet): a demux loop that asks for the video stream sees two packets,
    while FFmpeg reads every audio packet between them inside one call."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        video = out.add_stream("libx264", rate=10, options={"x264-params": "keyint=1", "preset": "ultrafast"})
        payload = _tiny_idr_frame(video)
        audio = out.add_stream("pcm_s16le", rate=48000)
        audio.layout = "mono"
        _mux_keyframe(out, video, payload, pts_ms=0)
        for i in range(num_audio_packets):
            packet = av.Packet(b"\0\0")
            packet.pts = packet.dts = i
            packet.time_base = Fraction(1, 48000)
            packet.stream = audio
            out.mux(packet)
        _mux_keyframe(out, video, payload, pts_ms=num_audio_packets * 1000 // 48000)
    return buf.getvalue()
