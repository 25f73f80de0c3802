"""The gateway's /metrics read by stage (`_metrics`, `_by_stage`), and the wait until no stage holds
a request or its KV (`_wait_until_nothing_is_held`), for the tests of engine load and of what a
request leaves behind."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        assert resp.status == 200
        return resp.read().decode()


def _by_stage(text: str, name: str) -> dict[str, float]:
    """stage label -> the sample's value, summed over cores and replicas."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                stage = sample.labels["stage"]
                out[stage] = out.get(stage, 0.0) + sample.value
    return out


WAIT_S = 30.0  # a deadline for the services to settle, not a timing assertion


def _wait_until_nothing_is_held(port: int) -> None:
    """No decoder runs a request or holds KV room, and prefill's KV store is empty."""
    deadline = time.monotonic() + WAIT_S
    while True:
        text = _metrics(port)
        held = {
            "running": _by_stage(text, "epd_engine_running_requests").get("decode"),
            "decode memory": _by_stage(text, "epd_engine_memory_used_bytes").get("decode"),
            "kv store": _by_stage(text, "epd_kv_store_caches").get("prefill"),
        }
        if set(held.values()) == {0.0} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert held == dict.fromkeys(held, 0.0)
