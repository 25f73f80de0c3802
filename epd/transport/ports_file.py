"""The ports a service bound, in a JSON file (`--ports-file`): how a launcher, a test or a script
learns the port the kernel picked for `--port 0` (`--http-port auto`) instead of picking a free port
itself, closing it and passing it on, which another process could take in between.

A service's file is `{"grpc": PORT}`, the gateway's with `"http": PORT` when it serves HTTP; the
stack's (`epd serve`) also lists each stage's replicas' ports (`"encoder": [PORT, ...]`). Written
beside the path, then renamed over it: a reader polling for the file never reads half of it.

Where the port must be known before the server binds it (a client dialing a gateway not started
yet; a server that cannot bind port 0 and say which it got: `transformers serve`, an epd revision
from before --ports-file), `free_port` picks one and holds it until the process exits (the tests'
and the bench scripts' one helper)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any

_held: dict[int, socket.socket] = {}


def write_ports_file(path: str, ports: Mapping[str, Any]) -> None:
    staging = f"{path}.{os.getpid()}.tmp"
    with open(staging, "w") as f:
        json.dump(ports, f)
        f.write("\n")
    os.replace(staging, path)


def read_ports_file(path: str) -> dict[str, Any] | None:
    """The ports in `path`; None while it is not there (the service has not bound yet)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def free_port() -> int:
    """A loopback port nothing listens on, held for this process until it exits, for a server
    told to listen there. Held by a socket bound to it with SO_REUSEADDR that never listens: the
    kernel hands it to no port-0 bind (of any process: a server another test, bench or parallel run
    starts), while a server told to listen on it binds it (gRPC, aiohttp and uvicorn, through
    asyncio's `create_server`, bind with SO_REUSEADDR, which only a listening socket refuses);
    dialed, it refuses connections as a free port does. A port closed and passed on could be
    taken by another process before the server binds it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    _held[port] = sock
    return port
