"""Untrusted media: what a file declares before any frame is decoded (its tracks, sample tables,
metadata tags, EXIF) is bounded before FFmpeg allocates for it, and what is merely malformed or
oddly encoded there is read rather than turned into an internal error. The files are clips of
tests/media.py edited by tests/hostile_media.py."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from epd.video import simple_decoder
from epd.video.keyframe_index import build_video_index
from epd.video.media_open import MAX_STREAMS, _open_av
from epd.video.mp4_boxes import MAX_DECLARED_SAMPLES
from epd.video.types import DecodeLimits, MediaError, MediaLimitError, SamplingOptions
from tests import hostile_media
from tests.unit.video.entry_points import _entry_points

# -- tracks: av.open opens a decoder for each --------------------------------------------------


def test_a_file_of_more_tracks_than_the_limit_is_refused_before_ffmpeg_opens_it(tmp_path, decoder):
    """100 copies of a one-frame 4K track (80 KB) took 2 GB inside av.open. At the limit a file
    decodes; one track more is refused by every entry point, MP4 and Matroska alike, with the
    count, the limit and a way to send fewer tracks."""
    for at_limit in (
        hostile_media.many_tracks_mp4(tmp_path, MAX_STREAMS),
        hostile_media.many_tracks_mkv(MAX_STREAMS),
    ):
        assert simple_decoder.decode(at_limit, SamplingOptions(num_frames=2)).frames.shape[0] == 2
    over = MAX_STREAMS + 1
    match = rf"the file has {over} tracks, over this server's limit of {MAX_STREAMS} .* -map 0:v:0"
    for data in (hostile_media.many_tracks_mp4(tmp_path, over), hostile_media.many_tracks_mkv(over)):
        for entry in _entry_points(decoder).values():
            with pytest.raises(MediaLimitError, match=match):
                entry(data)


def test_ffmpeg_itself_creates_no_stream_past_the_limit(tmp_path):
    """For what the header walks do not count (AVI, MPEG-TS, streams made from metadata), FFmpeg's
    own max_streams stops the demuxer one stream past the limit: a file that shows that stream is
    refused as over the limit, one that fails to open for it (ENOMEM) too."""
    over = rf"the file has more than {MAX_STREAMS} tracks, over this server's limit .* -map 0:v:0"
    with pytest.raises(MediaLimitError, match=over):
        _open_av(hostile_media.many_tracks_mp4(tmp_path, MAX_STREAMS + 1), "mp4", DecodeLimits())
    with pytest.raises(MediaLimitError, match=rf"could not be opened within this server's limit of {MAX_STREAMS} "
                                              r"tracks .* -map 0:v:0"):  # fmt: skip
        _open_av(hostile_media.many_tracks_mp4(tmp_path, MAX_STREAMS + 2), "mp4", DecodeLimits())


def test_an_mpeg_ts_of_more_streams_than_the_limit_is_refused_as_such(decoder):
    """MPEG-TS declares its streams in a PMT that FFmpeg reads as it demuxes: 40 streams failed the
    demux pass with ENOMEM, answered "the server ran out of memory" (retry later, fewer frames),
    which cannot help. At the limit it decodes."""
    assert (
        simple_decoder.decode(
            hostile_media.many_streams_ts(MAX_STREAMS), SamplingOptions(num_frames=2)
        ).frames.shape[0]
        == 2
    )
    data = hostile_media.many_streams_ts(40)
    for entry in _entry_points(decoder).values():
        with pytest.raises(MediaLimitError, match=rf"more than {MAX_STREAMS} tracks, over this server's limit .* "
                                                  r"-map 0:v:0"):  # fmt: skip
            entry(data)


# -- sample tables: what FFmpeg indexes inside av.open -----------------------------------------


def test_uncompressed_audio_is_counted_by_its_chunks_as_ffmpeg_indexes_it(decoder):
    """FFmpeg indexes uncompressed audio (one stts entry of delta 1) per 1024 samples of each
    chunk, whatever stsz declares: chunks claiming 2^31 samples each took 768 MB in a 9 KB file.
    The same file with its real chunk sizes decodes."""
    plain = hostile_media.pcm_mov()
    stts_pos, _ = hostile_media.find_box(plain, [*hostile_media.AUDIO_STBL, b"stts"])
    stsz_pos, _ = hostile_media.find_box(plain, [*hostile_media.AUDIO_STBL, b"stsz"])
    # stts: header(8), version/flags(4), entry_count(4), (count, delta); stsz: ..., size(4), count(4)
    assert struct.unpack(">III", plain[stts_pos + 12 : stts_pos + 24]) == (1, 4096, 1)
    assert struct.unpack(">I", plain[stsz_pos + 16 : stsz_pos + 20]) == (4096,)  # far under the limit
    assert simple_decoder.decode(plain, SamplingOptions(num_frames=2)).frames.shape[0] == 2
    bomb = hostile_media.pcm_chunk_bomb(0x7FFFFC00)
    for entry in _entry_points(decoder).values():
        with pytest.raises(MediaLimitError, match=rf"declare \d+ frames and audio packets, over this server's limit "
                                                  rf"of {MAX_DECLARED_SAMPLES}"):  # fmt: skip
            entry(bomb)


def test_a_sample_to_chunk_table_past_the_chunks_is_refused():
    """FFmpeg sums per-chunk audio's index size in 32-bit arithmetic: a first chunk past the chunk
    offsets wraps to any size."""
    data = bytearray(hostile_media.pcm_mov())
    stsc_pos, _ = hostile_media.find_box(data, [*hostile_media.AUDIO_STBL, b"stsc"])
    struct.pack_into(">I", data, stsc_pos + 16, 9)  # the first entry's first_chunk; the track has 4
    with pytest.raises(MediaError, match="sample-to-chunk table names chunk 9 of a track with 4 chunks"):
        simple_decoder.decode(bytes(data), SamplingOptions(num_frames=2))


def test_an_edit_list_is_counted_as_often_as_ffmpeg_indexes_the_track(tmp_path, decoder):
    """FFmpeg rebuilds a track's index once per edit: 50,000 edits of a 10-frame clip (600 KB)
    made 500,000 index entries. Two edits decode; enough to pass the limit are refused."""
    assert (
        simple_decoder.decode(hostile_media.edit_list(tmp_path, 2), SamplingOptions(num_frames=2)).num_frames
        == 2
    )
    num_edits = MAX_DECLARED_SAMPLES // 10 + 1
    bomb = hostile_media.edit_list(tmp_path, num_edits)
    for entry in _entry_points(decoder).values():
        with pytest.raises(MediaLimitError, match=rf"declare {num_edits * 10} frames and audio packets"):
            entry(bomb)


@pytest.mark.parametrize("where", ["udta", "dinf", "sample_description"])
def test_a_sample_table_box_outside_its_track_is_refused(tmp_path, decoder, where):
    """FFmpeg parses an stsz wherever it finds one and applies it to the last track: hidden in
    udta, 40 million declared samples took 487 MB past a walk that only looked in stbl."""
    data = hostile_media.hidden_stsz(tmp_path, where, MAX_DECLARED_SAMPLES + 1)
    for entry in _entry_points(decoder).values():
        with pytest.raises(MediaError, match=r"sample table box \(stsz\) (outside a track's sample table|inside a "
                                             r"sample description); send it re-muxed"):  # fmt: skip
            entry(data)


def test_a_sample_table_box_in_a_box_ffmpeg_skips_is_left_alone(tmp_path):
    """The control: FFmpeg does not read inside `free`, so neither does the walk."""
    data = hostile_media.hidden_stsz(tmp_path, "free", MAX_DECLARED_SAMPLES + 1)
    assert simple_decoder.decode(data, SamplingOptions(num_frames=2)).frames.shape[0] == 2


def test_a_table_declaring_more_entries_than_it_holds_is_refused(tmp_path):
    """FFmpeg allocates a chunk-offset table by its declared count before reading it."""
    data = bytearray(hostile_media.many_tracks_mp4(tmp_path, 1))
    stco_pos, stco_size = hostile_media.find_box(data, [b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stco"])
    struct.pack_into(">I", data, stco_pos + 12, 1 << 30)  # entry_count
    with pytest.raises(MediaError, match=rf"stco box declares {1 << 30} entries but holds {(stco_size - 16) // 4}; "
                                         "the file is corrupt or truncated"):  # fmt: skip
        simple_decoder.decode(bytes(data), SamplingOptions(num_frames=2))


def test_headers_of_more_boxes_than_the_walk_reads_are_refused(tmp_path):
    """The walk is Python and runs at every open: an upload of 8-byte boxes is bounded in boxes."""
    from epd.video.mp4_boxes import MAX_BOXES

    stbl = [b"moov", b"trak", b"mdia", b"minf", b"stbl"]
    data = hostile_media.insert_box(
        hostile_media.many_tracks_mp4(tmp_path, 1), stbl, b"\0\0\0\x08free" * MAX_BOXES
    )
    with pytest.raises(MediaLimitError, match=rf"the file's headers hold more than {MAX_BOXES} boxes"):
        simple_decoder.decode(data, SamplingOptions(num_frames=2))


# -- metadata and EXIF: read, never a reason to refuse the pixels ------------------------------


@pytest.mark.parametrize("container", ["matroska", "avi", "mp4"])
def test_a_title_that_is_not_utf8_does_not_make_the_file_corrupt(decoder, container):
    """PyAV decoded tags strictly: a Latin-1 "é" in the title was a UnicodeDecodeError, and the
    file was refused as corrupt by every path."""
    utf8 = hostile_media.titled_video(container, "Café".encode().ljust(len(hostile_media.TITLE_MARK), b"_"))
    latin1 = hostile_media.titled_video(container, b"Caf\xe9".ljust(len(hostile_media.TITLE_MARK), b"_"))
    opts = SamplingOptions(num_frames=4)
    expected = simple_decoder.decode(utf8, opts).frames  # [4, 48, 64, 3]
    assert np.array_equal(simple_decoder.decode(latin1, opts).frames, expected)
    assert np.array_equal(decoder.decode(latin1, opts).frames, expected)
    assert build_video_index(latin1).num_frames == 10


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
@pytest.mark.parametrize("tag", [0x013F, 0x0145], ids=["rational-holds-text", "long-holds-text"])
def test_an_image_with_malformed_exif_is_still_turned_upright(decoder, fmt, tag):
    """ImageOps.exif_transpose rewrote the EXIF block and raised TypeError or struct.error on a
    tag of the wrong type (an internal error, HTTP 500 from /demo/frames); the orientation tag
    itself is fine, and the image is turned by it."""
    data = hostile_media.image_with_malformed_exif(fmt, tag)
    frames = {
        "simple": simple_decoder.decode(data, SamplingOptions()).frames[0],
        "parallel": decoder.decode(data, SamplingOptions()).frames[0],
    }
    for frame in frames.values():  # [80, 40, 3]: stored 80x40, shown turned 90 degrees clockwise
        assert frame.shape == (80, 40, 3)
        assert frame[2, 20, 0] > 200 and frame[-3, 20, 2] > 200  # the red left band now on top


def test_unreadable_exif_means_the_image_as_stored(monkeypatch):
    from PIL import Image

    data = hostile_media.image_with_malformed_exif("JPEG", 0x013F)

    def broken_getexif(self):
        raise struct.error("unpack requires a buffer of 4 bytes")

    monkeypatch.setattr(Image.Image, "getexif", broken_getexif)
    assert simple_decoder.decode(data, SamplingOptions()).frames.shape == (1, 40, 80, 3)


def test_any_failure_inside_pillow_is_a_media_error_without_its_text(monkeypatch):
    """Pillow raises many types on hostile bytes; each becomes INVALID_ARGUMENT with our words."""
    data = hostile_media.image_with_malformed_exif("JPEG", 0x013F)

    def failing(img):
        raise struct.error("bad char in struct format at /work/secret")

    monkeypatch.setattr(simple_decoder, "_upright_rgb", failing)
    with pytest.raises(MediaError, match="could not decode the media") as info:
        simple_decoder.decode(data, SamplingOptions())
    assert "secret" not in str(info.value) and "struct" not in str(info.value)
