"""The gateway HTTP calls that several integration test files make, beside tests/local_http.py's
`post_json` and `sse_chunks`: the embedded pipeline served on a free port as `epd serve --colocate`
serves it (`post_embedded`), a question about a video to /v1/chat/completions (`_chat`), and
/v1/models' card once the gateway has prefill's answer (`_model_card`)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp
from aiohttp import web

from epd.gateway.config import GatewayConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from tests.local_http import post_json


async def _post(url: str, path: str, body: dict) -> tuple[int, Any]:
    """(status, JSON body) of a plain answer, or (status, [each SSE event's JSON]) of a stream."""
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as resp:
        if not body.get("stream") or resp.status != 200:
            return resp.status, await resp.json()
        events = [
            line[len("data: ") :] for line in (await resp.text()).splitlines() if line.startswith("data: ")
        ]
        assert events[-1] == "[DONE]"
        return resp.status, [json.loads(e) for e in events[:-1]]


def post_embedded(
    pipeline, *requests: tuple[str, dict], config: GatewayConfig | None = None
) -> list[tuple[int, Any]]:
    """Each (path, body) posted in turn to the HTTP API (`config`'s, the defaults by default)
    served over `pipeline` on a free port, as `epd serve --colocate` serves it."""

    async def run() -> list[tuple[int, Any]]:
        api = HttpApi(config or GatewayConfig(), pipeline, GatewayMetrics())
        runner = web.AppRunner(api.app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            return [await _post(url, path, body) for path, body in requests]
        finally:
            await runner.cleanup()

    return asyncio.run(run())


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as reply:
        return json.loads(reply.read())


def _chat(port: int, video: bytes, **fields) -> tuple[int, dict]:
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    body = {"model": "epd", "max_tokens": 2, "media": {"num_frames": 2}, **fields,
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": "what happens?"}]}]}  # fmt: skip
    body = {name: value for name, value in body.items() if value is not None}  # None: a field left unset
    return post_json(port, "/v1/chat/completions", body)


def _model_card(port: int, timeout_s: float = 30.0) -> dict:
    """/v1/models' one model, once the gateway has prefill's answer (it reads it in the background
    once it serves; the stack counts as started when the gateway serves)."""
    deadline = time.monotonic() + timeout_s
    while True:
        card = _get(port, "/v1/models")["data"][0]
        if card["max_model_len"] is not None or time.monotonic() > deadline:
            return card
        time.sleep(0.1)
