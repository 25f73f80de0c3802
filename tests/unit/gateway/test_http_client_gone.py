"""A client that closes its connection is not a server error: one INFO line, a 499 in the metrics,
no ERROR traceback and no 500. Found by a soak of the stack (clients that hang up): every client
that closed while sending its body, and now and then one that closed just as its stream ended (the
`[DONE]` or the end of the chunked body met a closing transport), was logged as "internal error in
the HTTP API" with a traceback and counted as a 500: 171 ERROR tracebacks in 26,000 requests."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError

from epd.gateway.ask_types import AskSummary
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_server import start_http_api
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.stages.contracts import TokenStep
from epd.stages.server_config import ServerConfig
from tests.unit.gateway.streamed_body import BODY, JSON

ROUTE = "/v1/chat/completions"


class OneTokenAnswer(Pipeline):
    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]

    async def ask(self, req):  # type: ignore[override]
        yield TokenStep([7], "a")
        yield AskSummary(
            request_id="r",
            answer="a",
            token_ids=[7],
            finish_reason="length",
            num_frames=2,
            num_visual_tokens=4,
            num_prompt_tokens=9,
            timings_ms={},
            kv_num_bytes=0,
            encoder_cache_hit=False,
            media_sha256="",
            frame_timestamps_s=[],
        )


async def _answered(metrics: GatewayMetrics) -> dict[str, float]:
    """The chat route's responses by status code, once it has answered one (a deadline only so a
    broken build fails instead of hanging)."""
    codes = ("200", "499", "500")
    for _ in range(500):
        counts = {code: metrics.value("epd_http_responses_total", route=ROUTE, code=code) for code in codes}
        if any(counts.values()):
            return counts
        await asyncio.sleep(0.02)
    pytest.fail("the request was never answered")


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_that_closes_while_sending_its_body_is_a_499_not_an_error(caplog):
    async def run() -> dict[str, float]:
        metrics = GatewayMetrics()
        config = GatewayConfig(server=ServerConfig(port=0), http=HttpApiConfig(port=0))
        http = await start_http_api(config, OneTokenAnswer(), metrics)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", http.port)
            writer.write(
                f"POST {ROUTE} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(BODY)}\r\n\r\n".encode()
                + BODY[: len(BODY) // 2]
            )
            await writer.drain()
            writer.close()  # half the body sent
            return await _answered(metrics)
        finally:
            await http.stop()

    with caplog.at_level(logging.INFO, logger="epd.gateway.http_api"):
        counts = asyncio.run(run())
    assert counts == {"200": 0, "499": 1, "500": 0}
    assert _errors(caplog) == []
    # aiohttp cancels the handler as the body's read fails: either ends it as a client gone.
    assert any("went away" in r.getMessage() for r in caplog.records)


def test_a_client_gone_as_its_stream_ends_is_not_an_error(caplog, monkeypatch):
    """aiohttp raises ClientConnectionResetError ("Cannot write to closing transport") for a write
    after the client closed; here the `[DONE]` meets it, as it did in the soak."""
    write = web.StreamResponse.write

    async def write_to_a_closing_transport(self, data):
        if data == b"data: [DONE]\n\n":
            raise ClientConnectionResetError("Cannot write to closing transport")
        await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write_to_a_closing_transport)

    async def run() -> tuple[dict[str, float], str]:
        metrics = GatewayMetrics()
        config = GatewayConfig(server=ServerConfig(port=0), http=HttpApiConfig(port=0))
        http = await start_http_api(config, OneTokenAnswer(), metrics)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(
                    f"http://127.0.0.1:{http.port}{ROUTE}", data=BODY, headers=JSON
                ) as resp:
                    assert resp.status == 200
                    text = (await resp.read()).decode()
            return await _answered(metrics), text
        finally:
            await http.stop()

    with caplog.at_level(logging.INFO, logger="epd.gateway.http_api"):
        counts, text = asyncio.run(run())
    assert '"epd"' in text and "[DONE]" not in text  # the answer went out; its end met the closed client
    assert counts == {"200": 1, "499": 0, "500": 0}
    assert _errors(caplog) == []
    assert any("went away mid-stream" in r.getMessage() for r in caplog.records)
