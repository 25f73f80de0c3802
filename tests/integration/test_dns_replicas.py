"""A gateway given `--prefill dns:///localhost:PORT,dns:///localhost:DEAD` (real processes on
loopback) looks the names up itself and routes over one replica per address they resolve to:
/metrics labels each by its address (none by a name), the answer is the plain stack's. Nothing
listens on DEAD, and the prefill server listens on 127.0.0.1 only (where /etc/hosts also gives
localhost ::1, [::1]:PORT refuses connections too): such replicas are unavailable replicas the
router goes around, not an error at start."""

from __future__ import annotations

import socket
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from epd.client import EpdClient
from epd.gateway.dns_replicas import replica_address
from tests.stack import Stack, free_port

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


def test_a_dns_name_is_routed_as_one_replica_per_address(tiny_models, tmp_path, shared_stack, media_files):
    http_port = free_port()
    stack = Stack(tiny_models["qwen2_vl"], tmp_path / "logs")
    port, dead = stack.ports["prefill"], free_port()
    stack.extra["gateway"] = ["--prefill", f"dns:///localhost:{port},dns:///localhost:{dead}",
                              "--http-port", str(http_port)]  # fmt: skip
    resolved = {replica_address(info[4][0], p) for p in (port, dead)
                for info in socket.getaddrinfo("localhost", p, type=socket.SOCK_STREAM)}  # fmt: skip
    assert {f"127.0.0.1:{port}", f"127.0.0.1:{dead}"} <= resolved
    with stack:
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
