"""What an MP4/MOV file's box tree declares before FFmpeg reads it: sample counts and compressed
headers, which FFmpeg turns into allocations without comparing them with the file.

FFmpeg's MOV demuxer builds an index entry (~24 bytes, and more per track) for every sample the
sample tables declare, inside `av.open`, before any limit of ours applies. The tables are
run-length coded: a sample-size box with one constant size and a count, a time-to-sample box
with one (count, delta) entry, one chunk of N samples. So a 2 KB file can declare 60 million
samples, and opening it took 3 GB (two at once 5.9 GB). A fragmented file does the same with a
track run (`trun`) whose samples take the defaults of their fragment. A compressed movie header
(`cmov`, old QuickTime) is inflated into a buffer of the size it declares.

`check_declared_samples` walks the boxes (the top level, and into `moov`/`trak`/`mdia`/`minf`/
`stbl` and `moof`/`traf`; `mdat` is skipped by its size, nothing is decompressed) and refuses a
file whose tracks declare more samples in all than `MAX_DECLARED_SAMPLES`, or that holds `cmov`.
Everything else (a malformed box, a box running past the end) is left for FFmpeg to refuse.
"""

from __future__ import annotations

from epd.video.types import MediaError, MediaLimitError

MAX_DECLARED_SAMPLES = 1 << 21
"""Samples (video frames and audio packets) of all tracks together: an hour of 240 fps video has
864,000 frames, an hour of 48 kHz AAC 168,750 packets. FFmpeg's index for this many is ~50 MB."""

# Boxes whose payload is more boxes, on the way to the sample tables.
_CONTAINERS = frozenset({b"moov", b"trak", b"mdia", b"minf", b"stbl", b"moof", b"traf", b"edts", b"mvex"})
# Full boxes holding a 32-bit sample count, and its offset from the start of the payload:
# stsz: version/flags(4), sample_size(4), sample_count(4); stz2: version/flags(4), reserved(3),
# field_size(1), sample_count(4); trun: version/flags(4), sample_count(4).
_SAMPLE_COUNT_OFFSET = {b"stsz": 8, b"stz2": 8, b"trun": 4}
_MAX_DEPTH = 8


def check_declared_samples(data: bytes) -> None:
    """MediaLimitError when `data` (an ISO BMFF file) declares more than MAX_DECLARED_SAMPLES
    samples; MediaError when it holds a compressed movie header."""
    total = _count(memoryview(data), 0, len(data), 0)
    if total > MAX_DECLARED_SAMPLES:
        raise MediaLimitError(
            f"the file's sample tables declare {total} frames and audio packets, over this server's limit of "
            f"{MAX_DECLARED_SAMPLES}; send a shorter video"
        )


def _count(data: memoryview, start: int, end: int, depth: int) -> int:
    """Samples declared by the boxes in data[start:end]."""
    total = 0
    pos = start
    while pos + 8 <= end:
        size = int.from_bytes(data[pos : pos + 4], "big")
        kind = bytes(data[pos + 4 : pos + 8])
        header = 8
        if size == 1:  # a 64-bit size follows the type
            if pos + 16 > end:
                break
            size = int.from_bytes(data[pos + 8 : pos + 16], "big")
            header = 16
        elif size == 0:  # to the end of the enclosing box (or file)
            size = end - pos
        if size < header:
            break  # malformed: FFmpeg's to refuse
        box_end = min(pos + size, end)
        payload = pos + header
        if kind == b"cmov":
            raise MediaError("compressed movie headers (QuickTime cmov) are not supported; send the file "
                             "re-muxed (for example with ffmpeg -c copy)")
        if kind in _CONTAINERS and depth < _MAX_DEPTH:
            total += _count(data, payload, box_end, depth + 1)
        elif (offset := _SAMPLE_COUNT_OFFSET.get(kind)) is not None and payload + offset + 4 <= box_end:
            total += int.from_bytes(data[payload + offset : payload + offset + 4], "big")
        pos += size
    return total
