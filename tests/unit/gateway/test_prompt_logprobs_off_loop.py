"""A prompt's logprobs (up to MAX_PROMPT_LOGPROB_ENTRIES, half a million entries) are turned into
pieces, joined from pieces and written as JSON on worker threads, never on the event loop, where
they stalled every other request's stream for seconds (docs/benchmarks.md, "Prompt logprobs on the
event loop"), and the Ask stream forwards the pieces prefill sent as they came, no entry made
again. Each test records the thread the costly per-entry step ran on: the real converters
and JSON builders, wrapped to note it. The HTTP answers come from a real HttpApi over real sockets,
its pipeline on the fake stages of tests/unit/gateway/fake_stages.py; the bytes are those
`json.dumps` writes."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from epd.client import AsyncEpdClient
from epd.gateway import chat_answer, json_answer
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.json_answer import LIST_SLICE_ITEMS, json_bytes
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.gateway.servicer import GatewayServicer
from epd.model_runtime.logprobs import TokenLogprob, TopLogprob
from epd.stages.contracts import PrefillHandle
from epd.transport import convert, message_convert
from epd.v1 import gateway_pb2_grpc, prefill_pb2
from tests.unit.gateway.fake_stages import Decoder, Encoder, Prefill

NUM_PROMPT_TOKENS = 3000
PIECE_BYTES = 16 << 10  # small pieces, so that there are many


def _logprobs(num_tokens: int = NUM_PROMPT_TOKENS) -> list[TokenLogprob]:
    top = (TopLogprob(11, "x", -0.5), TopLogprob(12, "y", -1.5))
    return [TokenLogprob(i, f"t{i}", -1.0 - i, top, rank=1 + i % 7) for i in range(num_tokens)]


class _Threads:
    """The threads a wrapped function ran on."""

    def __init__(self) -> None:
        self.idents: set[int] = set()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def noted(*args: Any, **kwargs: Any) -> Any:
            self.idents.add(threading.get_ident())
            return fn(*args, **kwargs)

        return noted


def test_json_bytes_are_json_dumps_bytes():
    value = {
        "long": [
            {"token": f'é{i}"', "logprob": -i / 3, "bytes": [i]} for i in range(3 * LIST_SLICE_ITEMS + 7)
        ],
        "exactly": list(range(LIST_SLICE_ITEMS)),
        "nested": [[{"a": list(range(LIST_SLICE_ITEMS + 1))}]],
        2: None,
        True: (1.5, float("nan")),
        None: {},
        "empty": [],
    }
    assert json_bytes(value) == json.dumps(value).encode()
    assert json_bytes("x") == b'"x"'


def test_prefills_pieces_are_made_off_the_event_loop_and_joined_as_they_came(monkeypatch):
    """Prefill's servicer sends `prefill_responses`, made per entry on a worker thread; the
    gateway's RemotePrefillStage joins them with `PrefillAnswer.add`, which keeps the pieces'
    messages: no entry is made a `TokenLogprob` (a Python object the garbage collector would walk)
    until something reads it."""
    made, joined = _Threads(), _Threads()
    monkeypatch.setattr(message_convert, "logprob_to_proto", made.wrap(message_convert.logprob_to_proto))
    for module in (convert, message_convert):
        monkeypatch.setattr(module, "logprob_from_proto", joined.wrap(message_convert.logprob_from_proto))
    handle = PrefillHandle(
        first_token_id=1, num_prompt_tokens=NUM_PROMPT_TOKENS, num_cached_tokens=0,
        next_position_ids=[NUM_PROMPT_TOKENS] * 4, kv_num_bytes=0, prefill_ms=0.0, kv_handle="ab" * 16,
        prompt_logprobs=_logprobs(),
    )  # fmt: skip

    async def round_trip() -> tuple[int, Sequence[TokenLogprob] | None]:
        answer = convert.PrefillAnswer()
        async for response in convert.prefill_responses(handle):
            await answer.add(prefill_pb2.PrefillResponse.FromString(response.SerializeToString()))
        return threading.get_ident(), answer.handle(relay=True).prompt_logprobs

    loop_thread, back = asyncio.run(round_trip())
    assert made.idents and loop_thread not in made.idents
    assert not joined.idents
    assert back == handle.prompt_logprobs and joined.idents


def test_the_ask_streams_pieces_are_made_off_the_event_loop(monkeypatch):
    """The gateway's servicer (and the SDK's peers) send the pieces `prompt_logprobs_pieces_off_loop`
    makes of a list (the embedded pipeline's, prefill's own)."""
    made = _Threads()
    monkeypatch.setattr(message_convert, "logprob_to_proto", made.wrap(message_convert.logprob_to_proto))
    logprobs = _logprobs()

    async def pieces() -> tuple[int, list]:
        out = [piece async for piece in convert.prompt_logprobs_pieces_off_loop(logprobs, PIECE_BYTES)]
        return threading.get_ident(), out

    loop_thread, out = asyncio.run(pieces())
    assert len(out) > 1
    assert [message_convert.logprob_from_proto(lp) for p in out for lp in p.logprobs] == logprobs
    assert made.idents and loop_thread not in made.idents


class ScoresThePromptInPieces(Prefill):
    """Answers a prompt of NUM_PROMPT_TOKENS with its logprobs as the remote prefill stage has
    them: prefill's pieces (of PIECE_BYTES), joined by `PrefillAnswer` from their messages' bytes."""

    def __init__(self) -> None:
        super().__init__(0, "prefill-0:50052")
        handle = PrefillHandle(
            first_token_id=1, num_prompt_tokens=NUM_PROMPT_TOKENS, num_cached_tokens=0,
            next_position_ids=[NUM_PROMPT_TOKENS] * 4, kv_num_bytes=0, prefill_ms=0.0, kv_handle="ab" * 16,
        )  # fmt: skip
        answer = convert.PrefillAnswer()
        responses = [
            *(prefill_pb2.PrefillResponse(prompt_logprobs=piece)
              for piece in message_convert.prompt_logprobs_pieces(_logprobs(), PIECE_BYTES)),
            prefill_pb2.PrefillResponse(result=convert.handle_to_proto(handle)),
        ]  # fmt: skip
        for response in responses:
            asyncio.run(answer.add(prefill_pb2.PrefillResponse.FromString(response.SerializeToString())))
        self.answer = answer.handle(relay=True).prompt_logprobs

    async def prefill(self, messages, media, generation, request_id, pruning=None, cache_salt="", **kwargs):
        handle = await super().prefill(messages, media, generation, request_id, pruning, cache_salt)
        return replace(handle, num_prompt_tokens=NUM_PROMPT_TOKENS, prompt_logprobs=self.answer)


def test_the_ask_stream_forwards_prefills_pieces_as_they_came(monkeypatch):
    """The gRPC Ask stream sends the prompt's logprobs in the pieces prefill sent them in, as they
    are: no entry made a `TokenLogprob` and a message again at the gateway (1 s of Python for the
    largest list; docs/benchmarks.md, "Prompt logprobs on the event loop"). A real
    GatewayServicer on a real gRPC server, asked by the SDK; the pipeline's fake stages answer one
    token, prefill's the prompt's logprobs joined as the remote prefill stage joins them."""
    prefill = ScoresThePromptInPieces()  # its pieces made now, before the count starts
    remade = _Threads()
    for name in ("logprob_to_proto", "logprob_from_proto"):
        monkeypatch.setattr(message_convert, name, remade.wrap(getattr(message_convert, name)))
    servicer = GatewayServicer(GatewayConfig(), Pipeline(Encoder(0), prefill, AnswersWithLogprobs()))

    async def ask():
        server = grpc.aio.server()
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncEpdClient(f"127.0.0.1:{port}") as client:
                return await client.ask(None, "name a colour", prompt_logprobs=2, max_new_tokens=1)
        finally:
            await server.stop(0)

    result = asyncio.run(ask())
    assert not remade.idents  # the SDK's own conversion is not message_convert's module function
    assert isinstance(prefill.answer, message_convert.PromptLogprobsFromPieces)
    assert len(prefill.answer.pieces) > 1
    assert result.prompt_logprobs == _logprobs()


class ScoresThePrompt(Prefill):
    """Answers the prompt's logprobs, as prefill does for a request that asks."""

    def __init__(self) -> None:
        super().__init__(0, "prefill-0:50052")

    async def prefill(self, messages, media, generation, request_id, pruning=None, cache_salt="", **kwargs):
        handle = await super().prefill(messages, media, generation, request_id, pruning, cache_salt)
        return replace(handle, prompt_logprobs=_logprobs(handle.num_prompt_tokens))


class AnswersWithLogprobs(Decoder):
    """One token, with its logprobs when the request asked."""

    async def generate(self, handle, generation, request_id, pruning=None):
        async for step in super().generate(handle, generation, request_id, pruning):
            if generation.logprobs is not None:
                step = replace(step, logprobs=[TokenLogprob(7, "a", -0.25)])
            yield step


async def _post(path: str, body: dict) -> tuple[int, bytes, int]:
    """(status, the answer's bytes, the event loop's thread)."""
    api = HttpApi(
        GatewayConfig(http=HttpApiConfig(port=0)),
        Pipeline(Encoder(0), ScoresThePrompt(), AnswersWithLogprobs()),
        GatewayMetrics(),
        None,
    )
    runner = web.AppRunner(api.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
            async with session.post(path, json=body) as resp:
                return resp.status, await resp.read(), threading.get_ident()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_http_answer_with_prompt_logprobs_is_built_and_written_off_the_event_loop(monkeypatch, path):
    built, written = _Threads(), _Threads()
    monkeypatch.setattr(chat_answer, "prompt_logprobs_json", built.wrap(chat_answer.prompt_logprobs_json))
    monkeypatch.setattr(json_answer, "json_bytes", written.wrap(json_answer.json_bytes))
    body: dict[str, Any] = {"model": "epd", "max_tokens": 1, "prompt_logprobs": 1}
    if path == "/v1/completions":
        body["prompt"] = "name a colour"
    else:
        body["messages"] = [{"role": "user", "content": "name a colour"}]
    status, data, loop_thread = asyncio.run(_post(path, body))
    assert status == 200, data
    answer = json.loads(data)
    # chat's are the answer's (vLLM's place), a completion's its choice's
    where = answer if path == "/v1/chat/completions" else answer["choices"][0]
    assert len(where["prompt_logprobs"]) == answer["usage"]["prompt_tokens"] > 1
    if path == "/v1/chat/completions":  # completions' bodies are built by their own module
        assert built.idents and loop_thread not in built.idents
    assert written.idents and loop_thread not in written.idents


def test_a_streamed_echo_with_logprobs_is_built_and_written_off_the_event_loop(monkeypatch):
    """A streamed legacy completion with echo and logprobs sends the prompt's logprobs in its first
    step's chunk (vLLM's), made and written off the loop though it waits for the summary."""
    from epd.gateway import sse_stream

    written = _Threads()
    monkeypatch.setattr(sse_stream, "json_bytes", written.wrap(sse_stream.json_bytes))
    body = {
        "model": "epd",
        "max_tokens": 1,
        "prompt": "name a colour",
        "echo": True,
        "logprobs": 1,
        "stream": True,
    }
    status, data, loop_thread = asyncio.run(_post("/v1/completions", body))
    assert status == 200, data
    chunks = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: {")]
    echo = chunks[0]["choices"][0]
    assert echo["text"] == "name a coloura" and echo["finish_reason"] is not None  # the prompt's, then "a"
    assert len(echo["logprobs"]["tokens"]) > 2 and echo["logprobs"]["tokens"][-1] == "a"
    assert written.idents and loop_thread not in written.idents
