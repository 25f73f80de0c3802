"""The engine cores' load on the gateway's /metrics, through the real stack: the gateway asks each
service over LoadService at every scrape, and a request moves every stage's step count."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from epd.client import EpdClient

ENGINE_METRICS = (
    "epd_engine_running_requests",
    "epd_engine_waiting_requests",
    "epd_engine_batch_size",
    "epd_engine_steps_total",
    "epd_engine_queue_wait_seconds_total",
    "epd_engine_preemptions_total",
    "epd_engine_memory_used_bytes",
    "epd_engine_memory_total_bytes",
)
STAGES = ("encoder", "prefill", "decode")


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


def test_every_stage_reports_its_engine_load_and_steps_grow(shared_stack, tmp_path):
    # Bytes no other test sends: the encoder's token cache must not serve them (no tower step).
    import numpy as np
    from PIL import Image

    image = tmp_path / "unseen.png"
    Image.fromarray(np.random.default_rng(2026).integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(image)

    before = _metrics(shared_stack.http_port)
    for name in ENGINE_METRICS:
        assert set(_by_stage(before, name)) == set(STAGES), name
    assert _by_stage(before, "epd_load_scrape_errors_total") == dict.fromkeys(STAGES, 0.0)

    with EpdClient(shared_stack.gateway) as client:
        client.ask(image, "what colour is the square?", max_new_tokens=4)
    after = _metrics(shared_stack.http_port)

    steps_before, steps_after = (
        _by_stage(before, "epd_engine_steps_total"),
        _by_stage(after, "epd_engine_steps_total"),
    )
    for stage in STAGES:
        assert steps_after[stage] > steps_before[stage], stage
    assert all(size >= 1 for size in _by_stage(after, "epd_engine_batch_size").values())
