"""epd/transport/ports_file.py's `free_port`, the tests' and the bench scripts': a loopback port
known before anything listens there (a gateway a client dials before it starts, a replica that is
down, a `transformers serve` the bench starts), held so that no other process takes it meanwhile,
and bound by the server started there."""

from __future__ import annotations

import asyncio
import errno
import importlib
import socket
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from epd.transport.ports_file import free_port


def test_a_free_port_refuses_calls_and_is_bound_only_by_the_server_told_to():
    port = free_port()
    with socket.socket() as caller:
        assert caller.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED  # as when nothing holds it
    with socket.socket() as other, pytest.raises(OSError) as err:
        other.bind(("127.0.0.1", port))  # another process's bind (a port-0 bind is never handed it)
    assert err.value.errno == errno.EADDRINUSE
    pool = ThreadPoolExecutor(max_workers=1)
    server = grpc.server(pool, options=[("grpc.so_reuseport", 0)])  # as epd's servers bind
    try:
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        server.start()
        with socket.create_connection(("127.0.0.1", port), timeout=5.0):
            pass
    finally:
        server.stop(None)
        pool.shutdown()
    assert free_port() != port


def test_a_server_bound_through_asyncio_binds_a_free_port():
    """uvicorn (`transformers serve`, which the bench starts on a port it picks) and aiohttp bind
    through asyncio's `create_server`, with SO_REUSEADDR on Linux: the held port is theirs to bind."""
    port = free_port()

    async def serve_once() -> None:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", port)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()

    asyncio.run(serve_once())


@pytest.mark.parametrize(
    "script", ["bench_startup", "bench_prefill_tokenizer", "bench_vs_transformers_serve"]
)
def test_the_bench_scripts_hold_the_ports_they_pick(script):
    """The bench scripts that start a server on a port they pick (an epd revision from before
    --ports-file, `transformers serve`) hold it until they exit. Before, bench/common.py's own
    copy closed it and passed the number on: another process could bind it in between."""
    port = importlib.import_module(f"bench.{script}").free_port()
    with socket.socket() as other, pytest.raises(OSError) as err:
        other.bind(("127.0.0.1", port))
    assert err.value.errno == errno.EADDRINUSE
