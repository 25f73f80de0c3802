"""The gateway's pipeline over remote stages closes everything it opened (`Pipeline.aclose`): the
three stages' replica pools and prefill's KV release channels. Before, `RemotePrefillStage.close`
closed only the KV channels, nothing closed the pools, and the gateway's stop left them all open:
they kept reconnecting to the stages during the drain and until the process exited, and a test
that ran a pipeline in-process had to close each pool by hand.

Real grpc.aio servers on loopback in this process: a prefill stand-in that answers ReleaseKv and
Tokenize (the stage the HTTP API's /tokenize calls through the pool). Which channels were opened,
and whether each was closed, is what tests/leak_check.py records of every grpc channel."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.gateway import server as gateway
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.metrics import GatewayMetrics, MeteredPipeline
from epd.gateway.server import remote_pipeline
from epd.stages.contracts import PrefillHandle
from epd.stages.server_config import ServerConfig
from epd.transport.ports_file import read_ports_file
from epd.transport.server import LIVENESS_SERVICE, StopSignals
from epd.v1 import prefill_pb2, prefill_pb2_grpc
from tests import leak_check


class _Prefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Answers ReleaseKv at once; Tokenize once `answer` is set (`asked` says it has one)."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()

    async def ReleaseKv(self, request, context):
        return prefill_pb2.ReleaseKvResult()

    async def Tokenize(self, request, context):
        self.asked.set()
        await self.answer.wait()
        return prefill_pb2.TokenizeResult(token_ids=[1, 2, 3])


async def _prefill_server() -> tuple[grpc.aio.Server, str, _Prefill]:
    servicer = _Prefill()
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", servicer


def _channels_since(first_serial: int, address: str) -> list[leak_check.Opened]:
    """The grpc.aio channels to `address` made since `first_serial`, as the leak check recorded them."""
    return [rec for serial, rec in list(leak_check._records.items())
            if serial > first_serial and rec.kind == "grpc.aio channel" and rec.target == address]  # fmt: skip


@pytest.fixture(autouse=True)
def _leak_check_on():
    if leak_check.MODE == "off":
        pytest.skip("EPD_LEAK_CHECK=off: the channels are not recorded")


def test_closing_a_remote_pipeline_closes_its_pools_and_kv_channels_and_can_be_done_twice():
    async def scenario() -> tuple[int, list[bool], list[bool]]:
        server, address, _ = await _prefill_server()
        try:
            first = leak_check.begin_test().first_serial
            config = GatewayConfig(encoder_addresses=(address,), prefill_addresses=(address,),
                                   decode_addresses=(address,))  # fmt: skip
            # As the gateway's main holds it: metered, closed through the wrapper.
            pipeline = MeteredPipeline(remote_pipeline(config), GatewayMetrics())
            handle = PrefillHandle(first_token_id=0, num_prompt_tokens=1, num_cached_tokens=0, next_position_ids=[1],
                                   kv_num_bytes=0, prefill_ms=0.0, kv_handle="h", kv_address=address)  # fmt: skip
            await pipeline.prefill.release(handle, "r")  # opens a KV release channel
            opened = _channels_since(first, address)
            before = [rec.done for rec in opened]
            await pipeline.aclose()
            await pipeline.aclose()  # idempotent
            return len(opened), before, [rec.done for rec in opened]
        finally:
            await server.stop(0)

    num_opened, before, after = asyncio.run(scenario())
    assert num_opened == 4  # three pools' and one KV release channel
    assert not any(before)
    assert all(after), after  # the pools' three stayed open


def test_the_gateway_closes_its_stage_channels_after_its_drain_and_a_call_in_the_drain_completes(
    monkeypatch, tmp_path
):
    """`epd serve gateway`'s main: stopped while an HTTP /tokenize waits on prefill, it drains (the
    call completes through the prefill pool), then closes the stages' channels."""

    async def scenario() -> tuple[int, str, list[bool], list[bool]]:
        server, address, prefill = await _prefill_server()
        signals = StopSignals()
        monkeypatch.setattr(gateway, "StopSignals", lambda: signals)
        ports_file = tmp_path / "ports.json"  # both ports free ones the kernel picks, named there
        config = GatewayConfig(server=ServerConfig(host="127.0.0.1", port=0, grace_s=30.0, ports_file=str(ports_file)),
                               http=HttpApiConfig(host="127.0.0.1", port=0),
                               encoder_addresses=(address,), prefill_addresses=(address,), decode_addresses=(address,),
                               stage_check_interval_s=3600.0)  # fmt: skip
        first = leak_check.begin_test().first_serial
        running = asyncio.ensure_future(gateway.main(config))
        try:
            for _ in range(600):  # until both listen (a deadline, not a timing)
                if (bound := read_ports_file(str(ports_file))) is not None:
                    break
                await asyncio.sleep(0.05)
            port, grpc_port = bound["http"], bound["grpc"]
            async with aiohttp.ClientSession() as session:
                for _ in range(600):  # until the HTTP API listens (a deadline, not a timing)
                    try:
                        async with session.get(f"http://127.0.0.1:{port}/version"):
                            break
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.05)
                answer = asyncio.ensure_future(
                    session.post(
                        f"http://127.0.0.1:{port}/tokenize",
                        data=json.dumps({"prompt": "hello"}),
                        headers={"Content-Type": "application/json"},
                    )
                )
                await asyncio.wait_for(prefill.asked.wait(), 30)
                signals.stop.set()  # SIGTERM with the call in flight
                await _draining(grpc_port)
                opened = _channels_since(first, address)
                during = [rec.done for rec in opened]
                prefill.answer.set()
                async with await answer as resp:
                    status, body = resp.status, await resp.json()
            await asyncio.wait_for(running, 60)
            return status, json.dumps(body), during, [rec.done for rec in _channels_since(first, address)]
        finally:
            prefill.answer.set()
            if not running.done():
                signals.hurry.set()
                await asyncio.gather(running, return_exceptions=True)
            await server.stop(0)

    status, body, during, after = asyncio.run(scenario())
    assert status == 200 and json.loads(body)["tokens"] == [1, 2, 3], body
    assert during and not any(during), during  # open while the drain lasts
    assert len(after) >= 3 and all(after), after  # every channel to the stages closed at the stop


async def _draining(grpc_port: int) -> None:
    """Until the gateway has begun its drain: its liveness is no longer SERVING (gRPC's graceful
    shutdown sets NOT_SERVING, then the server takes no new call)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for _ in range(600):  # a deadline, not a timing
            try:
                reply = await check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE), timeout=5)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the gateway did not begin its drain")
