"""A prefill replica lost while a decoder has not yet pulled a request's KV cache: the decoder
answers ABORTED (`KvSourceLost`), not UNAVAILABLE, and the gateway prefills the request again on
the other replica; the client gets the tokens of a fault-free run. With n choices, a choice whose
decoder pulled the cache before the loss goes on, and only the others are prefilled again. Real
processes on loopback: two prefill replicas, one decoder that runs one request at a time, so that
a second request's (or choice's) cache waits at prefill, deterministically, while the first one
decodes."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from epd.transport.affinity import rendezvous_order
from tests.integration.engine_metrics import _wait_until_nothing_is_held
from tests.stack import Stack, stage_replica, wait_until_serving

FRAMES = 4


def chat(port: int, media: bytes, kind: str, max_tokens: int, **fields) -> dict:
    mime = "video/mp4" if kind == "video_url" else "image/png"
    url = f"data:{mime};base64," + base64.b64encode(media).decode()
    body = {"model": "epd", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "media": {"num_frames": FRAMES}, **fields,
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


class TwoPrefills:
    """The stack's processes, its HTTP port, and the prefill process that `media`'s requests go to."""

    def __init__(self, stack: Stack, replica, http_port: int, prefills: list[str]) -> None:
        self.stack, self.replica, self.http_port, self.prefills = stack, replica, http_port, prefills

    def kill_home_of(self, media: bytes) -> None:
        """SIGKILL the prefill replica that `media`'s requests go to (affinity by its sha256)."""
        home = rendezvous_order(hashlib.sha256(media).hexdigest(), self.prefills)[0]
        proc = self.stack.procs["prefill"] if home == self.stack.address("prefill") else self.replica
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


@contextmanager
def two_prefills(tiny_models, tmp_path: Path) -> Iterator[TwoPrefills]:
    """A stack with a second prefill replica and a decoder that runs one request at a time (the
    next request waits for the first, its cache at prefill)."""
    logs = tmp_path / "logs"
    logs.mkdir(parents=True)
    prefills: list[str] = []

    def gateway_flags(stack: Stack) -> list[str]:
        prefills[:] = [stack.address("prefill"), second]
        return ["--prefill", ",".join(prefills)]

    with stage_replica("prefill", tiny_models["qwen2_vl"], logs) as (second, replica):
        extra = {"gateway": gateway_flags, "decode": ["--max-running-requests", "1"]}
        with Stack(tiny_models["qwen2_vl"], logs, extra=extra, http=True) as stack:
            wait_until_serving(second, replica)
            assert stack.http_port is not None
            yield TwoPrefills(stack, replica, stack.http_port, prefills)


def in_thread(answers: dict[str, dict | BaseException], name: str, *args, **fields) -> threading.Thread:
    """`chat(*args, **fields)` in a thread of its own, its answer (or error) in `answers[name]`."""

    def ask() -> None:
        try:
            answers[name] = chat(*args, **fields)
        except BaseException as exc:  # noqa: BLE001 - checked by the caller
            answers[name] = exc

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


def test_a_cache_lost_with_its_prefill_replica_is_prefilled_again(tiny_models, media_files, tmp_path):
    long_video, image = media_files["mp4"].read_bytes(), media_files["png"].read_bytes()
    with two_prefills(tiny_models, tmp_path) as stack:
        port = stack.http_port
        reference = chat(port, image, "image_url", 6)["epd"]["token_ids"]
        answers: dict[str, dict | BaseException] = {}
        first = in_thread(answers, "long", port, long_video, "video_url", 400)
        wait_for(lambda: decode_load(port)[0] >= 1)  # decoding, and stays so for a while
        waiting = in_thread(answers, "image", port, image, "image_url", 6)
        wait_for(lambda: decode_load(port)[1] >= 1)  # prefilled; its cache waits at its home
        stack.kill_home_of(image)
        first.join(180)
        waiting.join(180)

        assert not isinstance(answers["long"], BaseException), answers["long"]
        assert not isinstance(answers["image"], BaseException), answers["image"]
        assert answers["image"]["epd"]["token_ids"] == reference, "the same tokens as without the fault"
        gateway_log = (tmp_path / "logs" / "gateway.log").read_text()
        assert "prefilling it again" in gateway_log
        decode_log = (tmp_path / "logs" / "decode.log").read_text()
        assert "not at its prefill server" in decode_log


def test_choices_whose_decoder_has_the_cache_go_on_and_the_others_are_prefilled_again(
    tiny_models, media_files, tmp_path
):
    # n = 2 on a decoder that runs one request at a time: one choice decodes (its decoder pulled
    # the cache), the other waits in the decoder's queue, its cache at prefill. The prefill replica
    # holding it dies: the first choice goes on, the second is prefilled again on the other
    # replica, which samples its first token again by its own seed (seed + 1), and pulls it there.
    # Each choice is still the single request of its seed, token for token.
    image = media_files["png"].read_bytes()
    seeded = {"temperature": 1.0, "seed": 20261130}
    with two_prefills(tiny_models, tmp_path) as stack:
        port = stack.http_port
        singles = [
            chat(port, image, "image_url", 400, **seeded | {"seed": seeded["seed"] + i})["choices"][0]
            for i in (0, 1)
        ]
        assert singles[0]["token_ids"] != singles[1]["token_ids"], "alike: the check would prove little"
        answers: dict[str, dict | BaseException] = {}
        asking = in_thread(answers, "both", port, image, "image_url", 400, n=2, **seeded)
        wait_for(lambda: decode_load(port) == (1.0, 1.0))  # one choice decoding, one waiting
        stack.kill_home_of(image)
        asking.join(180)

        answer = answers["both"]
        assert not isinstance(answer, BaseException), answer
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        for choice, single in zip(answer["choices"], singles):
            assert (choice["token_ids"], choice["message"], choice["finish_reason"]) == (
                single["token_ids"],
                single["message"],
                single["finish_reason"],
            )
        gateway_log = (tmp_path / "logs" / "gateway.log").read_text()
        assert re.search(r"prefilling it again \(choices \[[01]\] have it already and go on\)", gateway_log)
        # The second cache, kept for n pulls and pulled by one choice, is released: nothing is held.
        _wait_until_nothing_is_held(port)
