"""The HTTP API's drain at shutdown (`HttpServer.stop`): requests in flight get the grace period
and are then cut; a second signal cuts them at once. aiohttp's own drain only cancelled a
request's body reading after the grace period and waited as long again, so a streamed answer ran
on for twice the grace period, and a second signal did not shorten it (both seen on a real stack:
`epd serve --grace-period 8` took 13 s, a second SIGTERM still waited out the grace period).

The pipeline here streams a token every 20 ms until it is cancelled: what is under test is the
HTTP server's shutdown, which must not depend on how long an answer is."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import aiohttp

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import start_http_api
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.stages.contracts import TokenStep
from epd.stages.server_config import ServerConfig


class EndlessAnswer(Pipeline):
    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]
        self.cancelled = asyncio.Event()

    async def ask(self, req):  # type: ignore[override]
        try:
            while True:
                await asyncio.sleep(0.02)
                yield TokenStep([7], "a")
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


BODY = json.dumps({
    "stream": True,
    "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"v" * 64).decode()}},
        {"type": "text", "text": "what happens?"}]}],
}).encode()


async def _stop_while_streaming(grace_s: float, hurry_after_s: float | None) -> tuple[float, bool, bool]:
    """(seconds `stop` took, whether the stream was cut before its end, whether the pipeline run was
    cancelled), with one streamed answer in flight when the stop begins."""
    pipeline = EndlessAnswer()
    config = GatewayConfig(server=ServerConfig(port=0, grace_s=grace_s), http=HttpApiConfig(port=0))
    http = await start_http_api(config, pipeline, GatewayMetrics())
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{http.port}/v1/chat/completions", data=BODY) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first event: the answer is streaming
            hurry = asyncio.Event()
            started = time.monotonic()
            stopping = asyncio.ensure_future(http.stop(grace_s, hurry))
            if hurry_after_s is not None:
                await asyncio.sleep(hurry_after_s)
                hurry.set()
            await asyncio.wait_for(stopping, timeout=60)
            took_s = time.monotonic() - started
            try:
                rest = await resp.content.read()
                cut = b"[DONE]" not in rest
            except aiohttp.ClientPayloadError:  # the connection closed mid-answer
                cut = True
    return took_s, cut, pipeline.cancelled.is_set()


def test_a_streamed_answer_is_cut_at_the_end_of_the_grace_period_not_twice_it():
    took_s, cut, cancelled = asyncio.run(_stop_while_streaming(grace_s=4.0, hurry_after_s=None))
    assert cut and cancelled
    assert 4.0 <= took_s < 6.0, took_s  # aiohttp's own drain: 8 s and more


def test_a_second_signal_cuts_a_streamed_answer_at_once():
    took_s, cut, cancelled = asyncio.run(_stop_while_streaming(grace_s=30.0, hurry_after_s=0.3))
    assert cut and cancelled
    assert took_s < 10.0, took_s  # it waited out the 30 s grace period
