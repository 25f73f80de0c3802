"""A gateway given `--prefill dns:///localhost:PORT,dns:///localhost:DEAD` (real processes on
loopback) looks the names up itself and routes over one replica per address they resolve to:
/metrics labels each by its address (none by a name), the answer is the plain stack's. Nothing
listens on DEAD, and the prefill server listens on 127.0.0.1 only (where /etc/hosts also gives
localhost ::1, [::1]:PORT refuses connections too): such replicas are unavailable replicas the
router goes around, not an error at start."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from epd.cli.health import health_answer
from epd.client import EpdClient
from epd.gateway.dns_replicas import replica_address
from epd.transport.ports_file import free_port
from tests.stack import ROOT, Stack, bound_ports, child_env, gateway_over

QUESTION = "what colour is the moving square?"
OPTIONS = {"num_frames": 4, "max_new_tokens": 6}
WAIT_S = 30.0  # a deadline for the first scrape to reach a replica, not a timing assertion


def _labels(port: int, sample_name: str, stage: str) -> set[str]:
    """The `replica` labels of `stage`'s `sample_name` samples on the gateway's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {
        sample.labels["replica"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == sample_name and sample.labels["stage"] == stage
    }


def test_a_dns_name_is_routed_as_one_replica_per_address(tmp_path, shared_stack, media_files):
    dead = free_port()  # nothing listens there, and no other process can take it

    def gateway_flags(stack: Stack) -> list[str]:
        return ["--prefill", f"dns:///localhost:{stack.ports['prefill']},dns:///localhost:{dead}"]

    # A gateway of its own (its --prefill is the DNS name) over the session's stages.
    with gateway_over(shared_stack, tmp_path / "logs", gateway_flags, http=True) as stack:
        port, http_port = stack.ports["prefill"], stack.http_port
        resolved = {replica_address(info[4][0], p) for p in (port, dead)
                    for info in socket.getaddrinfo("localhost", p, type=socket.SOCK_STREAM)}  # fmt: skip
        assert {f"127.0.0.1:{port}", f"127.0.0.1:{dead}"} <= resolved
        with EpdClient(stack.gateway, timeout_s=120) as client:
            answer = client.ask(media_files["mp4"], QUESTION, **OPTIONS)
        # Every replica has an error series, answering or not: the router's replicas are the addresses.
        assert _labels(http_port, "epd_load_scrape_errors_total", "prefill") == resolved
        deadline = time.monotonic() + WAIT_S
        while (answering := _labels(http_port, "epd_engine_steps_total", "prefill")) != {f"127.0.0.1:{port}"}:
            assert time.monotonic() < deadline, answering
            time.sleep(0.2)
        gateway_log = (stack.log_dir / "gateway.log").read_text()
    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        plain = client.ask(media_files["mp4"], QUESTION, **OPTIONS)
    assert answer.token_ids == plain.token_ids and answer.answer == plain.answer
    assert answer.kv_num_bytes > 0  # decode pulled the KV cache from the prefill replica
    assert "Traceback" not in gateway_log


_HUNG_DNS_GATEWAY = """
import os, socket, sys, time
real, flag = socket.getaddrinfo, sys.argv.pop(1)
def getaddrinfo(host, port, *args, **kwargs):
    # A DNS server that does not answer about hung.epd.test until the test creates `flag`; then
    # the name is 127.0.0.1.
    if host == "hung.epd.test":
        while not os.path.exists(flag):
            time.sleep(0.05)
        host = "127.0.0.1"
    return real(host, port, *args, **kwargs)
socket.getaddrinfo = getaddrinfo
from epd.cli.main import main
raise SystemExit(main(sys.argv[1:]))
"""


def _http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _stop(gateway: subprocess.Popen, log_path: Path) -> None:
    """SIGTERM, and the exit code 0 within a deadline (else killed: a failing test leaves nothing)."""
    gateway.send_signal(signal.SIGTERM)
    try:
        code = gateway.wait(timeout=60)
    except subprocess.TimeoutExpired:
        gateway.kill()
        gateway.wait()
        raise AssertionError(
            f"the gateway did not stop on SIGTERM:\n{log_path.read_text()[-3000:]}"
        ) from None
    assert code == 0, log_path.read_text()[-3000:]


def test_a_gateway_whose_dns_lookup_hangs_serves_its_probes_and_routes_once_it_answers(
    shared_stack, tmp_path, media_files
):
    """`epd serve gateway --prefill dns:///hung.epd.test:PORT` in a process whose resolver does not
    answer about that name: the gateway binds and answers its probes at once, alive (`liveness`)
    and not ready (gRPC NOT_SERVING, HTTP /health 503: no prefill replica serving); once the
    resolver answers it routes to the shared stack's prefill and answers as the stack does; SIGTERM
    stops it while a lookup hangs. Before, it bound nothing until the lookup returned."""
    flag, ports_file = tmp_path / "dns-answers", tmp_path / "gateway.ports.json"
    args = ["serve", "gateway", "--port", "0", "--http-port", "auto", "--ports-file", str(ports_file),
            "--encoder", shared_stack.address("encoder"), "--decode", shared_stack.address("decode"),
            "--prefill", f"dns:///hung.epd.test:{shared_stack.ports['prefill']}"]  # fmt: skip
    log_path = tmp_path / "gateway.log"

    def started(args: list[str]) -> tuple[subprocess.Popen, dict]:
        """The gateway, and the ports it bound."""
        ports_file.unlink(missing_ok=True)
        with open(log_path, "a") as log:
            gateway = subprocess.Popen([sys.executable, "-c", _HUNG_DNS_GATEWAY, str(flag), *args], stdout=log,
                                       stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)  # fmt: skip
        try:
            return gateway, bound_ports(ports_file, gateway, "the gateway")
        except RuntimeError:
            _stop(gateway, log_path)
            raise AssertionError(log_path.read_text()[-3000:]) from None

    gateway, bound = started(args)
    port, http_port = bound["grpc"], bound["http"]
    try:
        deadline = time.monotonic() + WAIT_S  # a deadline for a start-up, not a timing assertion
        while health_answer(f"127.0.0.1:{port}", "liveness", timeout_s=1.0) is not True:
            assert gateway.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        assert health_answer(f"127.0.0.1:{port}", timeout_s=5.0) is False  # answers: NOT_SERVING
        assert _http_status(http_port, "/health") == 503 and _http_status(http_port, "/ping") == 503
        flag.touch()
        deadline = time.monotonic() + WAIT_S
        while health_answer(f"127.0.0.1:{port}", timeout_s=1.0) is not True:
            assert gateway.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        assert _http_status(http_port, "/health") == 200
        with EpdClient(f"127.0.0.1:{port}", timeout_s=120) as client:
            answer = client.ask(media_files["mp4"], QUESTION, **OPTIONS)
        with EpdClient(shared_stack.gateway, timeout_s=120) as client:
            plain = client.ask(media_files["mp4"], QUESTION, **OPTIONS)
        assert answer.token_ids == plain.token_ids and answer.kv_num_bytes > 0
    finally:
        _stop(gateway, log_path)
    # Stopped while its lookup hangs: the lookup's thread does not hold the process up.
    flag.unlink()
    gateway, bound = started(args)
    port = bound["grpc"]
    try:
        deadline = time.monotonic() + WAIT_S
        while health_answer(f"127.0.0.1:{port}", "liveness", timeout_s=1.0) is not True:
            assert gateway.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        _stop(gateway, log_path)
    assert "Traceback" not in log_path.read_text()
