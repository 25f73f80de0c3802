"""Work limits against one real stack with crafted videos (made here with PyAV): a tiny file of a
huge resolution, an hour of static content in a few kilobytes, thousands of keyframes. Each is
refused with RESOURCE_EXHAUSTED naming the flag that allows it, or answered within its bounds;
the per-API-key concurrency limit reaches the gateway's config from its flag; the stack keeps
serving afterwards. The decode wall-time limit (--max-decode-s) is set on the stack's encoder (a
normal request is served within it) and, so small that any video decode exceeds it, on one more
encoder called directly: timing cannot make that refusal flaky."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from epd.cli.configs import encoder_config, gateway_config
from epd.cli.parsers.root import build_parser
from epd.client import EpdClient
from epd.client.types import EpdError
from tests.media import make_video
from tests.stack import INTERNAL_AUTH_METADATA, Stack, bound_ports, child_env, zygote

QUESTION = "what colour is the square?"
MAX_SOURCE_PIXELS = 1_000_000
MAX_DURATION_S = 600.0
MAX_DECODE_S = 60.0


@pytest.fixture(scope="module")
def client(tiny_models, tmp_path_factory):
    extra = {"encoder": ["--max-source-pixels", str(MAX_SOURCE_PIXELS), "--max-duration-s", str(MAX_DURATION_S),
                         "--max-demux-s", "5", "--max-decode-s", str(MAX_DECODE_S)]}  # fmt: skip
    with Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_limits"), extra=extra) as stack:
        with EpdClient(stack.gateway, timeout_s=120) as c:
            yield c
        assert stack.alive()


def _refusal(client, path, **options) -> EpdError:
    with pytest.raises(EpdError) as info:
        client.ask(path, QUESTION, max_new_tokens=2, **options)
    return info.value


def test_tiny_file_of_huge_resolution_is_refused_naming_the_pixel_flag(client, tmp_path):
    path = make_video(tmp_path / "huge.mp4", size=(2048, 2048), fps=1, seconds=1, gop=1, pattern="solid")
    assert path.stat().st_size < 200_000  # one single-colour frame: tiny on disk, 4 Mpx decoded
    error = _refusal(client, path, num_frames=1)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED, error.message
    assert "--max-source-pixels" in error.message, error.message


def test_an_hour_of_static_content_is_refused_by_the_duration_limit(client, tmp_path):
    path = make_video(tmp_path / "hour.mp4", size=(64, 64), fps=1, seconds=3600, gop=600, pattern="solid")
    assert path.stat().st_size < 2_000_000
    error = _refusal(client, path, num_frames=4)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED, error.message
    assert f"{MAX_DURATION_S:.0f} s" in error.message and "--max-duration-s" in error.message, error.message


def test_thousands_of_keyframes_stay_bounded(client, tmp_path):
    path = make_video(tmp_path / "keyframes.mp4", size=(32, 32), fps=30, seconds=100, gop=1)  # 3000 keyframes
    try:
        result = client.ask(path, QUESTION, num_frames=4, max_new_tokens=2)
    except EpdError as error:  # refused by a work limit: fine, if it says which
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED, error.message
        assert "--max-" in error.message, error.message
    else:
        assert result.token_ids and len(result.token_ids) <= 2


def test_still_serving_a_normal_request(client, media_files):
    assert client.ask(media_files["mp4"], QUESTION, num_frames=4, max_new_tokens=2).token_ids


def _encode(address: str, data: bytes, **sampling) -> list:
    """One Encode call made as the gateway makes it: a header, then the media in chunks."""
    from epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc

    header = encoder_pb2.EncodeHeader(
        request_id="limits", media_num_bytes=len(data), sampling=common_pb2.VideoSampling(**sampling)
    )
    messages = [encoder_pb2.EncodeRequest(header=header)]
    messages += [
        encoder_pb2.EncodeRequest(media_chunk=data[i : i + 65536]) for i in range(0, len(data), 65536)
    ]
    with grpc.insecure_channel(address) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        return list(stub.Encode(iter(messages), timeout=120, metadata=INTERNAL_AUTH_METADATA))


def test_decode_wall_time_limit_refuses_with_its_flag_and_the_encoder_keeps_serving(
    tiny_models, media_files, tmp_path
):
    """An encoder with --max-decode-s 1e-06: every video decode (its demux pass alone) takes longer,
    so the request is refused with RESOURCE_EXHAUSTED naming the flag, however fast the machine.
    Its decode threads are stopped and replaced; it still serves an image (which no video decoder
    touches) and stays alive."""
    from epd.cli.health import is_serving

    ports_file = tmp_path / "encoder.ports.json"
    argv = ["serve", "encoder", "--port", "0", "--ports-file", str(ports_file), "--model", str(tiny_models["qwen2_vl"]),
            "--max-decode-s", "1e-06", "--decode-workers", "2"]  # fmt: skip
    encoder = zygote().start(
        "encoder-decode-limit", argv, child_env(internal_secret=True), str(tmp_path / "encoder.log")
    )
    try:
        address = f"127.0.0.1:{bound_ports(ports_file, encoder, 'the encoder')['grpc']}"
        deadline = time.monotonic() + 120
        while not is_serving(address, timeout_s=1.0):
            assert encoder.poll() is None and time.monotonic() < deadline, (
                tmp_path / "encoder.log"
            ).read_text()[-3000:]
            time.sleep(0.2)
        for _ in range(2):  # the second one meets the pool that the first left behind
            with pytest.raises(grpc.RpcError) as info:
                _encode(address, media_files["mp4"].read_bytes(), num_frames=4)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            assert (
                "decoding this video took longer than this server's limit of 1e-06 s (encoder flag "
                "--max-decode-s)"
            ) in info.value.details(), info.value.details()
        result = _encode(address, media_files["png"].read_bytes())[-1].result
        assert result.modality == "image" and result.num_visual_tokens > 0
        assert encoder.poll() is None
    finally:
        if encoder.poll() is None:
            encoder.send_signal(signal.SIGTERM)
        encoder.wait(timeout=30)


def test_limit_flags_reach_the_configs():
    args = build_parser().parse_args(["serve", "gateway", "--max-requests-per-api-key", "3"])
    assert gateway_config(args).max_requests_per_api_key == 3
    args = build_parser().parse_args(["serve", "encoder", "--model", "m", "--max-duration-s", "60",
                                      "--max-decode-s", str(MAX_DECODE_S)])  # fmt: skip
    assert encoder_config(args).limits.max_duration_s == 60
    assert encoder_config(args).limits.max_decode_s == MAX_DECODE_S


def test_one_api_key_over_its_limit_gets_429_while_another_key_is_served(tiny_models, media_files, tmp_path):
    """--max-requests-per-api-key 1: a key with one request in flight gets HTTP 429 + Retry-After
    for a second one (whatever its IP), another key's request is served meanwhile."""
    import base64
    import json
    import re
    import threading
    import time
    import urllib.error
    import urllib.request

    extra = {"gateway": ["--api-key", "key-one", "--api-key", "key-two",
                         "--max-requests-per-api-key", "1"]}  # fmt: skip
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()

    def chat(key: str, max_tokens: int) -> tuple[int, dict, dict]:
        body = {"model": "epd", "max_tokens": max_tokens, "ignore_eos": True, "media": {"num_frames": 4},
                "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                          {"type": "text", "text": QUESTION}]}]}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                return reply.status, dict(reply.headers), json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), json.loads(exc.read())

    def decode_running() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as reply:
            m = re.search(
                r'^epd_engine_running_requests{[^}]*stage="decode"[^}]*} ([0-9.]+)$',
                reply.read().decode(),
                re.M,
            )
        return float(m.group(1)) if m else 0.0

    with Stack(tiny_models["qwen2_vl"], tmp_path / "logs", extra=extra, http=True) as stack:
        http_port = stack.http_port
        long: list = []
        first = threading.Thread(target=lambda: long.append(chat("key-one", 400)))
        first.start()
        deadline = time.monotonic() + 60
        while decode_running() < 1:
            assert time.monotonic() < deadline and not long, "the first request never reached decode"
            time.sleep(0.05)
        status, headers, body = chat("key-one", 2)
        assert status == 429 and "Retry-After" in headers, (status, body)
        assert (
            "--max-requests-per-api-key" in body["error"]["message"]
            and "key-one" not in body["error"]["message"]
        )
        other_status, _, _ = chat("key-two", 2)
        assert other_status == 200, "another key is not held back"
        first.join(120)
        assert long and long[0][0] == 200
