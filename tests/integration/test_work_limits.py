"""Work limits against one real stack with crafted videos (made here with PyAV): a tiny file of a
huge resolution, an hour of static content in a few kilobytes, thousands of keyframes. Each is
refused with RESOURCE_EXHAUSTED naming the flag that allows it, or answered within its bounds;
the per-API-key concurrency limit reaches the gateway's config from its flag; the stack keeps
serving afterwards."""

from __future__ import annotations

import grpc
import pytest

from epd.cli.configs import encoder_config, gateway_config
from epd.cli.main import build_parser
from epd.client import EpdClient
from epd.client.types import EpdError
from tests.media import make_video
from tests.stack import Stack

QUESTION = "what colour is the square?"
MAX_SOURCE_PIXELS = 1_000_000
MAX_DURATION_S = 600.0


@pytest.fixture(scope="module")
def client(tiny_models, tmp_path_factory):
    extra = {"encoder": ["--max-source-pixels", str(MAX_SOURCE_PIXELS), "--max-duration-s", str(MAX_DURATION_S),
                         "--max-demux-s", "5"]}  # fmt: skip
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


def test_limit_flags_reach_the_configs():
    args = build_parser().parse_args(["serve", "gateway", "--max-requests-per-api-key", "3"])
    assert gateway_config(args).max_requests_per_api_key == 3
    args = build_parser().parse_args(["serve", "encoder", "--model", "m", "--max-duration-s", "60"])
    assert encoder_config(args).limits.max_duration_s == 60


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

    from tests.stack import free_port

    http_port = free_port()
    extra = {"gateway": ["--http-port", str(http_port), "--api-key", "key-one", "--api-key", "key-two",
                         "--max-requests-per-api-key", "1"]}  # fmt: skip
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()

    def chat(key: str, max_tokens: int) -> tuple[int, dict, dict]:
        body = {"model": "epd", "max_tokens": max_tokens, "ignore_eos": True, "media": {"num_frames": 4},
                "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                          {"type": "text", "text": QUESTION}]}]}  # fmt: skip
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                return reply.status, dict(reply.headers), json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), json.loads(exc.read())

    def decode_running() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as reply:
            m = re.search(r'^epd_engine_running_requests{[^}]*stage="decode"[^}]*} ([0-9.]+)$',
                          reply.read().decode(), re.M)
        return float(m.group(1)) if m else 0.0

    with Stack(tiny_models["qwen2_vl"], tmp_path / "logs", extra=extra):
        long: list = []
        first = threading.Thread(target=lambda: long.append(chat("key-one", 400)))
        first.start()
        deadline = time.monotonic() + 60
        while decode_running() < 1:
            assert time.monotonic() < deadline and not long, "the first request never reached decode"
            time.sleep(0.05)
        status, headers, body = chat("key-one", 2)
        assert status == 429 and "Retry-After" in headers, (status, body)
        assert "--max-requests-per-api-key" in body["error"]["message"] and "key-one" not in body["error"]["message"]
        other_status, _, _ = chat("key-two", 2)
        assert other_status == 200, "another key is not held back"
        first.join(120)
        assert long and long[0][0] == 200
