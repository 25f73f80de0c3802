"""The launcher's look at a port before it restarts a service there (epd/cli/port_holder.py), on
real sockets: taken while another socket listens on it or holds it bound, free once that one is
closed, even with the connections it served still in TIME_WAIT (as gRPC binds, SO_REUSEADDR); the
holder of a listening port named."""

from __future__ import annotations

import os
import socket

from epd.cli.port_holder import port_holder, port_taken


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a gRPC server's
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_listening_port_is_taken_and_its_holder_named():
    with _listening() as sock:
        port = sock.getsockname()[1]
        assert port_taken("127.0.0.1", port)
        holder = port_holder(port)
        assert holder is not None and holder.startswith(f"pid {os.getpid()} ("), holder
    assert not port_taken("127.0.0.1", port)
    assert port_holder(port) is None


def test_a_bound_socket_that_does_not_listen_holds_its_port_too():
    """Taken, though /proc/net/tcp lists no such socket: its holder is not known."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert port_taken("127.0.0.1", port)


def test_the_connections_a_closed_server_leaves_in_time_wait_do_not_hold_its_port():
    """The server closes first, as a killed service's sockets are: its side of the connection stays
    in TIME_WAIT on its port for a minute, which a restart on that port must not take as taken."""
    listener = _listening()
    port = listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)) as client:
        served, _ = listener.accept()
        served.close()  # the active close: TIME_WAIT is on the server's side, port `port`
        listener.close()
        assert client.recv(1) == b""  # the FIN reached the client
    assert not port_taken("127.0.0.1", port)
    assert port_holder(port) is None
