"""The HTTP API served (`start_http_api`): the aiohttp runner and its TLS site on the gateway's
event loop, and its stop (`HttpServer.stop`), which gives the requests in flight the grace period
and then cuts the rest."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web

from epd.gateway.admission import Admission
from epd.gateway.config import GatewayConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.gateway.protocol_log import CLIENT_FAULTS, PROTOCOL_LOG
from epd.gateway.readiness import InProcessHealth, StageHealth
from epd.transport.security import server_ssl_context
from epd.transport.server import CUT_MARGIN_S

log = logging.getLogger(__name__)


@dataclass
class HttpServer:
    runner: web.AppRunner
    port: int
    api: HttpApi
    stage_health: StageHealth | InProcessHealth | None = None

    async def stop(self, grace_s: float = 0.0, hurry: asyncio.Event | None = None) -> None:
        """Stop listening, give the requests in flight `grace_s` (until `hurry` is set, the second
        signal), then cut the rest. aiohttp's own drain (`shutdown_timeout`) waits that long, then
        only cancels a request's body reading and waits as long again: a streamed answer ran on
        for twice the grace period, and a second signal did not shorten it."""
        cleanup = asyncio.ensure_future(self.runner.cleanup())
        waits: list[asyncio.Future] = [cleanup]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        if not cleanup.done():
            await self.api.cut_requests_in_flight(CUT_MARGIN_S, hurried=hurry is not None and hurry.is_set())
        await cleanup
        for wait in waits[1:]:
            wait.cancel()
        if self.stage_health is not None:
            await self.stage_health.close()


async def start_http_api(
    config: GatewayConfig,
    pipeline: Pipeline,
    metrics: GatewayMetrics,
    stage_health: StageHealth | InProcessHealth | None = None,
    admission: Admission | None = None,
) -> HttpServer:
    """Serve the HTTP API on `config.http.port` (0 binds a free port: `HttpServer.port`);
    `admission` is shared with the gRPC API so that a client's limit counts both."""
    api = HttpApi(config, pipeline, metrics, stage_health.not_serving if stage_health else None, admission)
    # handler_cancellation: a client that disconnects stops its pipeline run.
    # logger: a client's malformed request is one INFO line there, not an ERROR traceback, and
    # at most one a minute.
    CLIENT_FAULTS.reset()
    runner = web.AppRunner(
        api.app(),
        access_log=None,
        handler_cancellation=True,
        logger=PROTOCOL_LOG,
        shutdown_timeout=config.server.grace_s,
    )  # `HttpServer.stop` cuts it short
    await runner.setup()
    # TLS with the gateway's --tls-cert/--tls-key (client certificates with --tls-client-ca).
    site = web.TCPSite(
        runner,
        config.http.host or config.server.host,
        config.http.port,
        ssl_context=server_ssl_context(config.server.security),
    )
    await site.start()
    port = runner.addresses[0][1]
    log.info("OpenAI-compatible HTTP API on port %d", port)
    return HttpServer(runner, port, api, stage_health)
