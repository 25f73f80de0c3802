"""A prefill replica lost while a decoder has not yet pulled a request's KV cache: the decoder
answers ABORTED (`KvSourceLost`), not UNAVAILABLE, and the gateway prefills the request again on
the other replica; the client gets the tokens of a fault-free run. Real processes on loopback: two
prefill replicas, one decoder that runs one request at a time, so that the second request's cache
waits at prefill, deterministically, while the first request decodes."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import signal
import threading
import time
import urllib.request

from epd.cli.health import is_serving
from epd.transport.affinity import rendezvous_order
from tests.stack import INSECURE_STAGE, Stack, child_env, free_port, zygote

FRAMES = 4


def chat(port: int, media: bytes, kind: str, max_tokens: int) -> dict:
    mime = "video/mp4" if kind == "video_url" else "image/png"
    url = f"data:{mime};base64," + base64.b64encode(media).decode()
    body = {"model": "epd", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "media": {"num_frames": FRAMES},
            "messages": [{"role": "user", "content": [{"type": kind, kind: {"url": url}},
                                                      {"type": "text", "text": "what moves?"}]}]}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def decode_load(port: int) -> tuple[float, float]:
    """(running, waiting) of the decode core, from the gateway's /metrics (its GetLoad scrape)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for name in ("epd_engine_running_requests", "epd_engine_waiting_requests"):
        m = re.search(rf'^{name}{{[^}}]*stage="decode"[^}}]*}} ([0-9.e+]+)$', text, re.M)
        values[name] = float(m.group(1)) if m else 0.0
    return values["epd_engine_running_requests"], values["epd_engine_waiting_requests"]


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_a_cache_lost_with_its_prefill_replica_is_prefilled_again(tiny_models, media_files, tmp_path):
    long_video, image = media_files["mp4"].read_bytes(), media_files["png"].read_bytes()
    http_port = free_port()
    stack = Stack(tiny_models["qwen2_vl"], tmp_path / "logs")
    second = f"127.0.0.1:{free_port()}"
    prefills = [stack.address("prefill"), second]
    stack.extra["gateway"] = ["--prefill", ",".join(prefills), "--http-port", str(http_port)]
    stack.extra["decode"] = ["--max-running-requests", "1"]  # the second request waits for the first
    (tmp_path / "logs").mkdir(parents=True)
    argv = [
        "serve",
        "prefill",
        "--port",
        second.rsplit(":", 1)[1],
        "--model",
        str(tiny_models["qwen2_vl"]),
        *INSECURE_STAGE,
    ]
    replica = zygote().start("prefill-2", argv, child_env(), str(tmp_path / "logs" / "prefill-2.log"))
    try:
        with stack:
            assert is_serving(second, timeout_s=30.0)
            reference = chat(http_port, image, "image_url", 6)["epd"]["token_ids"]
            home = rendezvous_order(hashlib.sha256(image).hexdigest(), prefills)[0]

            answers: dict[str, dict | BaseException] = {}

            def ask(name: str, media: bytes, kind: str, max_tokens: int) -> None:
                try:
                    answers[name] = chat(http_port, media, kind, max_tokens)
                except BaseException as exc:  # noqa: BLE001 - checked below
                    answers[name] = exc

            first = threading.Thread(target=ask, args=("long", long_video, "video_url", 400))
            first.start()
            wait_for(lambda: decode_load(http_port)[0] >= 1)  # decoding, and stays so for a while
            waiting = threading.Thread(target=ask, args=("image", image, "image_url", 6))
            waiting.start()
            wait_for(lambda: decode_load(http_port)[1] >= 1)  # prefilled; its cache waits at `home`

            proc = stack.procs["prefill"] if home == stack.address("prefill") else replica
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            first.join(180)
            waiting.join(180)

            assert not isinstance(answers["long"], BaseException), answers["long"]
            assert not isinstance(answers["image"], BaseException), answers["image"]
            assert answers["image"]["epd"]["token_ids"] == reference, "the same tokens as without the fault"
            gateway_log = (tmp_path / "logs" / "gateway.log").read_text()
            assert "prefilling it again" in gateway_log
            decode_log = (tmp_path / "logs" / "decode.log").read_text()
            assert "not at its prefill server" in decode_log
    finally:
        if replica.poll() is None:
            replica.send_signal(signal.SIGTERM)
        replica.wait(timeout=30)
