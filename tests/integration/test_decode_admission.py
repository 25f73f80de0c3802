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
from tests.stack import Stack

QUESTION = "what colour is the square?"


def _stack(tiny_models, tmp_path_factory, name: str, decode_flags: list[str], prefill_flags: list[str] = ()):
    extra = {
        "decode": decode_flags,
        "prefill": list(prefill_flags),
    }
    stack = Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp(name), extra=extra, http=True)
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


PNG_KV_BYTES = 28_160
"""The KV cache of QUESTION about the PNG with this tiny model (checked below, so that a change of
the model or the prompt fails loudly rather than quietly testing something else)."""


def _png_chat_body(max_tokens: int, png: bytes) -> bytes:
    return json.dumps({
        "model": "epd",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        ]}],
    }).encode()  # fmt: skip


def test_a_prefilled_request_waits_for_a_full_decoder_and_a_full_kv_store_refuses_with_429(
    tiny_models, tmp_path_factory, media_files
):
    """Decode's one slot is held by a long answer and its wait queue is 0, so the decoder refuses
    the next request (RESOURCE_EXHAUSTED, busy). That request has been prefilled and its first token
    has been streamed: the gateway does not drop it, it asks again until the slot is free, and it
    finishes with its own tokens. Meanwhile its cache fills prefill's KV store (room for one), so a
    third request is refused by prefill before it has any token: RESOURCE_EXHAUSTED on gRPC, 429 with
    Retry-After on HTTP, naming --kv-store-bytes. The long answer is not dropped either."""
    flags = ["--max-running-requests", "1", "--max-waiting-requests", "0"]
    store = ["--kv-store-bytes", str(PNG_KV_BYTES * 3 // 2)]
    with (
        _stack(tiny_models, tmp_path_factory, "logs_full", flags, prefill_flags=store) as stack,
        EpdClient(stack.gateway) as client,
    ):
        alone = client.ask(media_files["png"], QUESTION, max_new_tokens=8)
        assert alone.kv_num_bytes == PNG_KV_BYTES
        long_started, waiter_started = threading.Event(), threading.Event()
        long_result: list = []
        waiter_result: list = []

        def long_request():  # holds the decoder's one slot for a few seconds
            for event in client.stream(media_files["png"], QUESTION, max_new_tokens=600, ignore_eos=True):
                if isinstance(event, TokenDelta):
                    long_started.set()
                long_result.append(event)

        def waiting_request():  # prefilled, its first token streamed, then a full decoder
            for event in client.stream(media_files["png"], QUESTION, max_new_tokens=8):
                if isinstance(event, TokenDelta):
                    waiter_started.set()
                waiter_result.append(event)

        workers = [threading.Thread(target=long_request), threading.Thread(target=waiting_request)]
        workers[0].start()
        try:
            assert long_started.wait(120), "the long request started decoding"
            workers[1].start()
            assert waiter_started.wait(120), "the second request got its first token from prefill"
            with pytest.raises(EpdError) as info:
                client.ask(media_files["png"], QUESTION, max_new_tokens=4)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--kv-store-bytes" in info.value.message
            req = urllib.request.Request(
                f"http://127.0.0.1:{stack.http_port}/v1/chat/completions",
                data=_png_chat_body(4, media_files["png"].read_bytes()),
                headers={"Content-Type": "application/json"},
            )
            with pytest.raises(urllib.error.HTTPError) as http:
                urllib.request.urlopen(req, timeout=60)
            assert http.value.code == 429
            assert http.value.headers["Retry-After"].isdigit()
            assert "--kv-store-bytes" in json.loads(http.value.read())["error"]["message"]
            assert workers[0].is_alive(), "the long answer was still decoding: the decoder was full all along"
        finally:
            for worker in workers:
                worker.join(300)
        tokens = [t for e in long_result if isinstance(e, TokenDelta) for t in e.token_ids]
        assert len(tokens) == 600, "the admitted request was not dropped"
        waited = [t for e in waiter_result if isinstance(e, TokenDelta) for t in e.token_ids]
        assert waited == alone.token_ids, "the request that waited for room has its own tokens"
        assert client.ask(media_files["png"], QUESTION, max_new_tokens=4).token_ids, "it serves again"
