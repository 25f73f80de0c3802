"""Admission and back-pressure through real processes: a decoder whose batch is full makes new
requests wait for room (all of them finish, each with its own tokens), and one whose wait queue is
full too refuses at once: RESOURCE_EXHAUSTED on gRPC, HTTP 429 with Retry-After on the OpenAI API,
the message naming the flags; nothing already admitted is dropped."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from epd.client import AsyncEpdClient, EpdClient
from epd.client.types import EpdError, TokenDelta
from tests.stack import Stack, free_port

QUESTION = "what colour is the square?"


def _stack(tiny_models, tmp_path_factory, name: str, decode_flags: list[str]):
    http_port = free_port()
    extra = {"gateway": ["--http-port", str(http_port)], "decode": decode_flags}
    stack = Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp(name), extra=extra)
    stack.http_port = http_port
    return stack


def test_beyond_the_batch_requests_wait_for_room_and_all_finish_with_their_own_tokens(
    tiny_models, tmp_path_factory, media_files
):
    cases = [("mp4", 4, 10), ("mp4_b", 2, 6), ("png", 1, 8), ("mp4", 8, 12), ("mp4_b", 4, 9), ("png", 1, 5)]
    with _stack(tiny_models, tmp_path_factory, "logs_wait", ["--max-running-requests", "2"]) as stack:

        async def one(client, media, frames, max_new):
            r = await client.ask(media_files[media], QUESTION, num_frames=frames, max_new_tokens=max_new)
            return r.token_ids

        async def run():
            async with AsyncEpdClient(stack.gateway) as client:
                alone = [await one(client, *c) for c in cases]
                together = await asyncio.gather(*(one(client, *c) for c in cases))
            return alone, together

        alone, together = asyncio.run(run())
        assert [len(t) for t in alone] == [c[2] for c in cases]
        assert list(together) == alone
        assert stack.alive()


def test_a_full_decoder_refuses_with_resource_exhausted_and_http_429(
    tiny_models, tmp_path_factory, media_files
):
    flags = ["--max-running-requests", "1", "--max-waiting-requests", "0"]
    with (
        _stack(tiny_models, tmp_path_factory, "logs_full", flags) as stack,
        EpdClient(stack.gateway) as client,
    ):
        first_token = threading.Event()
        long_result: list = []

        def long_request():  # holds the decoder's one slot for a few seconds
            for event in client.stream(media_files["png"], QUESTION, max_new_tokens=600, ignore_eos=True):
                if isinstance(event, TokenDelta):
                    first_token.set()
                long_result.append(event)

        worker = threading.Thread(target=long_request)
        worker.start()
        try:
            assert first_token.wait(120), "the long request started decoding"
            with pytest.raises(EpdError) as info:
                client.ask(media_files["png"], QUESTION, max_new_tokens=4)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-running-requests" in info.value.message

            body = {
                "model": "epd",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image_url", "image_url": {
                        "url": "data:image/png;base64," + base64.b64encode(media_files["png"].read_bytes()).decode()
                    }},
                ]}],
            }  # fmt: skip
            req = urllib.request.Request(
                f"http://127.0.0.1:{stack.http_port}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with pytest.raises(urllib.error.HTTPError) as http:
                urllib.request.urlopen(req, timeout=60)
            assert http.value.code == 429
            assert http.value.headers["Retry-After"].isdigit()
            assert "--max-waiting-requests" in json.loads(http.value.read())["error"]["message"]
        finally:
            worker.join(300)
        tokens = [t for e in long_result if isinstance(e, TokenDelta) for t in e.token_ids]
        assert len(tokens) == 600, "the admitted request was not dropped"
        assert client.ask(media_files["png"], QUESTION, max_new_tokens=4).token_ids, "it serves again"
