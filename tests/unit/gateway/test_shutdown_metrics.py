"""A request the gateway's shutdown cuts at the end of its grace period is counted in
epd_requests_total with the status its client gets (UNAVAILABLE before any token, ABORTED after:
`epd.gateway.shutdown`), on both APIs. It was counted CANCELLED, as a client that went away, so a
deploy's cut requests looked like impatient clients on the dashboards.

Real gateway servers (gRPC and HTTP) in this process over a metered pipeline whose stages are
stand-ins: prefill answers at once, the decoder streams a token every 20 ms (or none) until it is
cancelled. What is under test is what the metric says, whatever the answer's length.

And a streamed Ask whose client cancels once it has the summary (the SDK does, as it returns) is
counted OK, even while its handler still runs."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_server import start_http_api
from epd.gateway.metrics import GatewayMetrics, MeteredPipeline
from epd.gateway.pipeline import Pipeline
from epd.gateway.server import start
from epd.stages.contracts import DecodeStage, PrefillHandle, PrefillStage, TokenStep
from epd.stages.messages import Message
from epd.stages.server_config import ServerConfig
from epd.transport.message_convert import messages_to_proto
from epd.transport.server import StopSignals, serve_until_signal
from epd.v1 import gateway_pb2, gateway_pb2_grpc


class _Prefill(PrefillStage):
    async def prefill(
        self,
        messages,
        media,
        generation,
        request_id,
        pruning=None,
        cache_salt="",
        *,
        raw_prompt=None,
        template=None,
    ):  # type: ignore[override]
        return PrefillHandle(first_token_id=7, num_prompt_tokens=1, num_cached_tokens=1, next_position_ids=[1],
                             kv_num_bytes=0, prefill_ms=0.0)  # fmt: skip

    async def release(self, handle, request_id):  # type: ignore[override]
        pass


class _Decoder(DecodeStage):
    """Streams a token every 20 ms until cancelled; `tokens` False: never a token."""

    def __init__(self, tokens: bool) -> None:
        self.tokens = tokens

    async def generate(self, handle, generation, request_id, pruning=None):  # type: ignore[override]
        while True:
            await asyncio.sleep(0.02)
            if self.tokens:
                yield TokenStep([7], "a")


def _metered(tokens: bool) -> tuple[MeteredPipeline, GatewayMetrics]:
    metrics = GatewayMetrics()
    return MeteredPipeline(Pipeline(None, _Prefill(), _Decoder(tokens)), metrics), metrics  # type: ignore[arg-type]


def _counted(metrics: GatewayMetrics) -> dict[str, float]:
    return {status: n for status in ("OK", "CANCELLED", "UNAVAILABLE", "ABORTED")
            if (n := metrics.value("epd_requests_total", status=status))}  # fmt: skip


@pytest.mark.parametrize(
    ("stream", "status", "counted"),
    [
        (False, 503, "UNAVAILABLE"),  # a whole answer not given yet: a 503 to retry
        (True, 200, "ABORTED"),  # a streamed answer with tokens out: an error event (502) and [DONE]
    ],
)
def test_an_http_request_cut_at_shutdown_is_counted_with_the_status_its_client_gets(stream, status, counted):
    async def scenario():
        pipeline, metrics = _metered(tokens=True)
        config = GatewayConfig(server=ServerConfig(port=0, grace_s=0.5), http=HttpApiConfig(port=0))
        http = await start_http_api(config, pipeline, metrics)
        body = json.dumps({"stream": stream, "messages": [{"role": "user", "content": "hello"}]})
        async with aiohttp.ClientSession() as session:
            answer = asyncio.ensure_future(
                session.post(
                    f"http://127.0.0.1:{http.port}/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                )
            )
            await asyncio.sleep(0.3)  # it is being answered (the decoder never ends it)
            await asyncio.wait_for(http.stop(0.5), timeout=30)
            async with await answer as resp:
                return resp.status, await resp.text(), _counted(metrics)

    got_status, text, counts = asyncio.run(scenario())
    assert got_status == status, text
    assert "the server is shutting down" in text or "the server shut down after" in text, text
    assert counts == {counted: 1.0}, counts


@pytest.mark.parametrize(
    ("tokens", "code"),
    [
        (True, grpc.StatusCode.ABORTED),  # tokens out: the answer is incomplete
        (False, grpc.StatusCode.UNAVAILABLE),  # nothing out yet: retrying is safe
    ],
)
def test_a_grpc_call_cut_at_shutdown_is_counted_with_the_status_its_client_gets(tokens, code):
    async def scenario():
        pipeline, metrics = _metered(tokens)
        config = GatewayConfig(server=ServerConfig(host="127.0.0.1", port=0, grace_s=0.5))
        hs = await start(config, pipeline)
        await hs.set_serving()
        signals = StopSignals()
        serving = asyncio.ensure_future(serve_until_signal(hs, config.server.grace_s, signals=signals))
        header = gateway_pb2.AskHeader(request_id="cut", messages=messages_to_proto([Message.user("hello")]))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
            call = gateway_pb2_grpc.GatewayServiceStub(channel).Ask(
                iter([gateway_pb2.AskRequest(header=header)])
            )
            try:
                async for response in call:
                    if response.HasField("event") and response.event.stage == "upload":
                        signals.stop.set()  # SIGTERM with the request in the pipeline
            except grpc.aio.AioRpcError as exc:
                error = exc
        await asyncio.wait_for(serving, timeout=30)
        return error.code(), _counted(metrics)

    got, counts = asyncio.run(scenario())
    assert got == code
    assert counts == {code.name: 1.0}, counts


class _OneToken(DecodeStage):
    async def generate(self, handle, generation, request_id, pruning=None):  # type: ignore[override]
        yield TokenStep([7], "a", finish_reason="stop")


class _LingeringPipeline(MeteredPipeline):
    """Its run goes on after the summary (as a real one's cleanup may, under load), so the client
    has the whole answer while the call's handler still runs."""

    async def ask(self, req):  # type: ignore[override]
        async for item in super().ask(req):
            yield item
        await asyncio.Event().wait()


def test_a_grpc_call_its_client_cancels_after_the_summary_is_counted_ok():
    """The SDK cancels a streamed Ask as it returns with the whole answer; a handler still running
    then was counted CANCELLED, as a client that went away without it (cac45fc)."""

    async def scenario():
        metrics = GatewayMetrics()
        pipeline = _LingeringPipeline(Pipeline(None, _Prefill(), _OneToken()), metrics)  # type: ignore[arg-type]
        config = GatewayConfig(server=ServerConfig(host="127.0.0.1", port=0, grace_s=0.5))
        hs = await start(config, pipeline)
        await hs.set_serving()
        header = gateway_pb2.AskHeader(
            request_id="whole", messages=messages_to_proto([Message.user("hello")])
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
                call = gateway_pb2_grpc.GatewayServiceStub(channel).Ask(
                    iter([gateway_pb2.AskRequest(header=header)])
                )
                async for response in call:
                    if response.HasField("summary"):
                        call.cancel()  # as the SDK's ask returns
                        break
                codes = ("OK", "CANCELLED")
                for _ in range(3000):  # the count is made when the handler ends
                    counted = {
                        c: n
                        for c in codes
                        if (n := metrics.value("epd_grpc_responses_total", method="Ask", code=c))
                    }
                    if counted:
                        return counted
                    await asyncio.sleep(0.01)
                return {}
        finally:
            await hs.stop(0)

    assert asyncio.run(scenario()) == {"OK": 1.0}
