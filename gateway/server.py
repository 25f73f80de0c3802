"""Start the front door: `start(config)` for tests, `main(config)` for `epd serve gateway`."""

from __future__ import annotations

import logging

from gateway.config import GatewayConfig
from gateway.pipeline import Pipeline
from gateway.servicer import SERVICE_NAME, GatewayServicer
from protos.epd.v1 import gateway_pb2_grpc
from stages.remote import (
    RemoteDecodeStage,
    RemoteEncodeStage,
    RemotePrefillStage,
    ReplicaPool,
)
from transport.server import HealthyServer, create_server, serve_until_signal

log = logging.getLogger(__name__)


def remote_pipeline(config: GatewayConfig) -> Pipeline:
    t = config.stage_timeout_s
    return Pipeline(
        RemoteEncodeStage(ReplicaPool(list(config.encoder_addresses)), t, config.max_transfer_bytes),
        RemotePrefillStage(ReplicaPool(list(config.prefill_addresses)), t),
        RemoteDecodeStage(ReplicaPool(list(config.decode_addresses)), t),
    )


async def start(config: GatewayConfig) -> HealthyServer:
    servicer = GatewayServicer(config, remote_pipeline(config))
    hs = await create_server(
        config.server, lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s), [SERVICE_NAME]
    )
    await hs.set_serving(True)
    log.info("gateway serving on port %d", hs.port)
    return hs


async def main(config: GatewayConfig) -> None:
    hs = await start(config)
    await serve_until_signal(hs, config.server.grace_s)
