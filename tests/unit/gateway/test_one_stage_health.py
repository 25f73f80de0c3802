"""The gateway's HTTP /health and its gRPC health (readiness) are one view of its stages: `main`
builds one `StageHealth` for both. It built two, one per API: each checked the stages on its own
(twice the health RPCs, no shared check in flight), kept its own record of which replicas were
down, and each logged the same replica going down.

Real grpc.aio servers on loopback in this process: one stand-in answers grpc.health for all three
stages, SERVING or NOT_SERVING as the test sets it; the gateway's `main` runs over it with both
APIs, until its stop signal."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epd.gateway import server as gateway
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.readiness import StageHealth
from epd.stages.server_config import ServerConfig
from epd.transport.ports_file import read_ports_file
from epd.transport.server import StopSignals

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DOWN_LINE = "stage replicas not serving"
"""What the gateway logs (WARNING) when a replica goes down: once per replica and change."""


async def _stage(status: int) -> tuple[grpc.aio.Server, str, health.aio.HealthServicer]:
    """A stand-in stage that answers grpc.health with `status` (settable later), nothing else."""
    servicer = health.aio.HealthServicer()
    await servicer.set("", status)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", servicer


async def _until(probe, want, what: str):
    """Until `await probe()` == `want` (a deadline, not a timing)."""
    got = None
    for _ in range(600):
        got = await probe()
        if got == want:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: {got!r}, not {want!r}")


def test_http_health_and_grpc_readiness_are_one_stage_health(monkeypatch, tmp_path, caplog):
    made: list[StageHealth] = []

    class Recorded(StageHealth):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(gateway, "StageHealth", Recorded)

    async def scenario() -> None:
        stage, address, stage_health = await _stage(SERVING)
        signals = StopSignals()
        monkeypatch.setattr(gateway, "StopSignals", lambda: signals)
        ports_file = tmp_path / "ports.json"
        config = GatewayConfig(server=ServerConfig(host="127.0.0.1", port=0, ports_file=str(ports_file)),
                               http=HttpApiConfig(host="127.0.0.1", port=0),
                               encoder_addresses=(address,), prefill_addresses=(address,), decode_addresses=(address,),
                               stage_check_interval_s=0.1)  # fmt: skip
        running = asyncio.ensure_future(gateway.main(config))
        try:
            for _ in range(600):  # until both listen: the ports file names them (a deadline, not a timing)
                if (bound := read_ports_file(str(ports_file))) is not None:
                    break
                await asyncio.sleep(0.05)
            assert bound is not None, "the gateway did not start"
            async with (
                aiohttp.ClientSession() as session,
                grpc.aio.insecure_channel(f"127.0.0.1:{bound['grpc']}") as channel,
            ):

                async def http_health() -> tuple[int, list[str]]:
                    async with session.get(f"http://127.0.0.1:{bound['http']}/health") as resp:
                        return resp.status, (await resp.json()).get("not_serving", [])

                async def readiness() -> int:
                    check = health_pb2_grpc.HealthStub(channel).Check
                    return (await check(health_pb2.HealthCheckRequest(), timeout=5)).status

                await _until(readiness, SERVING, "gRPC readiness with the stages up")
                await _until(http_health, (200, []), "HTTP /health with the stages up")
                await stage_health.set("", NOT_SERVING)  # every stage down
                await _until(
                    http_health, (503, ["decode", "encoder", "prefill"]), "HTTP /health, stages down"
                )
                await _until(readiness, NOT_SERVING, "gRPC readiness, stages down")
                await stage_health.set("", SERVING)
                await _until(readiness, SERVING, "gRPC readiness, stages back")
                await _until(http_health, (200, []), "HTTP /health, stages back")
            signals.stop.set()
            await asyncio.wait_for(running, 60)
        finally:
            if not running.done():
                signals.hurry.set()
                await asyncio.gather(running, return_exceptions=True)
            await stage.stop(0)

    with caplog.at_level(logging.INFO, logger="epd.gateway.readiness"):
        asyncio.run(scenario())
    assert len(made) == 1, made  # one StageHealth, both APIs' view
    down = [r.getMessage() for r in caplog.records if r.getMessage().startswith(DOWN_LINE)]
    assert len(down) == 1, down  # the replicas went down once: one line, not one per API
