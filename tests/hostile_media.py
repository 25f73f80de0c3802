"""Small hostile files for the untrusted-media tests, made from clips of tests/media.py by editing
their bytes (nothing large is stored in the repository).

    many_tracks_mp4(num_tracks)            one clip's track repeated: num_tracks streams
    many_tracks_mkv(num_tracks)            num_tracks tiny video tracks in Matroska
    pcm_chunk_bomb(samples_per_chunk)      MOV with video and uncompressed audio whose chunks claim
                                           samples_per_chunk samples each (indexed per chunk)
    hidden_stsz(where, num_samples)        an extra sample-size box FFmpeg honours, hidden in `udta`,
                                           `dinf` or the sample description
    edit_list(num_edits)                   a clip played num_edits times over by its edit list
    titled_video(container, title)         a clip whose title tag is the given bytes
    image_with_malformed_exif(fmt, tag)    an image rotated by EXIF whose other tag cannot be written back
"""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tests.media import make_video

# Bytes between a box's header and its first child box, for boxes that have a header of their own.
_CHILDREN_AT = {b"stsd": 8, b"avc1": 78}
BoxPath = Sequence[bytes | tuple[bytes, int]]  # box types from the top level; (type, n): its n-th


def find_box(data: bytes, path: BoxPath) -> tuple[int, int]:
    """(offset, size) of the box at `path`."""
    start, end, found = 0, len(data), (0, len(data))
    for step in path:
        kind, nth = step if isinstance(step, tuple) else (step, 0)
        pos = start
        while pos + 8 <= end:
            size, box = struct.unpack(">I4s", data[pos : pos + 8])
            if box == kind:
                if nth == 0:
                    break
                nth -= 1
            pos += size
        else:
            raise KeyError(f"{kind!r} in {path}")
        found = (pos, size)
        start, end = pos + 8 + _CHILDREN_AT.get(kind, 0), pos + size
    return found


def insert_box(data: bytes, path: BoxPath, payload: bytes) -> bytes:
    """`payload` (whole boxes) appended to the box at `path`, every enclosing box grown to hold it.
    Only for files whose `moov` follows `mdat` (no chunk offset moves)."""
    assert find_box(data, [b"mdat"])[0] < find_box(data, [b"moov"])[0]
    out = bytearray(data)
    pos, size = find_box(data, path)
    out[pos + size : pos + size] = payload
    for depth in range(1, len(path) + 1):
        parent_pos, parent_size = find_box(data, path[:depth])
        struct.pack_into(">I", out, parent_pos, parent_size + len(payload))
    return bytes(out)


def replace_box(data: bytes, path: BoxPath, new_box: bytes) -> bytes:
    """The box at `path` replaced by `new_box`, every enclosing box resized (as `insert_box`)."""
    assert find_box(data, [b"mdat"])[0] < find_box(data, [b"moov"])[0]
    pos, size = find_box(data, path)
    out = bytearray(data)
    out[pos : pos + size] = new_box
    for depth in range(1, len(path)):
        parent_pos, parent_size = find_box(data, path[:depth])
        struct.pack_into(">I", out, parent_pos, parent_size + len(new_box) - size)
    return bytes(out)


def box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I4s", 8 + len(payload), kind) + payload


def constant_stsz(num_samples: int) -> bytes:
    """A sample-size box: version/flags, one constant size (1 byte) and a count, no table."""
    return box(b"stsz", struct.pack(">III", 0, 1, num_samples))


def _clip(tmp: Path, suffix: str = ".mp4") -> bytes:
    path = make_video(tmp / f"clip{suffix}", codec="h264", size=(96, 64), fps=10.0, seconds=1.0, gop=10)
    return Path(path).read_bytes()


def many_tracks_mp4(tmp: Path, num_tracks: int) -> bytes:
    """One H.264 clip whose `trak` appears `num_tracks` times (each a stream FFmpeg probes)."""
    data = _clip(tmp)
    pos, size = find_box(data, [b"moov", b"trak"])
    return insert_box(data, [b"moov"], data[pos : pos + size] * (num_tracks - 1))


def many_tracks_mkv(num_tracks: int) -> bytes:
    """Matroska with `num_tracks` video tracks of three 16x16 frames each."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        streams = [out.add_stream("mpeg4", rate=10) for _ in range(num_tracks)]
        for stream in streams:
            stream.width = stream.height = 16
            stream.pix_fmt = "yuv420p"
        for stream in streams:
            for i in range(3):
                frame = av.VideoFrame.from_ndarray(np.full((16, 16, 3), 40 * i, np.uint8), format="rgb24")
                frame.pts = i
                out.mux(stream.encode(frame.reformat(format="yuv420p")))
            out.mux(stream.encode(None))
    return buf.getvalue()


def many_streams_ts(num_streams: int) -> bytes:
    """MPEG-TS with one MPEG-2 video stream (25 frames of 64x64) and `num_streams` - 1 MP2 audio
    streams, all declared in its PMT (which the demuxer reads as it meets it, not in a header)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mpegts") as out:
        video = out.add_stream("mpeg2video", rate=25)
        video.width = video.height = 64
        video.pix_fmt = "yuv420p"
        audio = [out.add_stream("mp2", rate=48000) for _ in range(num_streams - 1)]
        for i in range(25):
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 8 * i, np.uint8), format="rgb24")
            frame.pts = i
            out.mux(video.encode(frame))
        for stream in audio:
            silence = av.AudioFrame.from_ndarray(np.zeros((1, 1152), np.int16), format="s16", layout="mono")
            silence.sample_rate, silence.pts = 48000, 0
            out.mux(stream.encode(silence))
        for stream in [video, *audio]:
            out.mux(stream.encode(None))
    return buf.getvalue()


def pcm_mov(num_audio_packets: int = 4) -> bytes:
    """MOV with a 64x48 H.264 track (10 frames) and an 8 kHz mono s16 PCM track, which FFmpeg
    indexes per chunk (its time-to-sample table is one entry of delta 1)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mov") as out:
        video = out.add_stream("libx264", rate=10, options={"preset": "ultrafast"})
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = out.add_stream("pcm_s16le", rate=8000)
        audio.layout = "mono"
        for i in range(10):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 20 * i, np.uint8), format="rgb24")
            frame.pts = i
            out.mux(video.encode(frame.reformat(format="yuv420p")))
        out.mux(video.encode(None))
        for i in range(num_audio_packets):
            samples = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.int16), format="s16", layout="mono")
            samples.sample_rate, samples.pts = 8000, i * 1024
            out.mux(audio.encode(samples))
        out.mux(audio.encode(None))
    return buf.getvalue()


AUDIO_STBL: BoxPath = [b"moov", (b"trak", 1), b"mdia", b"minf", b"stbl"]


def pcm_chunk_bomb(samples_per_chunk: int) -> bytes:
    """`pcm_mov` whose audio sample-to-chunk table says each chunk holds `samples_per_chunk`
    samples (in place: no box changes size). Its sample-size box still declares a few samples."""
    data = bytearray(pcm_mov())
    pos, _ = find_box(data, [*AUDIO_STBL, b"stsc"])
    # stsc: version/flags(4), entry_count(4), entries of (first_chunk, samples_per_chunk, description)
    struct.pack_into(">I", data, pos + 8 + 8 + 4, samples_per_chunk)
    return bytes(data)


def hidden_stsz(tmp: Path, where: str, num_samples: int) -> bytes:
    """A clip with a second `stsz` declaring `num_samples` samples where a walk of the sample
    tables does not look: in a `udta` or `dinf` box after the track's `stbl`, or among the
    trailing boxes of its sample description (`avc1`, its `stsd` moved to the end of `stbl`).
    FFmpeg reads it after the real one, which it replaces: the track's index is sized by it."""
    data = _clip(tmp)
    minf = [b"moov", b"trak", b"mdia", b"minf"]
    if where != "sample_description":
        return insert_box(data, minf, box(where.encode(), constant_stsz(num_samples)))
    data = insert_box(data, [*minf, b"stbl", b"stsd", b"avc1"], constant_stsz(num_samples))
    stbl_pos, stbl_size = find_box(data, [*minf, b"stbl"])
    stsd_pos, stsd_size = find_box(data, [*minf, b"stbl", b"stsd"])
    stsd = data[stsd_pos : stsd_pos + stsd_size]
    children = data[stbl_pos + 8 : stbl_pos + stbl_size].replace(stsd, b"", 1) + stsd
    return data[: stbl_pos + 8] + children + data[stbl_pos + stbl_size :]


def edit_list(tmp: Path, num_edits: int) -> bytes:
    """A clip (10 frames) whose edit list plays the whole clip `num_edits` times over."""
    data = _clip(tmp)
    mvhd_pos, _ = find_box(data, [b"moov", b"mvhd"])
    # mvhd v0: header(8), version/flags(4), creation(4), modification(4), timescale(4), duration(4)
    (movie_duration,) = struct.unpack(">I", data[mvhd_pos + 24 : mvhd_pos + 28])
    edit = struct.pack(">IiI", movie_duration, 0, 1 << 16)  # duration, media_time 0, rate 1.0
    elst = box(b"elst", struct.pack(">II", 0, num_edits) + edit * num_edits)
    return replace_box(data, [b"moov", b"trak", b"edts"], box(b"edts", elst))


TITLE_MARK = b"QQQQQQQMARK"


def titled_video(container: str, title: bytes) -> bytes:
    """A 64x48 MPEG-4 Part 2 clip (10 frames) in `container` whose title tag holds `title` (the
    muxer writes a placeholder of the same length, replaced in the bytes)."""
    import av

    assert len(title) == len(TITLE_MARK)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        out.metadata["title"] = TITLE_MARK.decode()
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(10):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 20 * i, np.uint8), format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame.reformat(format="yuv420p")))
        out.mux(stream.encode(None))
    data = buf.getvalue()
    assert data.count(TITLE_MARK) == 1, container
    return data.replace(TITLE_MARK, title)


def image_with_malformed_exif(fmt: str, tag: int) -> bytes:
    """An 80x40 image (a red band on its left) stored rotated (EXIF orientation 6: show it turned
    90 degrees clockwise), whose EXIF "Make" string is renumbered as `tag`, a tag of another type:
    Pillow reads the EXIF, but writing it back (as ImageOps.exif_transpose does) raises."""
    from PIL import Image

    img = Image.new("RGB", (80, 40), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 10, 40))
    exif = Image.Exif()
    exif[0x0112] = 6
    exif[0x010F] = "cam"  # Make: ASCII
    raw = exif.tobytes()  # big-endian TIFF ("MM"): an IFD entry starts tag(2), type(2)
    make_entry = struct.pack(">HH", 0x010F, 2)
    assert raw.count(make_entry) == 1
    out = io.BytesIO()
    img.save(out, fmt, exif=raw.replace(make_entry, struct.pack(">HH", tag, 2)), quality=95)
    return out.getvalue()
