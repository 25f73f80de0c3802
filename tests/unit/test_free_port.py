"""tests/stack.py's `free_port`: a loopback port known before anything listens there (a gateway a
client dials before it starts, a replica that is down), held so that no other process takes it
meanwhile, and bound by the server the test starts there."""

from __future__ import annotations

import errno
import socket
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.stack import free_port


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
