"""Media affinity across prefill replicas: a gateway over two real prefill replicas (separate
processes on loopback) sends every turn of a conversation about one video to the replica that
rendezvous hashing of the video's sha256 picks (the one whose prefix cache holds it); when that
replica is stopped, the next turn is retried on the other one and still gets the right answer. A
conversation whose video comes after a text-only turn stays on its opening's replica, where the
video's turn reuses the text turn's prefix."""

from __future__ import annotations

import base64
import hashlib
import json
import signal
import urllib.request
from contextlib import contextmanager

import grpc

from epd.stages.messages import Message
from epd.transport.affinity import conversation_key, rendezvous_order
from epd.v1 import load_pb2, load_pb2_grpc
from tests.stack import Stack, stage_replica, wait_until_serving

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
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200
        return json.loads(reply.read())


def with_video(url: str, question: str) -> list[dict]:
    return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": question}]


def then(turns: list[dict], reply: dict, content) -> list[dict]:
    """The conversation `turns`, the assistant's `reply` to it, then the user's next `content`."""
    return [*turns, {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": content}]  # fmt: skip


@contextmanager
def two_prefill_stack(model_dir, log_dir):
    """A stack whose gateway routes over its own prefill and a second one: (stack, the prefill
    addresses, the HTTP port, the second replica's process)."""
    log_dir.mkdir(parents=True)
    prefills: list[str] = []

    def gateway_flags(stack: Stack) -> list[str]:
        prefills[:] = [stack.address("prefill"), second]
        # --stage-check-interval 0: the gateway stops checking once all serve, so it learns that the
        # replica is gone from the failed call itself (the retry path), not from a health check.
        return ["--prefill", ",".join(prefills), "--stage-check-interval", "0"]

    with stage_replica("prefill", model_dir, log_dir) as (second, replica):
        wait_until_serving(second, replica)
        with Stack(model_dir, log_dir, extra={"gateway": gateway_flags}, http=True) as stack:
            # The gateway went SERVING at its first check with a replica of each stage serving, and
            # (interval 0) checks no more: a prefill still loading then stayed out of routing. One
            # /health check now that both serve puts both in (the turns then went to the other).
            with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/health", timeout=30) as reply:
                assert reply.status == 200
            yield stack, prefills, stack.http_port, replica


def test_turns_about_a_video_stay_on_its_prefill_replica_and_survive_its_loss(
    tiny_models, media_files, tmp_path
):
    video = media_files["mp4"].read_bytes()
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    with two_prefill_stack(tiny_models["qwen2_vl"], tmp_path / "logs") as (
        stack,
        prefills,
        http_port,
        replica,
    ):
        home, other = rendezvous_order(hashlib.sha256(video).hexdigest(), prefills)
        before = {a: prefill_steps(a) for a in prefills}

        turn1 = [{"role": "user", "content": with_video(url, "what moves?")}]
        first = chat(http_port, turn1)
        turn2 = then(turn1, first, "and what colour is it?")
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
        assert chat(http_port, then(turn2, again, "where does it go?"))["usage"]["completion_tokens"] > 0
        log = (tmp_path / "logs" / "gateway.log").read_text()
        assert f"prefill replica {home} unavailable" in log


def test_a_video_brought_after_a_text_turn_stays_with_it_and_reuses_its_prefix(
    tiny_models, media_files, tmp_path
):
    """ "hello ..." then the video, then a follow-up: every turn on the opening's replica (the
    video's turns went to the video's replica, where the text turn's prefix was not), the video's
    turn reusing the text turn's prompt and the follow-up the video turn's."""
    video = media_files["mp4"].read_bytes()
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    with two_prefill_stack(tiny_models["qwen2_vl"], tmp_path / "logs") as (_, prefills, http_port, _):
        video_home = rendezvous_order(hashlib.sha256(video).hexdigest(), prefills)[0]
        # An opening at home on the other replica (keyless HTTP: the shared tenant, salt "").
        opening = next(
            text
            for i in range(64)
            if rendezvous_order(
                conversation_key([Message.user(text := f"hello, I am visitor {i}")]), prefills
            )[0]
            != video_home
        )
        text_home = next(a for a in prefills if a != video_home)
        before = {a: prefill_steps(a) for a in prefills}

        turn1 = [{"role": "user", "content": opening}]
        first = chat(http_port, turn1)
        turn2 = then(turn1, first, with_video(url, "what moves?"))
        about_video = chat(http_port, turn2)
        follow_up = chat(http_port, then(turn2, about_video, "and what colour is it?"))
        after = {a: prefill_steps(a) for a in prefills}
        assert after[video_home] == before[video_home], "a turn went to the video's replica"
        assert after[text_home] > before[text_home]
        cached = [
            r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, about_video, follow_up)
        ]
        assert cached[0] == 0
        assert first["usage"]["prompt_tokens"] <= cached[1] < about_video["usage"]["prompt_tokens"]
        assert about_video["usage"]["prompt_tokens"] <= cached[2] < follow_up["usage"]["prompt_tokens"]
