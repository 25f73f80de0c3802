"""The engine cores' load on the gateway's /metrics, through the real stack: the gateway asks each
service over LoadService at every scrape, and a request moves every stage's step count."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from epd.client import EpdClient
from tests.integration.engine_metrics import _by_stage, _metrics
from tests.stack import replica_file_stack, stage_replica, wait_until_serving

ENGINE_METRICS = (
    "epd_engine_running_requests",
    "epd_engine_waiting_requests",
    "epd_engine_batch_size",
    "epd_engine_steps_total",
    "epd_engine_requests_total",
    "epd_engine_queue_wait_seconds_total",
    "epd_engine_preemptions_total",
    "epd_engine_memory_used_bytes",
    "epd_engine_memory_total_bytes",
)
STAGES = ("encoder", "prefill", "decode")
WAIT_S = 30.0  # a deadline for the gateway to see a change, not a timing assertion


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


def _replicas_with_samples(text: str, stage: str) -> set[str]:
    """The replica labels of `stage` that have an `epd_engine_steps_total` sample."""
    return {
        sample.labels["replica"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "epd_engine_steps_total" and sample.labels["stage"] == stage
    }


def _replicas_now(port: int, stage: str, expected: set[str]) -> set[str]:
    """The replicas of `stage` with engine samples once they are `expected` (a replica just
    added may not have connected yet; the deadline is for that, not a timing assertion)."""
    deadline = time.monotonic() + WAIT_S
    while (seen := _replicas_with_samples(_metrics(port), stage)) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return seen


def _wait_for_log(path: Path, text: str, times: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while path.read_text().count(text) < times:
        assert time.monotonic() < deadline, f"the gateway never logged {text!r} {times} times"
        time.sleep(0.1)


def test_engine_samples_follow_the_replica_file(tiny_models, tmp_path):
    """The replicas of the file at start keep their samples across its changes (also when one is
    taken out and put back), a replica the file adds gets samples, a removed one has none."""
    stack, replicas_file = replica_file_stack(tiny_models["qwen2_vl"], tmp_path, "encoder")
    gateway_log = stack.log_dir / "gateway.log"
    with stage_replica("encoder", tiny_models["qwen2_vl"], stack.log_dir) as (second, replica), stack:
        first, http_port = stack.address("encoder"), stack.http_port
        wait_until_serving(second, replica)
        assert _replicas_with_samples(_metrics(http_port), "encoder") == {first}

        for step, replicas in enumerate(([first, second], [second], [first, second])):
            replicas_file.write_text(json.dumps({"encoder": replicas}))
            os.utime(replicas_file, ns=(1, (step + 1) * 10**18))  # a new mtime even on a coarse clock
            _wait_for_log(gateway_log, f"encoder replicas now {', '.join(replicas)} ", times=1 + (step == 2))
            assert _replicas_now(http_port, "encoder", set(replicas)) == set(replicas), replicas
