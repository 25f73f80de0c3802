"""Routing over encoder replicas that come and go: a gateway whose encoder list comes from a replica
file (`--replicas-file`) starts sending media to a second encoder replica (a separate process on
loopback) once the file names it, without a restart; and when the first replica is stopped the
gateway stays SERVING (one replica of the stage still serves) and answers on the other. A decode
replica killed before a request's first token: the request is retried on the other decode replica
and gets the same answer."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import signal
import time
import urllib.request

import grpc
import numpy as np
from PIL import Image

from epd.cli.health import is_serving
from epd.transport.affinity import rendezvous_order
from epd.v1 import load_pb2, load_pb2_grpc
from tests.stack import gateway_over, replica_file_stack, stage_replica, wait_until_serving

TOKENS = 4
WAIT_S = 30.0


def encoder_steps(address: str) -> int:
    """The replica's encoder core steps so far (its LoadService)."""
    with grpc.insecure_channel(address) as channel:
        reply = load_pb2_grpc.LoadServiceStub(channel).GetLoad(load_pb2.GetLoadRequest(), timeout=10)
    return sum(core.num_steps for core in reply.cores)


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(56, 56, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def image_homed_at(home: str, replicas: list[str]) -> bytes:
    """A PNG whose sha256 rendezvous-hashes to `home` among `replicas`."""
    for seed in range(100):
        data = png(seed)
        if rendezvous_order(hashlib.sha256(data).hexdigest(), replicas)[0] == home:
            return data
    raise AssertionError("no image homed there in 100 tries")


def chat(port: int, image: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    body = {"model": "epd", "max_tokens": TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "what is it?"}]}]}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200
        return json.loads(reply.read())


def wait_for_log(path, text: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"the gateway never logged {text!r}"
        time.sleep(0.1)


def test_an_encoder_added_to_the_replica_file_gets_traffic_and_one_lost_keeps_the_gateway_serving(
    tiny_models, tmp_path
):
    stack, replicas_file = replica_file_stack(
        tiny_models["qwen2_vl"], tmp_path, "encoder", "--stage-check-interval", "0.3"
    )
    gateway_log = stack.log_dir / "gateway.log"
    with stage_replica("encoder", tiny_models["qwen2_vl"], stack.log_dir) as (second, replica), stack:
        first, http_port = stack.address("encoder"), stack.http_port
        wait_until_serving(second, replica)
        at_second = image_homed_at(second, [first, second])
        at_first = image_homed_at(first, [first, second])

        # Not in the file yet: the second replica gets nothing, even for media it would own.
        before = {a: encoder_steps(a) for a in (first, second)}
        assert chat(http_port, at_second)["usage"]["completion_tokens"] > 0
        assert encoder_steps(first) > before[first] and encoder_steps(second) == before[second]

        # Named in the file: its media go to it from then on, no restart.
        replicas_file.write_text(json.dumps({"encoder": [first, second]}))
        wait_for_log(gateway_log, f"encoder replicas now {first}, {second}")
        before = {a: encoder_steps(a) for a in (first, second)}
        assert chat(http_port, at_second)["usage"]["completion_tokens"] > 0
        assert encoder_steps(second) > before[second] and encoder_steps(first) == before[first]

        # The first replica goes: out of routing at the next check, the gateway still SERVING.
        stack.procs["encoder"].send_signal(signal.SIGTERM)
        stack.procs["encoder"].wait(timeout=30)
        wait_for_log(gateway_log, f"not serving (out of routing): encoder {first}")
        assert is_serving(stack.gateway, timeout_s=5.0)
        before_second = encoder_steps(second)
        assert chat(http_port, at_first)["usage"]["completion_tokens"] > 0  # its home is gone
        assert encoder_steps(second) > before_second
        assert "NOT_SERVING" not in gateway_log.read_text()


def test_a_decode_replica_gone_before_the_first_token_is_retried_on_the_other(
    tiny_models, shared_stack, tmp_path
):
    logs = tmp_path / "logs"
    logs.mkdir()
    with stage_replica("decode", tiny_models["qwen2_vl"], logs) as (second, replica):
        # --stage-check-interval 0: the gateway learns that the replica is gone from the failed call
        # itself (the retry path), not from a health check. A gateway of its own over the session's
        # stages, its decode replicas the shared one and this second one.
        flags = ["--decode", f"{shared_stack.address('decode')},{second}",
                 "--stage-check-interval", "0", "--load-refresh-interval", "0"]  # fmt: skip
        with gateway_over(shared_stack, logs, flags, http=True) as stack:
            http_port = stack.http_port
            wait_until_serving(second, replica)
            image = png(7)
            answer = chat(http_port, image)
            replica.send_signal(signal.SIGKILL)  # dies: no draining, no goodbye
            replica.wait(timeout=30)
            # Calls without affinity go to the least loaded replica, ties in turn: of two requests
            # one is sent to the dead replica first, and is retried on the live one.
            for _ in range(2):
                again = chat(http_port, image)
                assert again["epd"]["token_ids"] == answer["epd"]["token_ids"]
            log = (logs / "gateway.log").read_text()
            assert f"decode replica {second} unavailable before the first token" in log
