"""A raw-bytes gRPC service for plumbing tests: real grpc.aio servers on 127.0.0.1 port 0 in
this process, methods registered with a generic handler (no protos needed)."""

from __future__ import annotations

import asyncio

import grpc

SERVICE = "epd.test.Plumbing"


async def start_server(methods: dict[str, grpc.RpcMethodHandler]) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    assert port, "could not bind a loopback port"
    await server.start()
    return server, f"127.0.0.1:{port}"


async def connected(*channels: grpc.aio.Channel, timeout_s: float = 30.0) -> None:
    """Wait until each channel is READY (connected to its server).

    gRPC shares subchannels process-wide between channels with the same address and arguments. A
    channel another test left open to a server since stopped keeps that address's subchannel in
    reconnect backoff ("Connection refused"), and a server started later on the same port (the
    kernel hands port-0 ports out again) is then called through it: its first calls fail
    UNAVAILABLE until the backoff ends (up to 2 s with the stage channels' RECONNECT_OPTIONS). A
    test whose point is not reconnection waits for READY first, so that its calls reach its own
    server. (tests/leak_check.py now fails a test that leaves a channel open. The leak found that
    did this: an integration test's gateway pipeline never closed, its replica pools' channels
    reconnecting to its stack's ports, which a later unit test's server could get.)"""
    await asyncio.wait_for(asyncio.gather(*(channel.channel_ready() for channel in channels)), timeout_s)


def unary(channel: grpc.aio.Channel, method: str):
    return channel.unary_unary(f"/{SERVICE}/{method}")


def server_stream(channel: grpc.aio.Channel, method: str):
    return channel.unary_stream(f"/{SERVICE}/{method}")
