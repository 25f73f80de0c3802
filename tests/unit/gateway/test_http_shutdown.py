"""The HTTP API's drain at shutdown (`HttpServer.stop`): requests in flight get the grace period
and are then cut; a second signal cuts them at once. aiohttp's own drain only cancelled a
request's body reading after the grace period and waited as long again, so a streamed answer ran
on for twice the grace period, and a second signal did not shorten it (both seen on a real stack:
`epd serve --grace-period 8` took 13 s, a second SIGTERM still waited out the grace period).

The pipeline here streams a token every 20 ms until it is cancelled: what is under test is the
HTTP server's shutdown, which must not depend on how long an answer is."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_server import start_http_api
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.stages.contracts import TokenStep
from epd.stages.server_config import ServerConfig
from tests.unit.gateway.streamed_body import BODY, JSON


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


async def _stop_while_streaming(grace_s: float, hurry_after_s: float | None) -> tuple[float, str, bool]:
    """(seconds `stop` took, the rest of the stream, whether the pipeline run was cancelled), with
    one streamed answer in flight when the stop begins."""
    pipeline = EndlessAnswer()
    config = GatewayConfig(server=ServerConfig(port=0, grace_s=grace_s), http=HttpApiConfig(port=0))
    http = await start_http_api(config, pipeline, GatewayMetrics())
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"http://127.0.0.1:{http.port}/v1/chat/completions", data=BODY, headers=JSON
        ) as resp:
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
                rest = (await resp.content.read()).decode()
            except aiohttp.ClientPayloadError:  # the connection closed mid-answer (it did)
                rest = "<the connection closed mid-chunk>"
    return took_s, rest, pipeline.cancelled.is_set()


def _ends_with_the_shutdown_error(rest: str, why: str = "its grace period was over") -> None:
    """The answer ends with an error event saying what happened and [DONE], not a cut chunk (the
    client could not tell a shutdown from a network fault)."""
    events = [line.removeprefix("data: ") for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", rest[-300:]
    error = json.loads(events[-2])["error"]
    assert (
        error["message"].startswith("the server shut down after ")
        and f"tokens ({why})" in error["message"]
        and "request id " in error["message"]
    ), error
    assert error["code"] == 502  # vLLM's: the HTTP status as an integer


def test_a_streamed_answer_is_cut_at_the_end_of_the_grace_period_not_twice_it():
    took_s, rest, cancelled = asyncio.run(_stop_while_streaming(grace_s=4.0, hurry_after_s=None))
    assert cancelled
    _ends_with_the_shutdown_error(rest)
    assert 4.0 <= took_s < 6.0, took_s  # aiohttp's own drain: 8 s and more


def test_a_second_signal_cuts_a_streamed_answer_at_once():
    took_s, rest, cancelled = asyncio.run(_stop_while_streaming(grace_s=30.0, hurry_after_s=0.3))
    assert cancelled
    # Not "its grace period was over": 0.3 s of 30 had passed.
    _ends_with_the_shutdown_error(rest, why="a second stop signal ended its drain")
    assert took_s < 10.0, took_s  # it waited out the 30 s grace period


def test_an_answer_not_yet_begun_at_the_cut_is_a_503_to_retry():
    """It was a dropped connection (ServerDisconnectedError)."""

    async def scenario():
        config = GatewayConfig(server=ServerConfig(port=0, grace_s=0.5), http=HttpApiConfig(port=0))
        http = await start_http_api(config, EndlessAnswer(), GatewayMetrics())
        whole = json.dumps({**json.loads(BODY), "stream": False}).encode()
        async with aiohttp.ClientSession() as session:
            answer = asyncio.ensure_future(
                session.post(f"http://127.0.0.1:{http.port}/v1/chat/completions", data=whole, headers=JSON)
            )
            await asyncio.sleep(0.3)  # it is being answered (the endless pipeline never ends it)
            await asyncio.wait_for(http.stop(0.5), timeout=30)
            async with await answer as resp:
                return resp.status, await resp.json()

    status, body = asyncio.run(scenario())
    assert status == 503, body
    assert body["error"]["message"].startswith(
        "the server is shutting down (its grace period is over); retry"
    )


class HangingChecks:
    """Stage checks that never answer: a GET /health waits on them until it is cut."""

    async def not_serving(self) -> list[str]:
        await asyncio.sleep(3600)
        return []

    async def close(self) -> None:
        pass


def test_any_route_still_answering_at_the_cut_is_a_503_counted_as_one_not_a_client_gone_499():
    """A cut handler of any route but chat completions (/health waiting on its checks, /metrics on
    its load reads, the web demo's decode) was taken for one whose client had gone: an INFO line
    "client ... went away", a 499 in epd_http_responses_total, and the client's connection dropped."""

    async def scenario():
        config = GatewayConfig(server=ServerConfig(port=0, grace_s=0.5), http=HttpApiConfig(port=0))
        metrics = GatewayMetrics()
        http = await start_http_api(config, EndlessAnswer(), metrics, HangingChecks())  # type: ignore[arg-type]
        async with aiohttp.ClientSession() as session:
            answer = asyncio.ensure_future(session.get(f"http://127.0.0.1:{http.port}/health"))
            await asyncio.sleep(0.3)  # it is waiting on the checks
            await asyncio.wait_for(http.stop(0.5), timeout=30)
            async with await answer as resp:
                status, body = resp.status, await resp.json()
        counted = [line for line in (await metrics.scrape()).decode().splitlines()
                   if line.startswith("epd_http_responses_total{")]  # fmt: skip
        return status, body, counted

    status, body, counted = asyncio.run(scenario())
    assert status == 503, body
    assert body["error"]["message"].startswith(
        "the server is shutting down (its grace period is over); retry"
    )
    assert counted == ['epd_http_responses_total{code="503",route="/health"} 1.0'], counted


@pytest.mark.parametrize(
    ("grace_s", "hurry", "why"),
    [
        (0.5, False, "its grace period was over"),
        (30.0, True, "a second stop signal ended its drain"),  # it said "its grace period was over"
    ],
)
def test_a_grpc_answer_cut_at_the_end_of_the_grace_period_is_aborted_with_its_request_id(grace_s, hurry, why):
    """gRPC's own stop cancelled it as UNAVAILABLE "Cancelling all calls" (after 955 tokens in the
    audit's run): a status clients and proxies retry as if nothing had happened, without the
    request id. The gateway now ends it itself, ABORTED after tokens, saying what ended the drain."""
    import grpc

    from epd.gateway.server import start
    from epd.transport.server import StopSignals, serve_until_signal
    from epd.v1 import gateway_pb2, gateway_pb2_grpc

    async def scenario():
        config = GatewayConfig(server=ServerConfig(host="127.0.0.1", port=0, grace_s=grace_s))
        hs = await start(config, EndlessAnswer())
        await hs.set_serving()
        signals = StopSignals()
        serving = asyncio.ensure_future(serve_until_signal(hs, config.server.grace_s, signals=signals))
        header = gateway_pb2.AskHeader(
            request_id="cut-at-grace", question="what happens?", media_num_bytes=64
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
            call = gateway_pb2_grpc.GatewayServiceStub(channel).Ask(
                iter([gateway_pb2.AskRequest(header=header), gateway_pb2.AskRequest(media_chunk=b"v" * 64)])
            )
            tokens = 0
            try:
                async for response in call:
                    tokens += len(response.delta.token_ids)
                    if tokens == 3:
                        signals.stop.set()  # SIGTERM with the answer streaming
                    if tokens == 6 and hurry:
                        signals.hurry.set()  # a second SIGTERM
            except grpc.aio.AioRpcError as exc:
                error = exc
        await asyncio.wait_for(serving, timeout=30)
        return tokens, error.code(), error.details()

    tokens, code, details = asyncio.run(scenario())
    assert code == grpc.StatusCode.ABORTED, (code, details)
    assert details == (
        f"the server shut down after {tokens} tokens ({why}); the answer is "
        "incomplete; retry the request (request id cut-at-grace)"
    )


class CutWhileSending(EndlessAnswer):
    """Asks for the cut right after its third token, so that it lands while gRPC, not the
    gateway, holds the call's task: sending that token (its write awaits the completion queue)."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = lambda: None

    async def ask(self, req):  # type: ignore[override]
        for n in range(1, 1000):
            await asyncio.sleep(0.02)
            if n == 3:
                asyncio.get_running_loop().call_soon(self.cut)  # runs once the task waits on the send
            yield TokenStep([7], "a")


def test_a_grpc_answer_cut_while_grpc_sends_a_token_is_still_aborted_with_its_request_id():
    """A cut that cancelled the task inside gRPC's send raised CancelledError in gRPC's code, which
    swallows it: the call ended UNAVAILABLE "Cancelling all calls" at gRPC's own stop (a flaky
    failure of the test above, 1 run in ~100). A call being sent is now cut when it resumes."""
    import grpc

    from epd.gateway.server import start
    from epd.v1 import gateway_pb2, gateway_pb2_grpc

    async def scenario():
        pipeline = CutWhileSending()
        config = GatewayConfig(server=ServerConfig(host="127.0.0.1", port=0, grace_s=0.5))
        hs = await start(config, pipeline)
        await hs.set_serving()
        pipeline.cut = hs.cut_calls.__self__.in_flight.cut  # type: ignore[union-attr]
        header = gateway_pb2.AskHeader(
            request_id="cut-while-sending", question="what happens?", media_num_bytes=64
        )
        tokens = 0
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
                call = gateway_pb2_grpc.GatewayServiceStub(channel).Ask(
                    iter(
                        [gateway_pb2.AskRequest(header=header), gateway_pb2.AskRequest(media_chunk=b"v" * 64)]
                    )
                )

                async def read() -> None:
                    nonlocal tokens
                    async for response in call:
                        tokens += len(response.delta.token_ids)

                try:
                    await asyncio.wait_for(read(), 10)
                except grpc.aio.AioRpcError as exc:
                    return tokens, exc.code(), exc.details()
                except TimeoutError:  # gRPC swallowed the cancel: no status until its own stop
                    return tokens, None, "no status within 10 s of the cut"
                return tokens, None, "the answer ran to its end"
        finally:
            await hs.server.stop(None)

    tokens, code, details = asyncio.run(scenario())
    assert code == grpc.StatusCode.ABORTED, (code, details)
    assert details == (
        f"the server shut down after {tokens} tokens (its grace period was over); the answer is "
        "incomplete; retry the request (request id cut-while-sending)"
    )


def test_cut_cancels_a_call_in_the_gateway_s_code_and_one_being_sent_when_it_resumes():
    """The bookkeeping alone (`CallsInFlight`), without gRPC: what `cut` does to each call."""
    from epd.gateway.shutdown import CallsInFlight

    async def scenario():
        in_flight = CallsInFlight()
        sent = asyncio.Event()
        outcomes: dict[str, str] = {}

        async def answer(name: str, at_send: bool) -> None:
            with in_flight.tracking() as call:
                try:
                    if at_send:
                        with call.sending():
                            await sent.wait()  # gRPC's send: a cancel here would be gRPC's to swallow
                        outcomes[name] = "resumed past the cut"
                    else:
                        await asyncio.sleep(60)
                except asyncio.CancelledError:
                    outcomes[name] = (
                        "cut (cancelled)" if not at_send or sent.is_set() else "cancelled inside the send"
                    )
                    raise

        tasks = [
            asyncio.ensure_future(answer("working", False)),
            asyncio.ensure_future(answer("sending", True)),
        ]
        await asyncio.sleep(0.01)
        cut = in_flight.cut()
        await asyncio.sleep(0.01)
        still_sending = not tasks[1].done()
        sent.set()
        await asyncio.wait(tasks, timeout=5)
        return in_flight.cutting, len(cut), still_sending, outcomes

    cutting, num_cut, still_sending, outcomes = asyncio.run(scenario())
    assert cutting and num_cut == 2
    assert still_sending  # left to finish its send
    assert outcomes == {"working": "cut (cancelled)", "sending": "cut (cancelled)"}, outcomes
