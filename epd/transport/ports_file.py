"""The ports a service bound, in a JSON file (`--ports-file`): how a launcher, a test or a script
learns the port the kernel picked for `--port 0` (`--http-port auto`) instead of picking a free port
itself, closing it and passing it on, which another process could take in between.

A service's file is `{"grpc": PORT}`, the gateway's with `"http": PORT` when it serves HTTP; the
stack's (`epd serve`) also lists each stage's replicas' ports (`"encoder": [PORT, ...]`). Written
beside the path, then renamed over it: a reader polling for the file never reads half of it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any


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
