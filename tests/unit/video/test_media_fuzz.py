"""Mutation fuzzing (Hypothesis) of the media path as the encoder runs it: `EncoderEngine.encode`
on bytes a client sent (the demux index pass, the plan, the parallel decode threads, the frame
resize to the model's size, preprocessing and the tiny Qwen2-VL's tower).

The inputs are real small files of every container and image format the server reads (and a GIF,
which it does not), made here with PyAV's encoders and Pillow, then mutated: bit flips, byte runs,
truncation, duplicated and removed chunks, the size fields of the container's own structure (MP4
boxes, Matroska elements, RIFF chunks, PNG chunks, JPEG segments) and any 32-bit integer set to
0 / 1 / huge / negative, and another format's header swapped in.

Each example runs with both decode backends: PyAV's decode threads (the default) and decord's
child process. Properties: `encode` returns tokens or raises an error the encoder maps to
INVALID_ARGUMENT or RESOURCE_EXHAUSTED (`epd.transport.errors.code_of`; with decord too: a file
that crashes its child is decoded by PyAV), never INTERNAL, with a message free of paths, tracebacks and
FFmpeg's own text; it returns well within its time limits (a hang fails the test); afterwards no
thread, open file or child process is left over, the decode pool has its size, and the engine
still encodes a good file.

Derandomized and small in the default suite; a long run:
EPD_MEDIA_FUZZ_EXAMPLES=20000 pytest tests/unit/video/test_media_fuzz.py (docs/security.md, "Fuzzing")."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.token_cache import TokenCacheConfig
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.stages.contracts import MediaInput
from epd.transport.errors import code_of
from epd.video.decord_backend import decord_available
from epd.video.parallel_decode_config import ParallelDecodeConfig
from epd.video.types import DecodeCancelled, DecodeLimits, DecoderCrashed, SamplingOptions
from tests.media import encoder_available, make_video, remux_mpegts

MAX_EXAMPLES = int(os.environ.get("EPD_MEDIA_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
LIMITS = DecodeLimits(max_demux_s=5.0, max_decode_s=10.0)
"""The encoder's limits, with its wall-time limits short: a file that makes the decoder work
long is refused by them within seconds."""
HANG_S = 60.0
"""A call still running this long after it started is hung: past every limit above (the demux
pass and the decode within 10 s, the tower on at most a few tiny frames)."""
DOCUMENTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
"""With either backend: decord crashes its child process on some damaged files (mostly AVI), and
the encoder decodes those with PyAV instead (`encoder_svc/engine.py`), no DecoderCrashed."""
LEAKS = re.compile(
    r"Traceback|File \"|/tmp|/work|/proc|site-packages|\.py\b|Error\(|Exception\(|\[Errno|errno|"
    r"Invalid data found|End of file|Cannot allocate|Operation not permitted|Immediate exit|Bug detected|"
    r"avcodec|avformat|libav|swscale|\bav\.|\b0x[0-9a-f]{4,}|<[a-z_.]+ object",
    re.IGNORECASE,
)
"""What a client must never see: paths, tracebacks, exception reprs, FFmpeg's error strings."""


# -- seeds: real small files of every format ----------------------------------------------------


def _with_audio(fmt: str, options: dict[str, str] | None = None) -> bytes:
    """H.264 video with an AAC audio track interleaved, as a phone writes it (`options`: the
    muxer's, e.g. a fragmented MP4)."""
    import av

    from tests.media import frame_pattern

    out = io.BytesIO()
    with av.open(out, "w", format=fmt, options=options or {}) as dst:
        video = dst.add_stream("libx264", rate=10, options={"preset": "ultrafast", "x264-params": "keyint=5"})
        video.width, video.height, video.pix_fmt = 48, 32, "yuv420p"
        audio = dst.add_stream("aac", rate=16000)
        audio.layout = "mono"
        for i in range(12):
            frame = av.VideoFrame.from_ndarray(frame_pattern(i, 48, 32), format="rgb24").reformat(
                format="yuv420p"
            )
            frame.pts = i
            dst.mux(video.encode(frame))
            samples = av.AudioFrame.from_ndarray(
                np.zeros((1, 1600), np.float32), format="fltp", layout="mono"
            )
            samples.sample_rate, samples.pts, samples.time_base = 16000, i * 1600, Fraction(1, 16000)
            dst.mux(audio.encode(samples))
        dst.mux(video.encode(None))
        dst.mux(audio.encode(None))
    return out.getvalue()


def _image(fmt: str, **save) -> bytes:
    from PIL import Image

    from tests.media import frame_pattern

    out = io.BytesIO()
    Image.fromarray(frame_pattern(3, 40, 28)).save(out, format=fmt, **save)
    return out.getvalue()


def make_seeds(root: Path) -> dict[str, bytes]:
    """name -> bytes of one small real file of each kind the fuzz starts from."""
    small = dict(size=(48, 32), fps=10.0, seconds=1.2, gop=5)
    videos = {
        "mp4_h264_bframes": (".mp4", dict(codec="h264", bframes=2)),
        "mov_h264": (".mov", dict(codec="h264")),
        "mkv_h264": (".mkv", dict(codec="h264")),
        "webm_vp9": (".webm", dict(codec="vp9")),
        "avi_mpeg4_bframes": (".avi", dict(codec="mpeg4", bframes=1)),
        "avi_mjpeg": (".avi", dict(codec="mjpeg")),
        "mp4_hevc": (".mp4", dict(codec="hevc", size=(64, 48))),
    }
    seeds: dict[str, bytes] = {}
    for name, (suffix, kwargs) in videos.items():
        if encoder_available(kwargs["codec"]):
            seeds[name] = make_video(root / f"{name}{suffix}", **{**small, **kwargs}).read_bytes()
    seeds["ts_h264"] = remux_mpegts(seeds["mov_h264"])
    seeds["mp4_h264_aac"] = _with_audio("mp4")
    seeds["mp4_fragmented"] = _with_audio("mp4", {"movflags": "frag_keyframe+empty_moov"})
    seeds["mkv_h264_aac"] = _with_audio("matroska")
    seeds["jpeg"] = _image("JPEG", quality=80)
    seeds["jpeg_progressive"] = _image("JPEG", progressive=True)
    seeds["png"] = _image("PNG")
    seeds["webp"] = _image("WEBP")
    seeds["gif"] = _image("GIF")  # not a format the server reads: refused, however mutated
    return seeds


# -- where each format keeps its size fields -----------------------------------------------------

_MP4_PARENTS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"dinf", b"udta", b"mvex", b"moof",
                b"traf", b"meta"}  # fmt: skip
_MP4_TABLES = {b"stsz", b"stco", b"co64", b"stts", b"stsc", b"ctts", b"stss", b"elst", b"trun", b"stsd"}
_EBML_PARENTS = {0x1A45DFA3, 0x18538067, 0x114D9B74, 0x1549A966, 0x1654AE6B, 0xAE, 0xE0, 0xE1, 0x1F43B675,
                 0xA0, 0x1C53BB6B, 0xBB, 0xB7, 0x1254C367, 0x7373, 0x4DBB}  # fmt: skip


@dataclass(frozen=True)
class Field:
    """An integer field of the file's structure: `width` bytes at `offset`, big-endian unless `little`."""

    offset: int
    width: int
    little: bool = False


def _mp4_fields(data: bytes, start: int = 0, end: int | None = None, depth: int = 0) -> list[Field]:
    """The 32-bit size of every box, and the entry count of every sample table."""
    end = len(data) if end is None else end
    fields, pos = [], start
    while pos + 8 <= end and depth < 8:
        size, kind = int.from_bytes(data[pos : pos + 4], "big"), data[pos + 4 : pos + 8]
        fields.append(Field(pos, 4))
        if size < 8 or pos + size > end:
            break
        body = pos + 8 + (4 if kind == b"meta" else 0)
        if kind in _MP4_PARENTS:
            fields += _mp4_fields(data, body, pos + size, depth + 1)
        elif kind in _MP4_TABLES and size >= 16:
            fields.append(Field(pos + 12, 4))  # entry count, after version and flags
        if kind == b"stsz" and size >= 20:
            fields += [Field(pos + 12, 4), Field(pos + 16, 4)]  # constant sample size, count
        pos += size
    return fields


def _ebml_vint(data: bytes, pos: int) -> tuple[int, int] | None:
    """(length, value with the marker bit cleared) of the EBML variable-size integer at `pos`."""
    if pos >= len(data) or data[pos] == 0:
        return None
    length = 8 - data[pos].bit_length() + 1
    if pos + length > len(data):
        return None
    value = int.from_bytes(data[pos : pos + length], "big") & ((1 << (7 * length)) - 1)
    return length, value


def _ebml_fields(data: bytes, start: int = 0, end: int | None = None, depth: int = 0) -> list[Field]:
    """The size of every Matroska element (a variable-size integer)."""
    end = len(data) if end is None else end
    fields, pos = [], start
    while pos < end and depth < 8 and len(fields) < 4000:
        ident = _ebml_vint(data, pos)
        if ident is None:
            break
        element = int.from_bytes(data[pos : pos + ident[0]], "big")
        size = _ebml_vint(data, pos + ident[0])
        if size is None:
            break
        fields.append(Field(pos + ident[0], size[0]))
        body = pos + ident[0] + size[0]
        unknown = size[1] == (1 << (7 * size[0])) - 1
        stop = end if unknown else min(end, body + size[1])
        if element in _EBML_PARENTS:
            fields += _ebml_fields(data, body, stop, depth + 1)
        if unknown:
            break
        pos = body + size[1]
    return fields


def _riff_fields(data: bytes) -> list[Field]:
    """Every RIFF chunk's size (AVI, WebP), LIST chunks entered."""
    fields, stack = [Field(4, 4, little=True)], [(12, len(data))]
    while stack and len(fields) < 4000:
        pos, end = stack.pop()
        while pos + 8 <= end:
            size = int.from_bytes(data[pos + 4 : pos + 8], "little")
            fields.append(Field(pos + 4, 4, little=True))
            if data[pos : pos + 4] == b"LIST" and data[pos + 8 : pos + 12] != b"movi":
                stack.append((pos + 12, min(end, pos + 8 + size)))
            pos += 8 + size + (size & 1)
    return fields


def _png_fields(data: bytes) -> list[Field]:
    """Every chunk's length, and IHDR's width and height."""
    fields, pos = [Field(16, 4), Field(20, 4)], 8
    while pos + 8 <= len(data):
        fields.append(Field(pos, 4))
        pos += 12 + int.from_bytes(data[pos : pos + 4], "big")
    return fields


def _jpeg_fields(data: bytes) -> list[Field]:
    """Every segment's length up to the first scan, and the frame header's height and width."""
    fields, pos = [], 2
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        fields.append(Field(pos + 2, 2))
        if marker in (0xC0, 0xC1, 0xC2):
            fields += [Field(pos + 5, 2), Field(pos + 7, 2)]
        if marker == 0xDA:
            break
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return fields


def structure_fields(data: bytes) -> list[Field]:
    """The size fields of `data`'s container (as parsed by its magic bytes; none for MPEG-TS and GIF)."""
    if data[4:8] in (b"ftyp", b"moov", b"mdat", b"free"):
        return _mp4_fields(data)
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return _ebml_fields(data)
    if data[:4] == b"RIFF":
        return _riff_fields(data)
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return _png_fields(data)
    if data[:2] == b"\xff\xd8":
        return _jpeg_fields(data)
    return []


# -- mutations ------------------------------------------------------------------------------------

_SPECIAL = (0, 1, 2, 7, 8, 0x7F, 0x80, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)


def _put(buf: bytearray, field: Field, value: int) -> None:
    if field.offset + field.width > len(buf):
        return
    value &= (1 << (8 * field.width)) - 1
    buf[field.offset : field.offset + field.width] = value.to_bytes(
        field.width, "little" if field.little else "big"
    )


def _ebml_size(width: int, value: int) -> int:
    """A `width`-byte EBML size of `value` (clipped; all ones is 'unknown size'), marker bit set."""
    return (1 << (7 * width)) | min(value, (1 << (7 * width)) - 1)


@st.composite
def mutation(draw, seeds: dict[str, bytes], data: bytes) -> Callable[[bytearray], bytearray]:
    """One mutation of `data` (positions drawn against its current length)."""
    n = max(len(data), 1)
    pos = draw(st.integers(0, n - 1))
    kind = draw(st.sampled_from(["flip", "run", "truncate", "duplicate", "remove", "field", "int", "swap"]))
    if kind == "flip":
        bits = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4))

        def flip(buf: bytearray) -> bytearray:
            for k, bit in enumerate(bits):
                if pos + k < len(buf):
                    buf[pos + k] ^= 1 << bit
            return buf

        return flip
    if kind == "run":
        run = draw(st.one_of(st.binary(min_size=1, max_size=64),
                             st.builds(lambda b, k: bytes([b]) * k, st.sampled_from([0, 0xFF, 0x7F, 0x80]),
                                       st.integers(1, 512))))  # fmt: skip
        return lambda buf: buf[:pos] + bytearray(run) + buf[pos + len(run) :]
    if kind == "truncate":
        return lambda buf: buf[:pos]
    if kind == "duplicate":
        length, where = draw(st.integers(1, 4096)), draw(st.integers(0, n))
        return lambda buf: buf[:where] + buf[pos : pos + length] + buf[where:]
    if kind == "remove":
        length = draw(st.integers(1, 4096))
        return lambda buf: buf[:pos] + buf[pos + length :]
    if kind in ("field", "int"):
        fields = structure_fields(data) if kind == "field" else []
        if fields:
            field = draw(st.sampled_from(fields))
        else:
            field = Field(pos, 4, little=draw(st.booleans()))
        special = draw(st.one_of(st.sampled_from(_SPECIAL), st.integers(0, 1 << 32)))
        relative = draw(st.sampled_from(["set", "+1", "-1", "x2", "len"]))

        def set_field(buf: bytearray) -> bytearray:
            if field.offset + field.width > len(buf):
                return buf
            raw = buf[field.offset : field.offset + field.width]
            old = int.from_bytes(raw, "little" if field.little else "big")
            value = {"set": special, "+1": old + 1, "-1": old - 1, "x2": old * 2, "len": len(buf)}[relative]
            if kind == "field" and data[:4] == b"\x1a\x45\xdf\xa3":  # a Matroska size keeps its length marker
                value = _ebml_size(field.width, value)
            _put(buf, field, value)
            return buf

        return set_field
    other = seeds[draw(st.sampled_from(sorted(seeds)))]
    head = draw(st.integers(4, 64))
    return lambda buf: bytearray(other[:head]) + buf[head:]  # another format's header on this body


@st.composite
def mutated_media(draw, seeds: dict[str, bytes]) -> tuple[str, bytes]:
    name = draw(st.sampled_from(sorted(seeds)))
    buf = bytearray(seeds[name])
    for _ in range(draw(st.integers(1, 4))):
        buf = draw(mutation(seeds, bytes(buf)))(buf)
    return name, bytes(buf)


sampling_options = st.one_of(
    st.builds(
        SamplingOptions, num_frames=st.integers(1, 8), max_pixels=st.sampled_from([None, 1024, 64 * 64])
    ),
    st.builds(
        SamplingOptions,
        fps=st.sampled_from([0.5, 2.0, 10.0, 30.0]),
        max_frames=st.integers(1, 8),
        min_frames=st.just(1),
        start_time_s=st.sampled_from([0.0, 0.0, 0.3, 5.0]),
        end_time_s=st.sampled_from([None, None, 0.7, 100.0]),
    ),
)


# -- the encoder under test -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, bytes]:
    return make_seeds(tmp_path_factory.mktemp("fuzz-seeds"))


@dataclass
class Encoder:
    """The encoder engine under test and the thread that calls it: long-lived, as the encoder's
    request-pool threads are (the decord child is tied to the thread that started it)."""

    engine: EncoderEngine
    driver: ThreadPoolExecutor

    def encode(self, data: bytes, sampling: SamplingOptions) -> BaseException | None:
        """What `engine.encode` raised (None: it returned tokens), failing the test if it hangs."""
        call = self.driver.submit(self.engine.encode, MediaInput(data, ""), sampling, lambda event: None)
        try:
            call.result(HANG_S)
        except FutureTimeout:
            pytest.fail(f"encode still running after {HANG_S:g} s")
        except Exception as exc:  # noqa: BLE001 - judged by the caller
            return exc
        return None


def _encoder(tiny_models, decode_backend: str) -> Encoder:
    """The encoder under test with `decode_backend`: PyAV's decode threads (the default), or
    decord in its child process (`--decode-backend decord`). Its owner closes it (`_close`)."""
    if decode_backend == "decord" and not decord_available():
        pytest.skip("decord is not installed")
    adapter = load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "encoder")
    config = EncoderConfig(
        limits=LIMITS,
        cache=TokenCacheConfig(memory_budget_bytes=0),  # every example decodes
        decode=ParallelDecodeConfig(num_workers=2, seek_cost_frames=0),  # several intervals, both threads
        decode_backend=decode_backend,
    )
    return Encoder(EncoderEngine(config, adapter), ThreadPoolExecutor(1, thread_name_prefix="fuzz-driver"))


def _close(encoder: Encoder) -> None:
    encoder.engine.close()
    encoder.driver.shutdown()


@pytest.fixture(scope="module", params=["pyav", "decord"])
def encoder(request, tiny_models):
    """The encoder with either decode backend."""
    encoder = _encoder(tiny_models, request.param)
    yield encoder
    _close(encoder)


def _allowed_children(engine: EncoderEngine) -> set[int]:
    """The decord backend's one long-lived child (a fresh one after a kill) and multiprocessing's
    resource tracker, which the first shared memory or spawned child starts, once."""
    allowed = {
        child.pid
        for child in psutil.Process().children()
        if "multiprocessing.resource_tracker" in " ".join(child.cmdline())
    }
    if engine._decord is not None and engine._decord._proc is not None:
        allowed.add(engine._decord._proc.pid)
    return allowed


@dataclass(frozen=True)
class _Before:
    """The process before an example: what must be back once it is over. Other tests of the same
    run may own processes and sockets of the pytest process meanwhile (a session's shared stack and
    its gRPC channels, which reconnect whenever they like), so those before are not the example's,
    and sockets are not counted."""

    threads: set[threading.Thread]
    num_files: int
    children: set[int]


def _num_files() -> int:
    """Open descriptors of this process but its sockets and event descriptors (gRPC's own): files,
    pipes, shared memory, what a decode that leaked would hold."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += not os.readlink(f"/proc/self/fd/{fd}").startswith(("socket:", "anon_inode:"))
    return count


def _before() -> _Before:
    return _Before(
        threads={t for t in threading.enumerate() if t.is_alive()},
        num_files=_num_files(),
        children={c.pid for c in psutil.Process().children(recursive=True)},
    )


def _settled(encoder: Encoder, before: _Before) -> str | None:
    """Why the process is not back where it was (threads, open files, child processes, the pool),
    or None. Waits a few seconds for it: a decode thread that was stopped ends at its next frame."""
    engine = encoder.engine
    why: str | None = None
    for _ in range(100):
        alive = [t for t in threading.enumerate() if t.is_alive()]
        # A decode thread replaced after a stall is a new one: the pool's size is what must hold.
        extra = [t.name for t in alive if t not in before.threads and not t.name.startswith("video-decode-")]
        allowed = before.children | _allowed_children(engine)
        children = [c for c in psutil.Process().children(recursive=True) if c.pid not in allowed]
        live = engine.decoder.num_live_workers
        files = _num_files()
        pool_ok = live == engine.config.decode.num_workers
        grew = len(alive) > len(before.threads) or files > before.num_files
        if not (extra or children or grew) and pool_ok:
            return None
        why = (
            f"threads left {extra}, {len(alive)} > {len(before.threads)}; files {files} > "
            f"{before.num_files}; children {children}; pool {live}"
        )
        time.sleep(0.05)
    return why


@FUZZ
@given(case=st.data())
def test_mutated_media_gets_tokens_or_a_documented_error(encoder, seeds, case):
    good = seeds["mp4_h264_bframes"]
    assert encoder.encode(good, SamplingOptions(num_frames=2)) is None  # the pool, driver and child up
    before = _before()
    name, data = case.draw(mutated_media(seeds), label="media")
    sampling = case.draw(sampling_options, label="sampling")
    error = encoder.encode(data, sampling)
    if error is not None:
        code = code_of(error)
        assert code in DOCUMENTED, (name, code, repr(error))
        message = str(error)
        assert message and message.isprintable() and not LEAKS.search(message), (name, message)
    assert (why := _settled(encoder, before)) is None, (name, why)
    assert encoder.encode(good, SamplingOptions(num_frames=3)) is None  # still decodes a good file


DECORD_REFUSES = {"avi_mpeg4_bframes"}
"""Seeds the decord backend refuses as sent (its frame table disagrees with the index: AVI with
B-frames; `epd.video.decord_backend`)."""


def test_every_seed_is_read_as_its_format(encoder, seeds):
    """The unmutated seeds encode (the GIF excepted: refused as unsupported): the fuzz starts from
    files the server reads, so what a mutation breaks is the mutation's."""
    for name, data in seeds.items():
        error = encoder.encode(data, SamplingOptions(num_frames=3))
        if name == "gif":
            assert error is not None and "unsupported container" in str(error)
        elif name in DECORD_REFUSES and encoder.engine.config.decode_backend == "decord":
            assert error is not None and "use the default PyAV backend" in str(error)
        else:
            assert error is None, (name, repr(error))
        assert structure_fields(data) or name in ("ts_h264", "gif"), name


# -- what the fuzz found ----------------------------------------------------------------------------


def _with_sample_size(mp4: bytes, track: int, sample: int, size: int) -> bytes:
    """`mp4` with the `stsz` entry of `sample` in the `track`-th sample table set to `size`."""
    data, at = bytearray(mp4), -1
    for _ in range(track + 1):
        at = data.index(b"stsz", at + 1)
    entry = at + 16 + 4 * sample  # after the type, version and flags, constant size and count
    data[entry : entry + 4] = size.to_bytes(4, "big")
    return bytes(data)


def test_a_sample_larger_than_the_file_is_a_corrupt_file_not_the_servers_memory(encoder, seeds):
    """A 5 KB MP4 whose audio track declares one 512 MB sample: FFmpeg's demuxer fails on it with
    ENOMEM, which the index pass answered as the server running out of memory (RESOURCE_EXHAUSTED:
    "ask for fewer or smaller frames, or retry later", neither of which helps)."""
    data = _with_sample_size(seeds["mp4_h264_aac"], track=1, sample=4, size=512 << 20)
    error = encoder.encode(data, SamplingOptions(num_frames=2))
    assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT, repr(error)
    assert "the file is corrupt, truncated" in str(error)


@pytest.mark.parametrize("size", [(1000, 4), (4, 1000)], ids=["wide", "tall"])
def test_an_image_the_models_processor_refuses_is_invalid_argument_not_internal(encoder, size):
    """Qwen's processor refuses frames of an aspect ratio over 200:1 with a ValueError, which
    reached the client as INTERNAL."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (200, 40, 40)).save(out, format="PNG")
    error = encoder.encode(out.getvalue(), SamplingOptions(num_frames=1))
    assert code_of(error) == grpc.StatusCode.INVALID_ARGUMENT, repr(error)
    assert f"{size[0]}x{size[1]}" in str(error) and "200:1" in str(error)
    assert not LEAKS.search(str(error))


def _crashes_decord(seeds: dict[str, bytes]) -> bytes:
    """A damaged AVI that crashes decord's child process every time (found by the media fuzz's
    RIFF size mutation): the MJPEG seed with its `movi` LIST chunk's size set to 1. FFmpeg's AVI
    demuxer reads on past the chunk (the PyAV backend decodes it); decord's child dies."""
    data = bytearray(seeds["avi_mjpeg"])
    size_at = data.index(b"movi") - 4  # LIST, size (4 bytes, little-endian), "movi"
    data[size_at : size_at + 4] = (1).to_bytes(4, "little")
    return bytes(data)


def _warnings(caplog) -> list[str]:
    """The WARNING (and worse) lines epd's loggers wrote while `caplog` listened."""
    return [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("epd")
    ]


@pytest.mark.parametrize("encoder", ["decord"], indirect=True)
def test_a_file_that_crashes_decords_child_gets_pyavs_answer(encoder, seeds, tiny_models, caplog):
    """decord crashes its child on some damaged files, every time: the request was answered
    DecoderCrashed (UNAVAILABLE "retry the request"), which never helps. The encoder decodes it
    with PyAV instead: the PyAV backend's answer (here its tokens), counted, and nothing left over.
    The crash is one WARNING line, which says so without decoder text (there were two: the
    backend's, with the pipe's exception, and the encoder's)."""
    data, sampling = _crashes_decord(seeds), SamplingOptions(num_frames=4)
    pyav = _encoder(tiny_models, "pyav")
    try:
        expected = pyav.driver.submit(
            pyav.engine.encode, MediaInput(data, ""), sampling, lambda e: None
        ).result()
    finally:
        _close(pyav)
    good = seeds["mp4_h264_bframes"]
    assert encoder.encode(good, SamplingOptions(num_frames=2)) is None  # the pool, driver and child up
    before = _before()
    decord, fallbacks = encoder.engine._decord, encoder.engine.num_decord_fallbacks
    assert decord is not None
    restarts = decord.num_restarts
    with caplog.at_level(logging.INFO):
        got = encoder.driver.submit(
            encoder.engine.encode, MediaInput(data, ""), sampling, lambda e: None
        ).result()
    assert decord.num_restarts == restarts + 1  # it did crash decord's child
    [warning] = _warnings(caplog)
    assert "decord child crashed" in warning and "PyAV backend instead" in warning, warning
    assert not LEAKS.search(warning), warning
    assert encoder.engine.num_decord_fallbacks == fallbacks + 1
    assert got.num_frames == expected.num_frames and got.meta.grid_thw == expected.meta.grid_thw
    assert torch.equal(got.embeds, expected.embeds)
    assert (why := _settled(encoder, before)) is None, why
    assert encoder.encode(good, SamplingOptions(num_frames=3)) is None  # decord decodes again
    assert encoder.engine.num_decord_fallbacks == fallbacks + 1


def test_a_crash_while_cancelled_or_closing_is_not_decoded_again(seeds, tiny_models):
    """After decord's child crashed: a request cancelled meanwhile stays cancelled, and while the
    encoder closes (its PyAV pool closed first) there is nothing to fall back to: DecoderCrashed,
    UNAVAILABLE. Neither is counted as decoded by PyAV."""
    data, sampling = _crashes_decord(seeds), SamplingOptions(num_frames=4)
    sha256 = hashlib.sha256(data).hexdigest()
    decord = _encoder(tiny_models, "decord")
    try:
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(DecodeCancelled):
            decord.driver.submit(decord.engine.open_frames, data, sha256, sampling, cancel).result()
        decord.engine.decoder.close()
        with pytest.raises(DecoderCrashed) as crashed:
            decord.driver.submit(decord.engine.open_frames, data, sha256, sampling).result()
        assert code_of(crashed.value) == grpc.StatusCode.UNAVAILABLE
        assert decord.engine._decord.num_restarts == 2 and decord.engine.num_decord_fallbacks == 0
    finally:
        _close(decord)


class _LateAnswer:
    """The decord backend's pipe to its child, read `delay_s` late: the request's --max-decode-s
    is spent in decord by the time its child's crash is seen (a crash late in a long decode)."""

    def __init__(self, conn, delay_s: float):
        self.conn, self.delay_s = conn, delay_s

    def poll(self, timeout_s: float) -> bool:
        time.sleep(self.delay_s)
        return self.conn.poll(timeout_s)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_a_crash_after_the_decode_budget_is_spent_is_not_decoded_again(seeds, tiny_models, caplog):
    """--max-decode-s bounds the request's decode, not each backend's: PyAV's attempt after the
    decord child crashed started a budget of its own, so a request could take decord's time plus
    --max-decode-s. A crash seen once the budget is spent gets the slow decode's error
    (RESOURCE_EXHAUSTED, naming the flag), not PyAV's tokens; one WARNING line says so."""
    limit_s = 2.0
    decord = _encoder(tiny_models, "decord")
    try:
        assert decord.encode(seeds["mp4_h264_bframes"], SamplingOptions(num_frames=2)) is None  # child up
        # A short budget once the child is up (spawning it may take seconds on a loaded machine).
        decord.engine.config = replace(decord.engine.config, limits=replace(LIMITS, max_decode_s=limit_s))
        backend = decord.engine._decord
        assert backend is not None and backend._conn is not None
        backend._conn = _LateAnswer(backend._conn, delay_s=limit_s + 0.5)
        with caplog.at_level(logging.INFO):
            error = decord.encode(_crashes_decord(seeds), SamplingOptions(num_frames=4))
        assert code_of(error) == grpc.StatusCode.RESOURCE_EXHAUSTED, repr(error)
        assert "(encoder flag --max-decode-s)" in str(error), error
        assert backend.num_restarts == 1 and decord.engine.num_decord_fallbacks == 0
        [warning] = _warnings(caplog)
        assert "decord child crashed" in warning and "--max-decode-s" in warning, warning
        assert not LEAKS.search(warning), warning
    finally:
        _close(decord)
