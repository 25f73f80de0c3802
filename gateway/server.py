"""Start the front door: `start(config)` for tests, `main(config)` for `epd serve gateway`.

`main` serves gRPC and, when `config.http.port` is set, the OpenAI-compatible HTTP API in the
same event loop, both over one metered pipeline.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics, MeteredPipeline
from gateway.pipeline import Pipeline
from gateway.readiness import wait_for_stages
from gateway.servicer import SERVICE_NAME, GatewayServicer
from protos.epd.v1 import gateway_pb2_grpc
from stages.remote import (
    RemoteDecodeStage,
    RemoteEncodeStage,
    RemotePrefillStage,
    ReplicaPool,
)
from transport.auth import ApiKeyInterceptor
from transport.server import HealthyServer, create_server, serve_until_signal

log = logging.getLogger(__name__)


def remote_pipeline(config: GatewayConfig) -> Pipeline:
    t = config.stage_timeout_s
    return Pipeline(
        RemoteEncodeStage(ReplicaPool(list(config.encoder_addresses)), t, config.max_transfer_bytes),
        RemotePrefillStage(ReplicaPool(list(config.prefill_addresses)), t),
        RemoteDecodeStage(ReplicaPool(list(config.decode_addresses)), t),
    )


async def start(config: GatewayConfig, pipeline: Pipeline | None = None) -> HealthyServer:
    servicer = GatewayServicer(config, pipeline or remote_pipeline(config))
    # The HTTP API's key (--api-key) guards the gRPC API too; health and reflection stay open.
    interceptors = [ApiKeyInterceptor(config.http.api_key, (f"/{SERVICE_NAME}/",))] if config.http.api_key else []
    hs = await create_server(
        config.server,
        lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
        [SERVICE_NAME],
        interceptors,
    )
    stages = [*config.encoder_addresses, *config.prefill_addresses, *config.decode_addresses]

    async def become_ready() -> None:
        await wait_for_stages(stages)
        await hs.set_serving(True)
        log.info("gateway serving on port %d", hs.port)

    hs.background_tasks.append(asyncio.ensure_future(become_ready()))
    return hs


async def main(config: GatewayConfig) -> None:
    metrics = GatewayMetrics()
    pipeline = MeteredPipeline(remote_pipeline(config), metrics)
    http = None
    if config.http.port:
        from gateway.http_api import StageHealth, start_http_api  # aiohttp only when asked for

        http = await start_http_api(config, pipeline, metrics, StageHealth(config))
    hs = await start(config, pipeline)
    try:
        await serve_until_signal(hs, config.server.grace_s)
    finally:
        if http is not None:
            await http.stop()
