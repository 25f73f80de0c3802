"""Uploads that would make FFmpeg open something by name are refused on every door.

Before the container allow-list, an `ffconcat` playlist naming a file relative to the server's
working directory made FFmpeg decode that local file as if it had been uploaded (a text file
came back rendered by the `tty` demuxer), and HLS playlists could open local files or fetch
URLs. Here every such payload goes through the OpenAI HTTP API, the gRPC API, the demo's
/demo/frames endpoint and `epd ask`; each must be refused as an unsupported container, no
response may contain the secret, and the local HTTP server named by a playlist must see no
request. A one-frame 1080p file asked for 256 frames, and a stream whose resolution grows
mid-file, are refused or served within a stated memory bound; files whose headers would make
FFmpeg allocate before any limit (many tracks, sample tables that say more than the file holds)
are refused with the status and words of their limit, and odd but harmless headers (a Latin-1
title, malformed EXIF) are answered; the stack keeps serving.
"""

from __future__ import annotations

import base64
import json
import shutil
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest

from epd.client import EpdClient, EpdError
from tests import hostile_media
from tests.local_http import recording_server
from tests.media import make_resolution_change, make_video
from tests.stack import ROOT, child_env, epd_command

SECRET = "EPD-SECRET-" + uuid.uuid4().hex
QUESTION = "what happens?"
# Peak RSS growth allowed in the encoder for one hostile request (the model is loaded before it).
MAX_ENCODER_RSS_GROWTH_BYTES = 400 * 1024 * 1024


@pytest.fixture(scope="module")
def local_server():
    with recording_server() as server:
        yield server


@pytest.fixture(scope="module")
def planted(media_files):
    """A secret text file and a local video, named relative to the servers' working directory
    (the repository root): FFmpeg's playlist "safe mode" refuses only absolute paths and "..",
    so these are exactly what an attacker would name."""
    rel = Path(f"untrusted_media_{uuid.uuid4().hex[:8]}")
    root = ROOT / rel
    root.mkdir()
    (root / "secret.txt").write_text((SECRET + "\n") * 40)
    shutil.copy(media_files["mp4"], root / "local.mp4")
    yield rel
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def payloads(planted, local_server) -> dict[str, bytes]:
    port = local_server.port
    secret, video = f"{planted}/secret.txt", f"{planted}/local.mp4"
    hls = "#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\n{}\n#EXT-X-ENDLIST\n"
    return {
        "ffconcat_text": f"ffconcat version 1.0\nfile {secret}\n".encode(),
        "ffconcat_video": f"ffconcat version 1.0\nfile {video}\nfile {video}\n".encode(),
        "hls_local": hls.format(video).encode(),
        "hls_http": hls.format(f"http://127.0.0.1:{port}/segment.ts").encode(),
        "tty_text": (SECRET + "\n").encode() * 40,
        "image2_pattern": f"{planted}/img-%03d.png".encode(),
        "subfile": f"subfile,,start,0,end,0,,:{secret}".encode(),
        "concat_protocol": f"concat:{video}|{video}".encode(),
    }


PAYLOADS = ["ffconcat_text", "ffconcat_video", "hls_local", "hls_http", "tty_text", "image2_pattern",
            "subfile", "concat_protocol"]  # fmt: skip


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack


@pytest.fixture(scope="module")
def client(stack):
    with EpdClient(stack.gateway, timeout_s=120) as c:
        yield c


def _post(stack, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{stack.http_port}{path}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _data_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def _assert_refused_safely(text: str, local_server) -> None:
    assert "unsupported container" in text.lower(), text
    assert SECRET not in text
    assert "untrusted_media_" not in text  # no path echoed back
    assert local_server.seen == []


@pytest.mark.parametrize("kind", PAYLOADS)
def test_refused_over_grpc(client, payloads, local_server, kind):
    with pytest.raises(EpdError) as info:
        client.ask(payloads[kind], QUESTION, num_frames=2, max_new_tokens=4)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    _assert_refused_safely(info.value.message, local_server)


@pytest.mark.parametrize("kind", PAYLOADS)
def test_refused_over_openai_http(stack, payloads, local_server, kind):
    status, body = _post(stack, "/v1/chat/completions", {
        "model": "epd", "max_tokens": 4, "media": {"num_frames": 2},
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "video_url", "video_url": {"url": _data_url(payloads[kind])}},
        ]}],
    })  # fmt: skip
    assert status == 400, body
    _assert_refused_safely(json.loads(body)["error"]["message"], local_server)


@pytest.mark.parametrize("kind", PAYLOADS)
def test_refused_by_demo_frames(stack, payloads, local_server, kind):
    status, body = _post(
        stack, "/demo/frames", {"video_url": _data_url(payloads[kind]), "media": {"num_frames": 2}}
    )
    assert status == 400, body
    _assert_refused_safely(json.loads(body)["error"]["message"], local_server)


@pytest.mark.parametrize("kind", ["ffconcat_text", "ffconcat_video", "hls_http"])
def test_refused_by_epd_ask(payloads, local_server, tmp_path, kind):
    import subprocess

    path = tmp_path / "upload.mp4"  # the name a user would give it; only the bytes count
    path.write_bytes(payloads[kind])
    proc = subprocess.run(
        epd_command("ask", str(path), QUESTION, "--max-new-tokens", "4"),
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=180,
    )
    assert proc.returncode != 0
    _assert_refused_safely(proc.stdout + proc.stderr, local_server)


def test_one_frame_1080p_asked_for_256_frames(stack, client, tmp_path):
    """7-8 KB of H.264 that decodes to one 1920x1080 frame: before, 256 copies of it were
    materialised (~1.6 GB). Refused or served, the encoder's peak RSS stays bounded."""
    path = make_video(tmp_path / "one.mp4", size=(1920, 1080), fps=1.0, seconds=1.0, gop=1)
    before = _peak_rss_bytes(stack.procs["encoder"].pid)
    try:
        result = client.ask(path, QUESTION, num_frames=256, max_new_tokens=2)
        assert result.num_frames == 256
    except EpdError as err:
        assert err.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
        assert "--max" in err.message  # names the flag that tunes the limit
    growth = _peak_rss_bytes(stack.procs["encoder"].pid) - before
    assert growth < MAX_ENCODER_RSS_GROWTH_BYTES, f"encoder peak RSS grew by {growth / 2**20:.0f} MiB"


def test_resolution_growing_mid_stream(stack, client, tmp_path):
    """An MPEG-TS whose header (and first 20 frames) say 64x48 and whose last frames are
    4096x4096, over the default 3840x2160 per-frame limit: a header check alone lets it in."""
    path = make_resolution_change(tmp_path / "grow.ts", [(64, 48), (4096, 4096)], [20, 4])
    before = _peak_rss_bytes(stack.procs["encoder"].pid)
    with pytest.raises(EpdError) as info:
        client.ask(path, QUESTION, num_frames=6, max_new_tokens=2)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "pixels" in info.value.message
    growth = _peak_rss_bytes(stack.procs["encoder"].pid) - before
    assert growth < MAX_ENCODER_RSS_GROWTH_BYTES, f"encoder peak RSS grew by {growth / 2**20:.0f} MiB"


HEADER_CASES = {
    # kind: (status, words of the message); None: answered
    "many_tracks": (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "the file has 17 tracks, over this server's limit of 16",
    ),
    "chunk_bomb": (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "frames and audio packets, over this server's limit of",
    ),
    "hidden_stsz": (
        grpc.StatusCode.INVALID_ARGUMENT,
        "sample table box (stsz) outside a track's sample table",
    ),
    "latin1_title": None,
    "malformed_exif": None,
}


def _header_case(kind: str, tmp_path: Path) -> bytes:
    return {
        "many_tracks": lambda: hostile_media.many_tracks_mp4(tmp_path, 17),
        "chunk_bomb": lambda: hostile_media.pcm_chunk_bomb(0x7FFFFC00),
        "hidden_stsz": lambda: hostile_media.hidden_stsz(tmp_path, "udta", 40_000_000),
        "latin1_title": lambda: hostile_media.titled_video("matroska", b"Caf\xe9".ljust(11, b"_")),
        "malformed_exif": lambda: hostile_media.image_with_malformed_exif("JPEG", 0x013F),
    }[kind]()


@pytest.mark.parametrize("kind", list(HEADER_CASES))
def test_hostile_headers_over_grpc(stack, client, tmp_path, kind):
    """Each was an allocation of hundreds of MB to GBs inside av.open, or an INTERNAL error, or a
    file refused as corrupt; now: the limit's status and words, or an answer."""
    data = _header_case(kind, tmp_path)
    before = _peak_rss_bytes(stack.procs["encoder"].pid)
    if HEADER_CASES[kind] is None:
        result = client.ask(data, QUESTION, num_frames=2, max_new_tokens=2)
        assert result.num_frames == (1 if kind == "malformed_exif" else 2)
    else:
        code, words = HEADER_CASES[kind]
        with pytest.raises(EpdError) as info:
            client.ask(data, QUESTION, num_frames=2, max_new_tokens=2)
        assert info.value.code == code and words in info.value.message, info.value
        assert "send" in info.value.message  # what to change
    growth = _peak_rss_bytes(stack.procs["encoder"].pid) - before
    assert growth < MAX_ENCODER_RSS_GROWTH_BYTES, f"encoder peak RSS grew by {growth / 2**20:.0f} MiB"


def test_malformed_exif_is_shown_by_demo_frames(stack):
    """/demo/frames answered HTTP 500 for it."""
    data = hostile_media.image_with_malformed_exif("JPEG", 0x013F)
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    status, body = _post(stack, "/demo/frames", {"video_url": url})
    assert status == 200, body
    frames = json.loads(body)
    assert frames["is_image"] and (frames["width"], frames["height"]) == (40, 80)  # turned upright


def test_still_serving_after_hostile_inputs(client, media_files):
    result = client.ask(media_files["mp4"], QUESTION, num_frames=4, max_new_tokens=4)
    assert result.num_frames == 4
    assert len(result.token_ids) > 0


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")
