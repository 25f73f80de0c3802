"""What an MP4/MOV file's box tree declares before FFmpeg reads it: tracks, sample counts and
compressed headers, which FFmpeg turns into allocations without comparing them with the file.

FFmpeg's MOV demuxer (libavformat/mov.c) builds an index entry (~24 bytes) for every sample the
sample tables declare, inside `av.open`, before any limit of ours applies. The tables are
run-length coded: a sample-size box (`stsz`) with one constant size and a count, a time-to-sample
box (`stts`) with one (count, delta) entry, one chunk of N samples. So a 2 KB file can declare 60
million samples, and opening it took 3 GB. Other ways to the same allocations:

- uncompressed audio (an `stts` of one entry with delta 1) is indexed per chunk, not per sample:
  ceil(samples_per_chunk / 1024) entries for each chunk offset in `stco`/`co64` (1/160 for GSM-like
  frames), whatever `stsz` says: 16 chunk offsets of 2^31 samples each took 768 MB in a 9 KB file;
- a fragment's track run (`trun`) adds its samples to the index; an HEVC track with sample groups
  unrolls its `ctts` and `sbgp` counts into arrays of their own; an edit list (`elst`) rebuilds
  the index once per edit, each up to the whole track: 50,000 edits of a 10-frame clip (600 KB)
  made 500,000 entries;
- FFmpeg parses a table box wherever it finds one in a box it descends into (`udta`, `dinf`,
  `meta`, a sample description's trailing boxes, ...) and applies it to the last track it opened,
  so an `stsz` hidden in `udta` replaced the real one;
- every track (`trak`) is a stream whose decoder `av.open` opens to probe it: 100 copies of a
  one-frame 4K H.264 track (80 KB) took 2 GB;
- a compressed movie header (`cmov`, old QuickTime) is inflated into a buffer of the size it
  declares.

`check_declared_samples` walks the boxes the way FFmpeg does (every box it parses as a list of
boxes; `mdat` skipped by its size; nothing decompressed) and refuses, before FFmpeg sees a byte:
a table box anywhere but in its track's `stbl` (or `edts`, or a fragment's `traf`), or one that
declares more entries than it holds, or a malformed sample-to-chunk table of a per-chunk track
(INVALID_ARGUMENT); more than `MAX_DECLARED_SAMPLES` index entries over all tracks
(RESOURCE_EXHAUSTED); any `cmov`. It returns the number of tracks, which `media_open` bounds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from epd.video.types import MediaError, MediaLimitError

MAX_DECLARED_SAMPLES = 1 << 21
"""Index entries (video frames and audio packets, or chunk pieces of uncompressed audio) of all
tracks together: an hour of 240 fps video has 864,000 frames, an hour of 48 kHz AAC 168,750
packets. FFmpeg's index for this many is ~50 MB."""

_MAX_DEPTH = 12
"""FFmpeg refuses boxes nested deeper than 10 (mov_read_default's atom_depth); the walk must reach
as deep as FFmpeg does, so it goes a little deeper and refuses past that."""
_CONTAINERS = {
    # Boxes FFmpeg parses as a list of boxes, wherever they appear (mov_read_default and the readers
    # that call it), and the bytes before their first child box.
    b"moov": 0, b"trak": 0, b"mdia": 0, b"minf": 0, b"stbl": 0, b"edts": 0, b"mvex": 0,
    b"moof": 0, b"traf": 0, b"dinf": 0, b"tref": 0, b"udta": 0, b"sinf": 0, b"schi": 0, b"ilst": 0,
    b"wave": 0, b"iprp": 0, b"ipco": 0, b"iref": 4,
}  # fmt: skip
# Table boxes and the box path they must end in: FFmpeg applies one to the last track it opened,
# wherever it finds it, so anywhere else it would replace (or add to) a real table unseen.
_STBL = (b"trak", b"mdia", b"minf", b"stbl")
_TABLE_PATHS = {
    b"stsz": (_STBL,), b"stz2": (_STBL,), b"stco": (_STBL,), b"co64": (_STBL,), b"stsc": (_STBL,),
    b"stts": (_STBL,), b"ctts": (_STBL,), b"stss": (_STBL,), b"stps": (_STBL,),
    b"sbgp": (_STBL, (b"moof", b"traf")), b"elst": ((b"trak", b"edts"),), b"trun": ((b"moof", b"traf"),),
}  # fmt: skip
_VISITED = frozenset({*_CONTAINERS, *_TABLE_PATHS, b"cmov", b"meta", b"stsd"})
_MAYBE_MOOV = (b"hoov", b"free")
_MAX_TRACKS_WALKED = 1024
"""Tracks whose boxes are read; past this many the file is refused for its tracks anyway (a
flood of empty `trak` boxes would otherwise cost a track record each)."""
_MOOV_FIRST_CHILDREN = (b"mvhd", b"cmov")
"""A `hoov` box, or a `free` one when FFmpeg finds no `moov` and reads the file again, is a `moov`
to FFmpeg when its first child is one of these (mov_read_default)."""
_HDLR = int.from_bytes(b"hdlr", "big")
_BOX_HEADER = struct.Struct(">I4s")  # size, type
_BOX_SIZE64 = struct.Struct(">Q")
_STSD_HEADER_BYTES = 8  # version/flags(4), entry_count(4)
MAX_BOXES = 1 << 20
"""Boxes walked before the file is refused: the walk is Python (1-3 us a box, and it runs at every
open of the file), and an upload of 8-byte boxes would hold tens of millions. A file with a
fragment every GOP has a few per second (~8 boxes each); one with a fragment every frame at 30 fps
(low-latency capture) 756,000 in an hour."""
_MIN_SAMPLES_PER_INDEX_ENTRY = 160
"""Per-chunk audio: FFmpeg's index has one entry per 1024 samples of a chunk, or per frame of
`samples_per_frame` >= 160 samples (GSM-like codecs): 160 is the fewest samples an entry covers."""


@dataclass(slots=True)
class _Track:
    """What one `trak` declares. A table given twice: FFmpeg keeps the last one read (having
    allocated for each); the counts here keep the larger, stts and stsc the last."""

    num_samples: int = 0  # stsz/stz2 sample_count
    stts: np.ndarray | None = None  # [E, 2] (sample_count, sample_delta)
    stsc: np.ndarray | None = None  # [E, 2] (first_chunk, samples_per_chunk)
    num_chunks: int = 0  # stco/co64 entries
    num_ctts_samples: int = 0
    num_sbgp_samples: int = 0
    num_edits: int = 0  # elst entries that are not empty (media_time != -1)


@dataclass(slots=True)
class _Walk:
    tracks: list[_Track] = field(default_factory=list)
    num_fragment_samples: int = 0  # trun sample counts, over every fragment
    num_boxes: int = 0
    num_tracks: int = 0


def check_declared_samples(data: bytes) -> int:
    """The number of tracks `data` (an ISO BMFF file) declares. MediaLimitError when its tables
    make FFmpeg index more than MAX_DECLARED_SAMPLES entries; MediaError for a table box outside
    its track's sample table, a table holding fewer entries than it declares, or a compressed
    movie header."""
    walk = _Walk()
    _walk_boxes(memoryview(data), 0, len(data), (), walk)
    total = walk.num_fragment_samples + sum(_index_entries(track) for track in walk.tracks)
    if total > MAX_DECLARED_SAMPLES:
        raise MediaLimitError(
            f"the file's sample tables declare {total} frames and audio packets, over this server's limit of "
            f"{MAX_DECLARED_SAMPLES}; send a shorter video"
        )
    return walk.num_tracks


def _index_entries(track: _Track) -> int:
    """Entries FFmpeg allocates for `track` (mov_build_index): one per sample, or for uncompressed
    audio (one stts entry of delta 1) its chunk pieces; then once again for each edit (mov_fix_index
    rebuilds the index edit by edit, each from the keyframe before its start to its end: at most
    the whole track); or more, where an HEVC track unrolls its ctts or sbgp counts."""
    entries = track.num_samples
    stts, stsc = track.stts, track.stsc
    if (
        stts is not None
        and len(stts) == 1
        and stts[0, 1] == 1
        and stsc is not None
        and len(stsc)
        and track.num_chunks
    ):
        entries = max(entries, _chunk_pieces(stsc, track.num_chunks))
    return max(entries * max(track.num_edits, 1), track.num_ctts_samples, track.num_sbgp_samples)


def _chunk_pieces(stsc: np.ndarray, num_chunks: int) -> int:
    """Index entries of a per-chunk audio track, counted as FFmpeg does: each stsc entry covers the
    chunks up to the next entry's first chunk (the last one: up to the last chunk offset). FFmpeg
    sums these in unsigned 32-bit arithmetic, where a first chunk past the chunk offsets wraps to
    any count: such a table is refused."""
    first_chunk, samples_per_chunk = stsc[:, 0], stsc[:, 1]  # [E] each
    next_first = np.append(first_chunk[1:], num_chunks + 1)  # [E]
    bad = (first_chunk < 1) | (next_first <= first_chunk) | (next_first > num_chunks + 1)
    if bad.any():
        raise MediaError(
            f"the file's sample-to-chunk table names chunk {int(first_chunk[bad.argmax()])} of a track with "
            f"{num_chunks} chunks; the file is corrupt: {_REMUX}"
        )
    pieces_per_chunk = -(-samples_per_chunk // _MIN_SAMPLES_PER_INDEX_ENTRY)  # ceil; [E]
    return int(((next_first - first_chunk) * pieces_per_chunk).sum())


_REMUX = "send it re-muxed (for example with ffmpeg -i IN -c copy OUT.mp4)"


def _walk_boxes(data: memoryview, start: int, end: int, path: tuple[bytes, ...], walk: _Walk) -> None:
    """Every box in data[start:end], whose parents are `path`; box sizes read as FFmpeg reads
    them (0: to the end of the parent; 1: a 64-bit size follows; past the parent: cut to it)."""
    if len(path) > _MAX_DEPTH:
        raise MediaError(
            f"the file's boxes are nested more than {_MAX_DEPTH} deep; the file is corrupt: {_REMUX}"
        )
    pos = start
    while pos + 8 <= end:
        walk.num_boxes += 1
        if walk.num_boxes > MAX_BOXES:
            raise MediaLimitError(f"the file's headers hold more than {MAX_BOXES} boxes, over this server's limit; "
                                  f"{_REMUX}, or send a shorter video")  # fmt: skip
        size, kind = _BOX_HEADER.unpack_from(data, pos)
        header = 8
        if size == 1 and pos + 16 <= end:  # a 64-bit size follows the type
            (size,) = _BOX_SIZE64.unpack_from(data, pos + 8)
            header = 16
        elif size == 0:  # to the end of the enclosing box (or file)
            size = end - pos
        if size < header:
            break  # malformed: FFmpeg stops reading this list of boxes too
        if kind in _MAYBE_MOOV and bytes(data[pos + header + 4 : pos + header + 8]) in _MOOV_FIRST_CHILDREN:
            kind = b"moov"
        if kind in _VISITED:  # else a leaf FFmpeg reads by itself, or skips (mdat among them)
            _visit(data, kind, pos + header, min(pos + size, end), path, walk)
        pos += size


def _visit(
    data: memoryview, kind: bytes, payload: int, end: int, path: tuple[bytes, ...], walk: _Walk
) -> None:
    """One box: kind, payload data[payload:end], parents `path`."""
    if kind == b"cmov":
        raise MediaError(f"compressed movie headers (QuickTime cmov) are not supported; {_REMUX}")
    if kind == b"trak":
        walk.num_tracks += 1
        if walk.num_tracks > _MAX_TRACKS_WALKED:
            return  # the caller refuses the file for its tracks: no need to read them all
        walk.tracks.append(_Track())
    if (skip := _CONTAINERS.get(kind)) is not None:
        _walk_boxes(data, payload + skip, end, path + (kind,), walk)
    elif kind == b"meta":  # FFmpeg looks for its `hdlr` box 4 bytes at a time (mov_read_meta)
        num_words = max(end - 8 - payload + 3, 0) // 4  # words starting before end - 8
        words = np.frombuffer(data[payload : payload + 4 * num_words], dtype=">u4")  # [num_words]
        found = np.flatnonzero(words == _HDLR)
        if len(found):
            _walk_boxes(data, payload + 4 * int(found[0]) - 4, end, path + (kind,), walk)
    elif kind == b"stsd":  # each sample description ends in boxes FFmpeg parses as any others
        _refuse_tables_in(data[payload + _STSD_HEADER_BYTES : end])
    elif (paths := _TABLE_PATHS.get(kind)) is not None:
        if not any(path[-len(p) :] == p for p in paths):
            raise MediaError(f"the file has a sample table box ({kind.decode()}) outside a track's sample table; "
                             f"{_REMUX}")  # fmt: skip
        _read_table(data, kind, payload, end, walk)


def _refuse_tables_in(data: memoryview) -> None:
    """A sample description's trailing boxes sit after a header whose size depends on the codec
    and its version: rather than parse it, look for any table box type in the bytes (in codec
    configuration bytes they would be a rare coincidence, and only refuse a file)."""
    raw = bytes(data)
    for kind in (*_TABLE_PATHS, b"cmov"):
        if kind in raw:
            raise MediaError(f"the file has a sample table box ({kind.decode()}) inside a sample description; "
                             f"{_REMUX}")  # fmt: skip


# Full boxes with an entry count at payload offset 4 (after version/flags) and fixed-size entries.
_ENTRY_BYTES = {b"stco": 4, b"co64": 8, b"stss": 4, b"stps": 4, b"stsc": 12, b"stts": 8, b"ctts": 8}


def _read_table(data: memoryview, kind: bytes, payload: int, end: int, walk: _Walk) -> None:
    """Record what a table box declares. FFmpeg allocates some tables by their declared entry
    count before reading them, so a count the box cannot hold is refused."""
    if payload + 8 > end:
        return  # too short to declare anything: FFmpeg reads nothing from it either
    if kind == b"trun":  # version/flags(4), sample_count(4); entries' fields depend on the flags
        walk.num_fragment_samples += _u32(data, payload + 4)
        return
    track = walk.tracks[-1] if walk.tracks else None
    if track is None:
        return  # FFmpeg ignores tables before the first track
    if kind == b"stsz":  # version/flags(4), sample_size(4), sample_count(4), [sizes if sample_size == 0]
        count = _u32(data, payload + 8) if payload + 12 <= end else 0
        if _u32(data, payload + 4) == 0:
            _check_holds(kind, count, 4, payload + 12, end)
        track.num_samples = max(track.num_samples, count)
    elif kind == b"stz2":  # version/flags(4), reserved(3), field_size(1), sample_count(4), sizes
        count = _u32(data, payload + 8) if payload + 12 <= end else 0
        field_bits = data[payload + 7]
        if field_bits in (4, 8, 16):
            _check_holds(kind, (count * field_bits + 7) // 8, 1, payload + 12, end)
        track.num_samples = max(track.num_samples, count)
    elif kind == b"elst":  # version/flags(4), entry_count(4), entries (duration, media_time, rate)
        if data[payload] == 1:  # 64-bit duration and media_time: [E, 5] 32-bit fields
            media_time = _entries(data, kind, payload + 4, end, 20)[:, 2:4]
        else:  # [E, 3] 32-bit fields
            media_time = _entries(data, kind, payload + 4, end, 12)[:, 1:2]
        num_empty = int((media_time == 0xFFFFFFFF).all(axis=1).sum())  # media_time -1: an empty edit
        track.num_edits = max(track.num_edits, len(media_time) - num_empty)
    elif kind == b"sbgp":  # version/flags(4), grouping_type(4), [parameter(4)], entry_count(4), entries
        first = payload + (12 if data[payload] == 1 else 8)
        entries = _entries(data, kind, first, end, 8)  # [E, 2] (sample_count, group_description_index)
        track.num_sbgp_samples = max(track.num_sbgp_samples, int(entries[:, 0].sum()))
    else:
        entries = _entries(data, kind, payload + 4, end, _ENTRY_BYTES[kind])  # [E, entry_bytes / 4]
        if kind in (b"stco", b"co64"):
            track.num_chunks = max(track.num_chunks, len(entries))
        elif kind == b"stsc":  # first_chunk, samples_per_chunk, sample_description_index
            track.stsc = entries[:, :2]
        elif kind == b"stts":  # sample_count, sample_delta
            track.stts = entries
        elif kind == b"ctts":  # sample_count, sample_offset
            track.num_ctts_samples = max(track.num_ctts_samples, int(entries[:, 0].sum()))


def _entries(data: memoryview, kind: bytes, count_at: int, end: int, entry_bytes: int) -> np.ndarray:
    """The entries of a table whose 32-bit entry count is at `count_at`, as [E, entry_bytes / 4]
    int64 (32-bit fields; a co64 offset is two)."""
    count = _u32(data, count_at) if count_at + 4 <= end else 0
    first = count_at + 4
    _check_holds(kind, count, entry_bytes, first, end)
    fields = np.frombuffer(data[first : first + count * entry_bytes], dtype=">u4")
    return fields.astype(np.int64).reshape(count, entry_bytes // 4)


def _check_holds(kind: bytes, count: int, entry_bytes: int, first: int, end: int) -> None:
    if count * entry_bytes > end - first:
        raise MediaError(
            f"the file's {kind.decode()} box declares {count} entries but holds {max(end - first, 0) // entry_bytes}; "
            f"the file is corrupt or truncated: {_REMUX}"
        )


def _u32(data: memoryview, pos: int) -> int:
    return int.from_bytes(data[pos : pos + 4], "big")
