"""The gateway refuses to start open beyond loopback: a non-loopback gRPC or HTTP interface needs
--api-key (or $EPD_API_KEY) or the explicit --no-api-key. Real `epd serve gateway` processes;
the only one that binds anything binds 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.gateway.config import GatewayConfig, HttpApiConfig, open_without_key
from epd.stages.server_config import ServerConfig
from tests.stack import bound_ports


def _epd(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "EPD_API_KEY"}
    return subprocess.Popen(
        [sys.executable, "-m", "epd.cli.main", "serve", "gateway", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _config(host: str, http_port: int | None = None, http_host: str = "", **key) -> GatewayConfig:
    return GatewayConfig(
        server=ServerConfig(host=host, port=50050), http=HttpApiConfig(port=http_port, host=http_host, **key)
    )


@pytest.mark.parametrize(
    "config, refused",
    [
        (_config("0.0.0.0"), "gRPC on 0.0.0.0 (--host)"),
        (_config(""), "gRPC on * (--host)"),
        (_config("10.0.0.5"), "gRPC on 10.0.0.5"),
        (_config("::"), "gRPC on ::"),
        (_config("127.0.0.1", http_port=8000, http_host="0.0.0.0"), "HTTP on 0.0.0.0"),
        (_config("0.0.0.0", http_port=8000), "gRPC on 0.0.0.0 (--host) and HTTP on 0.0.0.0"),
        (_config("0.0.0.0", api_keys=("k",), no_api_key=True), "pass one of them"),
        # loopback, a key, or the explicit opt-out: starts
        (_config("127.0.0.1", http_port=8000), None),
        (_config("localhost", http_port=8000, http_host="::1"), None),
        (_config("[::1]"), None),
        (_config("0.0.0.0", http_port=8000, api_keys=("k",)), None),
        (_config("0.0.0.0", http_port=8000, no_api_key=True), None),
        (_config("127.0.0.1", http_port=None, http_host="0.0.0.0"), None),  # HTTP off
        (_config("127.0.0.1", http_port=0, http_host="0.0.0.0"), "HTTP on 0.0.0.0"),  # a free port
    ],
)
def test_open_without_key(config, refused):
    problem = open_without_key(config)
    if refused is None:
        assert problem is None
    else:
        assert refused in problem and "--api-key" in problem and "--no-api-key" in problem


def test_a_gateway_on_every_interface_without_a_key_exits_before_binding(tmp_path):
    ports_file = tmp_path / "ports.json"
    proc = _epd("--host", "0.0.0.0", "--port", "0", "--ports-file", str(ports_file))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2  # a usage error, as every other bad flag value
    assert err.strip().splitlines() == [
        "epd serve gateway: refusing to serve gRPC on 0.0.0.0 (--host) without an API key: set --api-key "
        "KEY (or $EPD_API_KEY), bind 127.0.0.1, or pass --no-api-key on a closed, trusted network"
    ]
    assert not ports_file.exists()  # nothing was bound: a server writes the file once it listens


def test_a_loopback_gateway_starts_without_a_key(tmp_path):
    """`epd serve` (no role) runs its gateway like this, so it keeps working with no key."""
    proc = _epd("--host", "127.0.0.1", "--port", "0", "--ports-file", str(tmp_path / "ports.json"))
    try:
        port = bound_ports(tmp_path / "ports.json", proc, "the gateway")["grpc"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, proc.communicate()[1]
                try:  # NOT_SERVING until its stages answer (none run here): answering is enough
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "the gateway never answered health"
                    time.sleep(0.2)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_an_api_key_on_the_command_line_is_hidden_from_ps(tmp_path):
    """`ps` (/proc/PID/cmdline) shows every local user each process's command line: the key of
    `--api-key KEY` stayed there for as long as the gateway ran."""
    import psutil

    from epd.cmdline.secret_flags import hide_secrets

    assert hide_secrets(["serve", "--api-key", "k1", "--api-key=k2", "--port", "1"]) == [
        "serve",
        "--api-key",
        "***",
        "--api-key=***",
        "--port",
        "1",
    ]
    assert hide_secrets(["serve", "--api-key-file", "/keys"]) is None
    key = "key-nobody-else-may-read"
    proc = _epd(
        "--host", "127.0.0.1", "--port", "0", "--ports-file", str(tmp_path / "ports.json"), "--api-key", key
    )
    try:
        port = bound_ports(tmp_path / "ports.json", proc, "the gateway")["grpc"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # answering health: the flags are parsed
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, proc.communicate()[1]
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "the gateway never answered health"
                    time.sleep(0.2)
        shown = " ".join(psutil.Process(proc.pid).cmdline())
        assert (
            key not in shown
            and "--api-key ***" in shown
            and f"--ports-file {tmp_path / 'ports.json'}" in shown
        ), shown
    finally:
        proc.terminate()
        proc.wait(timeout=60)
