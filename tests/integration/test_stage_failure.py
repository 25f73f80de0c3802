"""A stage that dies: clients of both APIs get UNAVAILABLE / 503 with a message naming the stage
and the request id, never an address or gRPC's own text; the gateway's health goes NOT_SERVING
and comes back to SERVING once the stage is restarted on its port."""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.error
import urllib.request

import grpc
import pytest

from epd.cli.health import is_serving
from epd.client import EpdClient
from epd.client.retry import RetryPolicy
from epd.client.types import EpdError
from tests.local_http import post_json
from tests.stack import Stack, zygote

MESSAGE = re.compile(r"^decode stage unavailable \(request id [0-9a-f]+\)$")


def chat(port: int, media_path) -> tuple[int, dict]:
    url = "data:video/mp4;base64," + base64.b64encode(media_path.read_bytes()).decode()
    body = {
        "model": "epd",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what moves?"},
                                                  {"type": "video_url", "video_url": {"url": url}}]}],
        "max_tokens": 4,
        "media": {"num_frames": 4},
    }  # fmt: skip
    return post_json(port, "/v1/chat/completions", body)


def wait_until(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_a_dead_decode_stage_is_reported_truthfully_and_recovers(tiny_models, media_files, tmp_path):
    extra = {"gateway": ["--stage-check-interval", "0.5"]}
    with Stack(tiny_models["qwen2_vl"], tmp_path / "logs", extra=extra, http=True) as stack:
        http_port = stack.http_port
        assert chat(http_port, media_files["mp4"])[0] == 200

        decode = stack.procs["decode"]
        decode.kill()
        decode.wait()

        status, body = chat(http_port, media_files["mp4"])
        assert status == 503, body
        text = json.dumps(body)
        assert MESSAGE.match(body["error"]["message"]), body
        assert "ipv4" not in text and "127.0.0.1" not in text and "grpc" not in text.lower()
        assert str(stack.ports["decode"]) not in text
        # The detail is in the gateway's log, under the request id the client saw.
        request_id = body["error"]["message"].split("request id ")[1].rstrip(")")
        assert wait_until(lambda: request_id in (tmp_path / "logs" / "gateway.log").read_text(), 10)

        with EpdClient(stack.gateway, timeout_s=60, retry=RetryPolicy(max_attempts=1)) as client:
            with pytest.raises(EpdError) as info:
                client.ask(media_files["mp4"], "what moves?", num_frames=4, max_new_tokens=4)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert MESSAGE.match(info.value.message), info.value.message

        assert wait_until(lambda: not is_serving(stack.gateway, timeout_s=1.0), 15)
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10)
        assert health.value.code == 503
        health_body = health.value.read().decode()
        assert "decode" in health_body and "127.0.0.1" not in health_body

        # Restarted as `epd serve` restarts a replica: forked again from the zygote, on its port.
        stack.procs["decode"] = zygote().start(
            "decode", stack.command("decode")[3:], stack.env, str(tmp_path / "logs" / "decode-restarted.log")
        )
        assert wait_until(lambda: is_serving(stack.gateway, timeout_s=1.0), 120), "gateway did not recover"
        status, body = chat(http_port, media_files["mp4"])
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] is not None
