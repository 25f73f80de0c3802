"""How many streams a Matroska/WebM file declares, read from its EBML header before FFmpeg opens it.

Each track (`TrackEntry` in `Tracks`) and each attached file (`AttachedFile` in `Attachments`: fonts,
cover art) becomes a stream when FFmpeg opens the file, and `av.open` opens a decoder for every
track to probe it: many copies of a 4K video track cost tens of MB each, inside `av.open`.
`epd.video.media_open` refuses a file over its stream limit with the count read here; FFmpeg's own
`max_streams` stops anything this reader does not see (it reads only the Segment's top level and
gives up at an element of unknown size, as a live stream's clusters have).

EBML: every element is an ID (1-4 bytes, its length marked by the first 1 bit, marker kept) and a
size (1-8 bytes, likewise, marker dropped; all ones: unknown), then the payload.
"""

from __future__ import annotations

_SEGMENT = 0x18538067
_TRACKS = 0x1654AE6B
_TRACK_ENTRY = 0xAE
_ATTACHMENTS = 0x1941A469
_ATTACHED_FILE = 0x61A7
_MAX_ELEMENTS = 1 << 16
"""Elements read before giving up (FFmpeg's `max_streams` still holds): a file of tiny elements
would otherwise keep this loop busy."""


def count_matroska_streams(data: bytes) -> int:
    """Tracks and attached files the file declares (those this reader reaches)."""
    num_streams = 0
    for element_id, start, end in _elements(data, 0, len(data)):
        if element_id != _SEGMENT:
            continue
        children = _elements(data, start, end)
        for num_elements, (child_id, child_start, child_end) in enumerate(children):
            if num_elements > _MAX_ELEMENTS:
                break
            if child_id in (_TRACKS, _ATTACHMENTS):
                entries = _elements(data, child_start, child_end)
                num_streams += sum(1 for i, (entry_id, _, _) in zip(range(_MAX_ELEMENTS), entries)
                                   if entry_id in (_TRACK_ENTRY, _ATTACHED_FILE))  # fmt: skip
        break  # FFmpeg reads the first Segment only
    return num_streams


def _elements(data: bytes, start: int, end: int):
    """(id, payload start, payload end) of each element in data[start:end], up to the first
    malformed one or one of unknown size (its end is not known without parsing its payload)."""
    pos = start
    while pos < end:
        element_id, pos = _varint(data, pos, end, 4, keep_marker=True)
        if element_id is None:
            return
        size, pos = _varint(data, pos, end, 8, keep_marker=False)
        if size is None:
            return
        if size < 0:  # unknown size: runs to the end of its parent
            yield element_id, pos, end
            return
        yield element_id, pos, min(pos + size, end)
        pos += size


def _varint(data: bytes, pos: int, end: int, max_bytes: int, keep_marker: bool) -> tuple[int | None, int]:
    """An EBML variable-length integer at `pos`: (value, position after it); (None, pos) when
    malformed or cut off; value -1 for a size of all ones (unknown)."""
    if pos >= end:
        return None, pos
    first = data[pos]
    length = 8 - first.bit_length() + 1  # leading zero bits + 1
    if first == 0 or length > max_bytes or pos + length > end:
        return None, pos
    value = int.from_bytes(data[pos : pos + length], "big")
    if not keep_marker:
        value &= (1 << (7 * length)) - 1
        if value == (1 << (7 * length)) - 1:
            value = -1
    return value, pos + length
