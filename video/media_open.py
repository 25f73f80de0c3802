"""The one door for untrusted media bytes into FFmpeg (PyAV) and Pillow.

Left to probe, FFmpeg picks a demuxer from the content, and several demuxers open other things
by name: an `ffconcat` playlist opens the files it lists (relative to the server's working
directory), HLS playlists open local files and fetch URLs, a text file is rendered as video by
the `tty` demuxer, and `image2`/`subfile`/`data` name what to read. So nothing is probed here:

  1. `sniff_container` recognises the container from its first bytes and allows only MP4/MOV
     (ISO BMFF), Matroska/WebM, AVI, MPEG-TS (188- or 192-byte packets), and JPEG, PNG and WebP
     images. Anything else is refused with MediaError(UNSUPPORTED).
  2. `open_video` opens the bytes with exactly that demuxer (`format=`), with
     `format_whitelist` naming only it (for any nested open) and an empty `protocol_whitelist`,
     so the demuxer cannot open another file or URL (an MP4 data reference, a playlist entry).
     The first video stream's decoder gets FFmpeg's `max_pixels` guard, so a frame far over
     `DecodeLimits.max_source_pixels` is refused before FFmpeg allocates it. `av.open` opens a
     decoder for every stream to probe it, so the number of streams is bounded: counted in the
     MP4 box tree (`mp4_boxes`, which also bounds the sample index FFmpeg builds) and the Matroska
     header (`matroska_tracks`) before FFmpeg sees a byte, and by FFmpeg's `max_streams` for
     everything else. Metadata that is not UTF-8 is decoded with replacement characters (PyAV
     decodes tags strictly, and a Latin-1 title made the whole file "corrupt").
  3. `open_image` opens the bytes with Pillow restricted to the one sniffed format.

`open_video` can also be given a `ReadGuard`: FFmpeg reads the bytes through it, one AVIO buffer
(32 KiB) at a time, and it checks the caller's deadline and cancel flag before each read, however
many packets of whichever streams the buffer holds.

Every decode path (simple decoder, keyframe index, parallel decoder workers, rotation probe,
synth and bench readers) opens media through here, and the decord backend vets the bytes with
`sniff_container` before its child process sees them; tests/unit/video/test_untrusted_media.py
fails if another `av.open` reads bytes anywhere else.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epd.video.matroska_tracks import count_matroska_streams
from epd.video.mp4_boxes import check_declared_samples
from epd.video.types import DecodeLimits, MediaError, MediaLimitError

if TYPE_CHECKING:
    from av.container import InputContainer
    from PIL.Image import Image

SEND_SUPPORTED = "send MP4/MOV, Matroska/WebM, AVI or MPEG-TS video, or a JPEG, PNG or WebP image"
UNSUPPORTED = (
    "unsupported container: the file is corrupt, truncated, or not a supported container; " + SEND_SUPPORTED
)

# Box types FFmpeg's MOV demuxer accepts as the first box of a file (offset 4).
_ISO_BMFF_FIRST_BOXES = frozenset({b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot"})
_TS_SYNC = 0x47
_TS_PACKETS_CHECKED = 5
"""MPEG-TS: sync bytes checked at the start of this many packets (at least 3 must be present:
a playable stream needs a PAT, a PMT and a video packet)."""
_FFMPEG_MAX_PIXELS_FACTOR = 2
"""FFmpeg checks `max_pixels` against the frame with its width rounded up to its stride
alignment (up to 64), so its guard is set to twice the limit: frames between the limit and the
guard are decoded and then refused by the per-frame check (epd.video.budget), frames past the guard
are never allocated."""

MAX_STREAMS = 16
"""Streams (video, audio and subtitle tracks, attached files such as fonts) a video may have: a
phone or camera file has 1-6 (iPhone and GoPro files add timecode and metadata tracks), a film with
several languages a dozen. `av.open` opens a decoder for each to probe it: a one-frame 4K H.264
track costs ~20 MB there, so 100 copies of one (80 KB of MP4) took 2 GB, 999 would take ~20 GB;
at 16 it is ~300 MB at most, and FFmpeg allocates no 17th stream."""

_JPEG_START_OF_SCAN = b"\xff\xda"
MAX_JPEG_SCANS = 256
"""A progressive JPEG refines the whole image once per scan, and Pillow (libjpeg) decodes it in one
uninterruptible call: 30,000 scans of 20 bytes each (a 631 KB file) kept a core busy for 25 s, past
any decode deadline or cancellation. A baseline JPEG has one scan, libjpeg's progressive about ten.
Counted as SOS markers in the bytes: inside entropy-coded data a 0xFF byte is always followed by
0x00 or a restart marker, so each FF DA is a scan (or one in an embedded thumbnail, or metadata
bytes that happen to read so: an overcount only)."""


@dataclass(frozen=True)
class Container:
    """A container this server reads, as sniffed from the first bytes."""

    name: str
    """"mp4", "matroska", "avi", "mpegts", "jpeg", "png" or "webp"."""
    demuxer: str | None
    """FFmpeg demuxer to force (video), or None (image)."""
    pillow_format: str | None
    """Pillow format to restrict Image.open to (image), or None (video)."""

    @property
    def is_image(self) -> bool:
        return self.pillow_format is not None


MP4 = Container("mp4", "mp4", None)
MATROSKA = Container("matroska", "matroska", None)
AVI = Container("avi", "avi", None)
MPEGTS = Container("mpegts", "mpegts", None)
JPEG = Container("jpeg", None, "JPEG")
PNG = Container("png", None, "PNG")
WEBP = Container("webp", None, "WEBP")


def sniff_container(data: bytes) -> Container:
    """The container of `data`, from its magic bytes; MediaError(UNSUPPORTED) for any other."""
    head = data[:16]
    if head.startswith(b"\xff\xd8\xff"):
        return JPEG
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return PNG
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return WEBP
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return AVI
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML header: Matroska and WebM
        return MATROSKA
    if len(head) >= 8 and head[4:8] in _ISO_BMFF_FIRST_BOXES:
        size = int.from_bytes(head[:4], "big")
        if size in (0, 1) or size >= 8:  # 0: to the end of the file; 1: a 64-bit size follows
            return MP4
    if _is_mpegts(data, 188, 0) or _is_mpegts(data, 192, 4):  # 192: M2TS (4-byte timecode first)
        return MPEGTS
    raise MediaError(UNSUPPORTED)


def _is_mpegts(data: bytes, packet_bytes: int, offset: int) -> bool:
    num_packets = min(len(data) // packet_bytes, _TS_PACKETS_CHECKED)
    return num_packets >= 3 and all(data[offset + i * packet_bytes] == _TS_SYNC for i in range(num_packets))


class ReadGuard:
    """Stops FFmpeg between two reads of the file, whichever stream the bytes belong to.

    A decoder's demux loop sees only the packets of the stream it asks for: the demuxer skips the
    others inside one call, and av.open's probe reads on until its stream info is complete, so a
    check in that loop is blind while FFmpeg works through other streams (2 video frames around
    4 M tiny audio packets, 32 MB: 30 s in one call, 15 s of it inside av.open). FFmpeg reads the
    bytes in AVIO buffers of 32 KiB; before each read the guard calls `check`, which raises to stop
    (a deadline's MediaLimitError, a cancel). FFmpeg then sees the end of the file: PyAV does not
    pass an exception raised in its read callback on from a demux loop. So wherever such a loop
    ends, and before reporting a short or corrupt file, the caller calls `raise_if_stopped()`.
    """

    def __init__(self, check: Callable[[], None]) -> None:
        self.check = check
        """Called before every read; raises to stop. Callers may swap it between phases."""
        self.error: Exception | None = None
        """What `check` raised; from then on every read returns end of file."""

    def allow_read(self) -> bool:
        if self.error is None:
            try:
                self.check()
            except Exception as exc:  # kept for raise_if_stopped: FFmpeg cannot carry it
                self.error = exc
        return self.error is None

    def raise_if_stopped(self) -> None:
        if self.error is not None:
            raise self.error

    def release(self) -> None:
        """Drop the check and what it raised, when the caller is done with the container: PyAV
        frees a container only by the cyclic GC, and the container holds this guard, which must
        not keep the caller's request (and its decoded frames) alive until then."""
        self.check = _no_check
        self.error = None


def _no_check() -> None:
    pass


class _GuardedBytes(io.BytesIO):
    """The file as FFmpeg reads it when a `ReadGuard` is given: end of file once it stops."""

    def __init__(self, data: bytes, guard: ReadGuard) -> None:
        super().__init__(data)
        self.guard = guard

    def read(self, size: int | None = -1) -> bytes:
        return super().read(size) if self.guard.allow_read() else b""


def open_video(
    data: bytes, limits: DecodeLimits = DecodeLimits(), guard: ReadGuard | None = None
) -> InputContainer:
    """`data` opened with the demuxer its magic bytes name, and nothing else; use as a context
    manager. Raises MediaError(UNSUPPORTED) for anything but the allowed video containers; FFmpeg
    errors (a corrupt file) propagate as av.FFmpegError for the caller to map. With `guard`, every
    read FFmpeg makes, av.open's probe included, first passes its check (`ReadGuard`)."""
    container = sniff_container(data)
    if container.demuxer is None:
        raise MediaError(f"expected a video here but got a {container.name.upper()} image; {SEND_SUPPORTED}")
    if container is MP4:  # FFmpeg would allocate what the sample tables declare, inside av.open
        _check_num_streams(check_declared_samples(data))
    elif container is MATROSKA:
        _check_num_streams(count_matroska_streams(data))
    return _open_av(data, container.demuxer, limits, guard)


def _check_num_streams(num_streams: int) -> None:
    if num_streams > MAX_STREAMS:
        raise MediaLimitError(f"the file has {num_streams} tracks, over this server's limit of {MAX_STREAMS}"
                              f"{_FEWER_STREAMS}")  # fmt: skip


_FEWER_STREAMS = (
    " (video, audio and subtitle tracks and attached files together); send it with fewer tracks, for example "
    "only its video: ffmpeg -i IN -map 0:v:0 -c copy OUT.mp4"
)


def _open_av(
    data: bytes, demuxer: str, limits: DecodeLimits, guard: ReadGuard | None = None
) -> InputContainer:
    """av.open with `demuxer` forced and no nested I/O (tests call this with other demuxers to
    show the whitelists hold)."""
    import av

    max_pixels = str(limits.max_source_pixels * _FFMPEG_MAX_PIXELS_FACTOR)
    try:
        container = av.open(
            io.BytesIO(data) if guard is None else _GuardedBytes(data, guard),
            mode="r",
            format=demuxer,
            # Nested opens (a playlist entry, an MP4 data reference) may use no protocol and no
            # other demuxer. An empty protocol_whitelist refuses every protocol, file included.
            # max_streams: the demuxer gets no stream past one over the limit (it fails with ENOMEM,
            # or, where it declares streams as it meets them, as MPEG-TS does from its PMT, goes on
            # without them); one over, so that a file over the limit shows it (below).
            container_options={
                "format_whitelist": demuxer,
                "protocol_whitelist": "",
                "max_streams": str(MAX_STREAMS + 1),
            },
            # Codec options of the decoders avformat_find_stream_info opens to probe the streams.
            options={"max_pixels": max_pixels},
            # Tags are bytes in whatever encoding the muxer used; we never show them.
            metadata_errors="replace",
        )
    except Exception as exc:
        if guard is not None:
            guard.raise_if_stopped()  # the probe failed because the guard stopped it
        if isinstance(exc, av.error.MemoryError):  # ENOMEM: a stream past max_streams (or memory ran out)
            raise MediaLimitError(f"the file could not be opened within this server's limit of {MAX_STREAMS} tracks"
                                  f"{_FEWER_STREAMS}") from None  # fmt: skip
        raise
    try:
        if guard is not None:
            guard.raise_if_stopped()  # the probe saw a short file: do not go on with it
        if len(container.streams) > MAX_STREAMS:  # an MPEG-TS with 40 streams failed later, "out of memory"
            raise MediaLimitError(f"the file has more than {MAX_STREAMS} tracks, over this server's limit"
                                  f"{_FEWER_STREAMS}")  # fmt: skip
        if container.streams.video:
            stream = container.streams.video[0]
            if stream.codec_context is None:  # FFmpeg has no decoder for this codec
                raise MediaError(
                    "the video's codec is not one this server decodes; send H.264, H.265, VP8, VP9, "
                    "AV1, MPEG-2, MPEG-4 Part 2 or MJPEG video"
                )
            # The decoder the caller will use opens on its first packet, with these options.
            stream.codec_context.options = {"max_pixels": max_pixels}
    except BaseException:
        container.close()
        raise
    return container


def open_image(data: bytes, limits: DecodeLimits = DecodeLimits()) -> Image:
    """`data` opened by Pillow with only its sniffed format allowed (JPEG, PNG or WebP), size
    checked against `limits.max_source_pixels` before any pixel is decoded."""
    from PIL import Image as PILImage

    container = sniff_container(data)
    if container.pillow_format is None:
        raise MediaError(f"expected an image here but got {container.name} video; {SEND_SUPPORTED}")
    if container is JPEG and (num_scans := data.count(_JPEG_START_OF_SCAN)) > MAX_JPEG_SCANS:
        raise MediaLimitError(
            f"the JPEG has {num_scans} scans, over this server's limit of {MAX_JPEG_SCANS}; "
            "send it re-encoded (a baseline JPEG has one scan, a progressive one about ten)"
        )
    try:
        img = PILImage.open(io.BytesIO(data), formats=[container.pillow_format])
    except PILImage.DecompressionBombError:
        raise MediaLimitError(_image_too_large("", limits)) from None
    if img.width * img.height > limits.max_source_pixels:
        size = f" {img.width}x{img.height},"
        img.close()
        raise MediaLimitError(_image_too_large(size, limits))
    return img


def _image_too_large(size: str, limits: DecodeLimits) -> str:
    return (
        f"the image is{size} over this server's limit of {limits.max_source_pixels} pixels "
        "(encoder flag --max-source-pixels); send a smaller image"
    )
