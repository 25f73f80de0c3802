"""Media affinity across prefill replicas: a gateway over two real prefill replicas (separate
processes on loopback) sends every turn of a conversation about one video to the replica that
rendezvous hashing of the video's sha256 picks (the one whose prefix cache holds it); when that
replica is stopped, the next turn is retried on the other one and still gets the right answer."""

from __future__ import annotations

import base64
import hashlib
import json
import signal
import urllib.request

import grpc

from epd.cli.health import is_serving
from epd.transport.affinity import rendezvous_order
from epd.v1 import load_pb2, load_pb2_grpc
from tests.stack import INSECURE_STAGE, Stack, child_env, free_port, zygote

FRAMES = 4
TOKENS = 6


def prefill_steps(address: str) -> int:
    """The replica's prefill core steps so far (its LoadService)."""
    with grpc.insecure_channel(address) as channel:
        reply = load_pb2_grpc.LoadServiceStub(channel).GetLoad(load_pb2.GetLoadRequest(), timeout=10)
    return sum(core.num_steps for core in reply.cores)


def chat(port: int, messages: list[dict]) -> dict:
    body = {"model": "epd", "messages": messages, "max_tokens": TOKENS, "temperature": 0,
            "media": {"num_frames": FRAMES}}  # fmt: skip
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200
        return json.loads(reply.read())


def test_turns_about_a_video_stay_on_its_prefill_replica_and_survive_its_loss(tiny_models, media_files, tmp_path):
    video = media_files["mp4"].read_bytes()
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    http_port = free_port()
    stack = Stack(tiny_models["qwen2_vl"], tmp_path / "logs")
    second = f"127.0.0.1:{free_port()}"
    prefills = [stack.address("prefill"), second]
    # --stage-check-interval 0: the gateway stops checking once all serve, so it learns that the
    # replica is gone from the failed call itself (the retry path), not from a health check.
    stack.extra["gateway"] = ["--prefill", ",".join(prefills), "--http-port", str(http_port),
                              "--stage-check-interval", "0"]  # fmt: skip
    (tmp_path / "logs").mkdir(parents=True)
    argv = ["serve", "prefill", "--port", second.rsplit(":", 1)[1], "--model", str(tiny_models["qwen2_vl"]), *INSECURE_STAGE]
    replica = zygote().start("prefill-2", argv, child_env(), str(tmp_path / "logs" / "prefill-2.log"))
    try:
        with stack:
            assert is_serving(second, timeout_s=5.0)
            home, other = rendezvous_order(hashlib.sha256(video).hexdigest(), prefills)
            before = {a: prefill_steps(a) for a in prefills}

            turn1 = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                   {"type": "text", "text": "what moves?"}]}]  # fmt: skip
            first = chat(http_port, turn1)
            turn2 = [*turn1, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "and what colour is it?"}]  # fmt: skip
            second_answer = chat(http_port, turn2)
            after = {a: prefill_steps(a) for a in prefills}
            assert after[home] > before[home]
            assert after[other] == before[other], "a turn went to the replica without the video"

            # The video's replica goes away; the gateway has not noticed (no more health checks).
            proc = stack.procs["prefill"] if home == stack.address("prefill") else replica
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)

            again = chat(http_port, turn2)  # UNAVAILABLE at home, retried on the other replica
            assert again["epd"]["token_ids"] == second_answer["epd"]["token_ids"]
            assert prefill_steps(other) > after[other]
            turn3 = [*turn2, {"role": "assistant", "content": again["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "where does it go?"}]  # fmt: skip
            assert chat(http_port, turn3)["usage"]["completion_tokens"] > 0
            log = (tmp_path / "logs" / "gateway.log").read_text()
            assert f"prefill replica {home} unavailable" in log
    finally:
        if replica.poll() is None:
            replica.send_signal(signal.SIGTERM)
        replica.wait(timeout=30)
