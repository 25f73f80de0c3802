"""Each model service closes what it holds after its drain, its model thread last
(`HealthyServer.closers`), so that no thread of ours is left running when it exits.

Why: `epd serve` leaves by `os._exit`, so a thread left running costs nothing today; but a daemon
thread inside a torch call when the interpreter finalizes aborts the process ("terminate called
without an active exception", `epd.stages.model_thread`), and any change that exits normally would
hit it. Only the encoder closed its decode workers and request drivers; every model thread, prefill's
tokenizer thread and decode's KV channels were left to the exit.

How: a real stack serves a request (a /tokenize too: prefill's tokenizer thread starts at the first)
and gets SIGTERM; each service (the gateway too) names the threads still running after it stopped,
in its log (`epd.cli.serve._log_threads_left`), and must name none, and exit 0.
"""

from __future__ import annotations

import json
import urllib.request

from epd.client import EpdClient
from tests.stack import Stack, free_port


def test_each_model_service_closes_its_threads_after_the_drain(tiny_models, media_files, tmp_path):
    http_port = free_port()
    stack = Stack(
        tiny_models["qwen2_vl"], tmp_path / "logs", extra={"gateway": ["--http-port", str(http_port)]}
    )
    with stack:
        with EpdClient(stack.gateway) as client:
            result = client.ask(
                media_files["mp4"], "what colour is the shape?", num_frames=4, max_new_tokens=3
            )
        assert result.answer is not None
        body = json.dumps({"prompt": "a red circle"}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/tokenize", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert json.load(answer)["count"] > 0
    for role in ("encoder", "prefill", "decode", "gateway"):
        log = (tmp_path / "logs" / f"{role}.log").read_text()
        assert "threads still running after the service stopped" not in log, f"{role}:\n{log[-3000:]}"
        assert "after the drain failed" not in log, f"{role}:\n{log[-3000:]}"
        assert stack.procs[role].returncode == 0, (
            f"{role} exit status {stack.procs[role].returncode}:\n{log[-3000:]}"
        )
