"""A raw-bytes gRPC service for plumbing tests: real grpc.aio servers on 127.0.0.1 port 0 in
this process, methods registered with a generic handler (no protos needed)."""

from __future__ import annotations

import grpc

SERVICE = "epd.test.Plumbing"


async def start_server(methods: dict[str, grpc.RpcMethodHandler]) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    assert port, "could not bind a loopback port"
    await server.start()
    return server, f"127.0.0.1:{port}"


def unary(channel: grpc.aio.Channel, method: str):
    return channel.unary_unary(f"/{SERVICE}/{method}")


def server_stream(channel: grpc.aio.Channel, method: str):
    return channel.unary_stream(f"/{SERVICE}/{method}")
