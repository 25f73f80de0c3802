"""Property-based fuzzing (Hypothesis) of the gateway's front doors against one real stack:
random JSON bodies on the HTTP API (/v1/chat/completions and /v1/responses sharing one budget of
examples; /v1/completions, /tokenize, /detokenize and the web demo's /demo/frames another, their
bodies sent as they are, compressed, or under a coding they are not), every route and any other
path by any method with junk path parameters, query strings and headers, random message streams
on the gRPC Ask stream, and each stage's RPCs. Properties: every answer is a success or a
documented error (HTTP < 500 with a JSON error.message / a gRPC status from DOCUMENTED_CODES, never
5xx, UNKNOWN or INTERNAL), no message leaks a traceback or an internal path, no file outside the
page's and the samples' is served, every call ends within its timeout, and afterwards the stack is
healthy and answers a normal request.

Seeded (derandomize) and bounded so CI stays fast; for a longer local run raise the number of
examples: EPD_FUZZ_EXAMPLES=2000 pytest tests/integration/test_fuzz_front_doors.py"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import zlib
from typing import Any
from urllib.parse import quote, urlencode

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass as message_class
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd.client import EpdClient
from epd.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    encoder_pb2,
    encoder_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.raw_http import request
from tests.stack import INTERNAL_AUTH_METADATA, TEST_INTERNAL_SECRET, Stack

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
CALL_TIMEOUT_S = 60.0
MAX_EXAMPLES = int(os.environ.get("EPD_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
DOCUMENTED_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
}  # fmt: skip
LEAKS = ("Traceback", 'File "', "/work/", "site-packages", "Error(", "Exception(")


def assert_no_leak(text: str) -> None:
    for leak in LEAKS:
        assert leak not in text, text[:1000]


def assert_documented(error: grpc.RpcError) -> None:
    """A status of DOCUMENTED_CODES (not DEADLINE_EXCEEDED: each call ends within its timeout)
    whose message leaks nothing."""
    assert error.code() in DOCUMENTED_CODES - {grpc.StatusCode.DEADLINE_EXCEEDED}, (
        error.code(),
        error.details(),
    )
    assert_no_leak(error.details() or "")


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    extra = {"gateway": ["--api-key", API_KEY, "--max-upload-bytes", "200000"]}
    # With the internal secret, as deployed: the stage fuzzers present it (and check that calls
    # without it get UNAUTHENTICATED only), so the junk reaches the servicers behind the check.
    with Stack(
        tiny_models["qwen2_vl"],
        tmp_path_factory.mktemp("logs_fuzz"),
        extra=extra,
        internal_secret=True,
        http=True,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def video_bytes(media_files) -> bytes:
    return media_files["mp4"].read_bytes()


JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
)  # fmt: skip
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)  # noqa: E501
FIELDS = ("model", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "media",
          "pruning", "stop", "n", "cache_salt", "stream_options")  # fmt: skip
VALUES = st.one_of(st.booleans(), st.integers(-2, 8), st.text(max_size=10), JSON)
"""A field's value: often one of the right type and size (so the request reaches what reads it), else any JSON."""
TYPED = {
    "max_tokens": st.integers(0, 4), "temperature": st.floats(0, 2), "top_k": st.integers(-1, 5),
    "seed": st.integers(-(2**63), 2**63 - 1), "stream": st.booleans(), "n": st.integers(1, 3),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)), "echo": st.booleans(),
    "logprobs": st.integers(0, 5), "prompt_logprobs": st.integers(-1, 3), "return_token_ids": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "min_tokens": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.integers(-1, 300).map(str), st.floats(-100, 100), max_size=2),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"},
                                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}]),
    "structured_outputs": st.sampled_from([{"choice": ["a", "b"]}, {"regex": "[a-z]+"}, {"json": {}}]),
    "add_special_tokens": st.booleans(), "return_token_strs": st.booleans(),
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), VALUES, max_size=2),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    "top_p": st.floats(0, 1), "cache_salt": st.text(max_size=10), "max_output_tokens": st.integers(0, 4),
    "media": st.fixed_dictionaries({}, optional={"num_frames": st.integers(0, 9), "fps": st.floats(0, 4),
                                                 "max_pixels": st.integers(0, 1 << 20)}),
    "pruning": st.fixed_dictionaries({"preset": st.sampled_from(["off", "balanced", "x"])}),
    "store": st.booleans(), "parallel_tool_calls": st.booleans(), "top_logprobs": st.integers(0, 5),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}]),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
    "instructions": st.text(max_size=20), "truncation": st.sampled_from(["auto", "disabled"]),
}  # fmt: skip
"""A value of the right type (and mostly range) for a field, drawn half the time (`field_value`)."""


def field_value(draw, name: str, other: st.SearchStrategy) -> Any:
    return draw(st.one_of(TYPED[name], other) if name in TYPED else other)


URLS = st.sampled_from(["data:video/mp4;base64,", "data:video/mp4;base64,!!!!", "data:,", "data:video/mp4,raw",
                        "file:///etc/passwd", "http://127.0.0.1:1/x.mp4", "data:video/mp4;base64,AAAA", ""])  # fmt: skip


@st.composite
def chat_bodies(draw, video_url: str) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:  # any JSON at all
        return json.dumps(draw(JSON)).encode()
    if kind == 1:  # raw junk bytes
        return draw(st.binary(max_size=200))
    url = video_url if kind == 2 else draw(URLS)
    content: Any = [{"type": "text", "text": draw(st.text(max_size=30))},
                    {"type": "video_url", "video_url": {"url": url}}]  # fmt: skip
    body: dict[str, Any] = {
        "messages": [{"role": draw(st.sampled_from(["user", "system", "x", ""])), "content": content}]
    }
    body["max_tokens"] = 2
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[name] = field_value(draw, name, JSON)
    return json.dumps(body).encode()


RESPONSES_FIELDS = ("model", "input", "instructions", "max_output_tokens", "temperature", "stream", "tools",
                    "tool_choice", "text", "reasoning", "store", "metadata", "previous_response_id", "media",
                    "parallel_tool_calls", "truncation", "include", "top_logprobs")  # fmt: skip
RESPONSES_ITEM_TYPES = st.sampled_from(
    ["message", "function_call", "function_call_output", "reasoning", "x", None]
)
RESPONSES_PART_TYPES = st.sampled_from(
    ["input_text", "output_text", "input_image", "video_url", "image_url", "x"]
)


@st.composite
def responses_bodies(draw, video_url: str) -> bytes:
    """A Responses body: any JSON, or an `input` of items (messages of parts, calls, their
    outputs) whose fields are drawn from the right names with any values."""
    kind = draw(st.integers(0, 3))
    if kind == 0:  # any JSON at all
        return json.dumps(draw(JSON)).encode()
    if kind == 1:  # a string input
        body: dict[str, Any] = {"input": draw(st.text(max_size=30))}
    else:
        url = video_url if kind == 2 else draw(URLS)
        part = {"type": draw(RESPONSES_PART_TYPES), "text": draw(st.text(max_size=20)),
                "video_url": {"url": url}, "image_url": draw(st.one_of(st.just(url), JSON))}  # fmt: skip
        items = []
        for _ in range(draw(st.integers(1, 3))):
            item = {"type": draw(RESPONSES_ITEM_TYPES), "role": draw(st.sampled_from(["user", "developer", "x"])),
                    "content": draw(st.one_of(st.just([part]), JSON))}  # fmt: skip
            for name in draw(
                st.lists(st.sampled_from(["call_id", "name", "arguments", "output"]), max_size=3)
            ):
                item[name] = draw(JSON)
            items.append({k: v for k, v in item.items() if v is not None})
        body = {"input": items}
    body["max_output_tokens"] = 2
    for name in draw(st.lists(st.sampled_from(RESPONSES_FIELDS), max_size=4, unique=True)):
        body[name] = field_value(draw, name, JSON)
    return json.dumps(body).encode()


def test_fuzz_http_front_doors(stack, video_bytes):
    """/v1/chat/completions and /v1/responses, one budget of examples between them."""
    video_url = "data:video/mp4;base64," + base64.b64encode(video_bytes).decode()

    @FUZZ
    @given(
        call=st.one_of(
            st.tuples(st.just(CHAT), chat_bodies(video_url)),
            st.tuples(st.just(RESPONSES), responses_bodies(video_url)),
        )
    )
    def run(call: tuple[str, bytes]) -> None:
        path, body = call
        response = asyncio.run(
            asyncio.wait_for(request(stack.http_port, "POST", path, body, AUTH), CALL_TIMEOUT_S)
        )
        text = response.body.decode("utf-8", "replace")
        assert response.status < 500, (response.status, text[:1000])
        assert_no_leak(text)
        if response.status >= 400:
            assert response.json()["error"]["message"]

    run()


# --- the other HTTP routes: the JSON bodies of /v1/completions, /tokenize, /detokenize and the web
# demo's /demo/frames (sent as they are, gzip'd or deflated, or with a coding they are not), then
# every route's method, path, path parameter, query string and headers ---

COMPLETIONS = "/v1/completions"
TOKEN_IDS = st.lists(st.one_of(st.integers(-2, 300), st.integers(-(2**70), 2**70), JSON_LEAF), max_size=6)
COMPLETIONS_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_k", "seed", "stream", "stop", "n",
                      "echo", "logprobs", "prompt_logprobs", "suffix", "best_of", "min_tokens", "logit_bias",
                      "stream_options", "response_format", "structured_outputs", "request_id",
                      "return_token_ids", "stop_token_ids", "add_special_tokens")  # fmt: skip
TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens", "return_token_strs", "add_generation_prompt",
                   "continue_final_message", "chat_template_kwargs", "chat_template", "tools", "tool_choice",
                   "mm_processor_kwargs")  # fmt: skip
MEDIA_FIELDS = ("fps", "max_frames", "min_frames", "num_frames", "max_pixels", "start_time_s", "end_time_s",
                "x")  # fmt: skip
CODINGS = st.sampled_from(
    ["", "", "", "", "identity", "gzip", "deflate", "gzip, not", "deflate, truncated", "br"]
)
"""The body's Content-Encoding, mostly none: "gzip" and "deflate" compress it; ", not" sends it as
it is under that name, ", truncated" cut short; "br" is refused before it is read."""


def with_fields(draw, body: dict[str, Any], names: tuple[str, ...]) -> bytes:
    for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
        body[name] = field_value(draw, name, VALUES)
    return json.dumps(body).encode()


@st.composite
def completions_bodies(draw) -> bytes:
    prompt = st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 300), min_size=1, max_size=6),
                       TOKEN_IDS, st.lists(TOKEN_IDS, max_size=2), st.lists(st.text(max_size=8), max_size=2))  # fmt: skip
    return with_fields(draw, {"prompt": draw(prompt), "max_tokens": 2}, COMPLETIONS_FIELDS)


@st.composite
def tokenize_bodies(draw) -> bytes:
    if draw(st.booleans()):
        return with_fields(draw, {"prompt": draw(st.text(max_size=40))}, TOKENIZE_FIELDS)
    part = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "video_url", "image_url", "x"]), "text": st.text(max_size=20)}
    )
    content = draw(st.one_of(st.text(max_size=30), st.lists(part, max_size=2)))
    role = draw(st.sampled_from(["user", "system", "assistant", "tool", "x"]))
    return with_fields(draw, {"messages": [{"role": role, "content": content}]}, TOKENIZE_FIELDS)


@st.composite
def detokenize_bodies(draw) -> bytes:
    return with_fields(draw, {"tokens": draw(TOKEN_IDS)}, ("model", "tokens"))


@st.composite
def frames_bodies(draw, video_url: str) -> bytes:
    body: dict[str, Any] = {"video_url": draw(st.one_of(st.just(video_url), URLS, JSON))}
    if draw(st.booleans()):
        names = draw(st.lists(st.sampled_from(MEDIA_FIELDS), max_size=3))
        body["media"] = {name: draw(VALUES) for name in names}
    return with_fields(draw, body, ("media", "video_url", "model"))


def encoded(body: bytes, coding: str) -> bytes:
    name, _, how = coding.partition(", ")
    if how == "not" or name not in ("gzip", "deflate"):
        return body
    packed = gzip.compress(body) if name == "gzip" else zlib.compress(body)
    return packed[: len(packed) // 2] if how == "truncated" else packed


AUTHS = st.sampled_from(["key", "key", "key", "key", "key", "key", "none", "wrong"])
"""Mostly the API key, else none or a wrong one (`auth_headers`)."""


def auth_headers(auth: str) -> dict[str, str | bytes]:
    return AUTH if auth == "key" else {} if auth == "none" else {"Authorization": f"Bearer {API_KEY}x"}


def assert_answer(response, authed: bool = True) -> None:
    """A success or a documented error: under 500, an error's JSON message, no leak; 401 without the key."""
    text = response.body.decode("utf-8", "replace")
    assert response.status < 500, (response.status, text[:1000])
    assert_no_leak(text)
    if response.status >= 400:
        assert response.json()["error"]["message"]
    if not authed:
        assert response.status == 401, (response.status, text[:1000])


def test_fuzz_http_json_routes(stack, video_bytes):
    """/v1/completions, /tokenize, /detokenize and /demo/frames, one budget of examples between them."""
    video_url = "data:video/mp4;base64," + base64.b64encode(video_bytes).decode()
    junk = st.one_of(JSON.map(lambda value: json.dumps(value).encode()), st.binary(max_size=200))

    @FUZZ
    @given(
        call=st.one_of(
            st.tuples(st.just(COMPLETIONS), completions_bodies() | junk),
            st.tuples(st.just("/tokenize"), tokenize_bodies() | junk),
            st.tuples(st.just("/detokenize"), detokenize_bodies() | junk),
            st.tuples(st.just("/demo/frames"), frames_bodies(video_url) | junk),
        ),
        coding=CODINGS,
        auth=AUTHS,
    )
    def run(call: tuple[str, bytes], coding: str, auth: str) -> None:
        path, body = call
        headers = {**auth_headers(auth), **({"Content-Encoding": coding.partition(",")[0]} if coding else {})}
        response = asyncio.run(
            asyncio.wait_for(
                request(stack.http_port, "POST", path, encoded(body, coding), headers), CALL_TIMEOUT_S
            )
        )
        assert_answer(response, authed=auth == "key")

    run()


METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "PROPFIND"])
"""Methods aiohttp's parser knows: one it does not (FOO), like a malformed request line, is answered
by the parser with a plain-text 400 before any route or middleware (docs/security.md "Fuzzing")."""
ROUTES = ("/", "/health", "/ping", "/version", "/metrics", "/v1/models", "/demo/samples", "/static/app.js",
          CHAT, COMPLETIONS, RESPONSES, "/tokenize", "/detokenize", "/demo/frames")  # fmt: skip
PARAM_PREFIXES = ("/v1/models/", "/demo/samples/", "/static/", "/", "/v1/", "/v1/responses/", "/demo/")
SEGMENTS = st.one_of(
    st.text(max_size=20).map(lambda text: quote(text, safe="")),
    st.sampled_from(["..", "%2e%2e", "%2E%2E%2F..", "..%2f..%2f..%2f..%2fetc%2fpasswd", ".%00.", "%00", ".", "",
                     "%", "%zz", "~", "index.html", "app.js", "sample.mp4", "sample.json", "epd", "..%5c..",
                     "cancel", "input_items", "%C0%AE%C0%AE", "a;b=c", "?", "#"]),
)  # fmt: skip
"""A path parameter: any text percent-encoded, or a traversal, a bad escape, a real file's name."""
QUERIES = st.one_of(
    st.just(""),
    st.lists(st.tuples(st.text(max_size=10), st.text(max_size=10)), max_size=3).map(lambda q: "?" + urlencode(q)),
    st.text(max_size=30).map(lambda text: "?" + quote(text, safe="=&%;/?")),
)  # fmt: skip
HEADER_VALUES = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
    st.sampled_from(["", "application/json", "text/plain", "multipart/form-data; boundary=x", "gzip", "br",
                     "100-continue", "cross-site", "same-origin", "https://evil.example", "0", "-1", "chunked"]),
)  # fmt: skip
HEADER_NAMES = ("Authorization", "X-Request-Id", "Content-Type", "Content-Encoding", "Expect", "Origin",
                "Sec-Fetch-Site", "Accept", "Accept-Encoding", "Range", "If-Modified-Since", "Cookie")  # fmt: skip
SERVED_ELSEWHERE = ("root:x:0:", "from __future__", "import ", "BEGIN ", "PRIVATE KEY")
"""Text of a file no route serves (/etc/passwd, the gateway's source, a key): never in an answer."""


@st.composite
def http_requests(draw) -> tuple[str, str, dict[str, str | bytes], bytes]:
    if draw(st.booleans()):
        path = draw(st.sampled_from(ROUTES))
    else:
        segments = draw(st.lists(SEGMENTS, min_size=1, max_size=3))
        path = draw(st.sampled_from(PARAM_PREFIXES)) + "/".join(segments)
    path += draw(QUERIES)
    method = draw(METHODS)
    headers: dict[str, str | bytes] = {**auth_headers(draw(AUTHS))}
    for name in draw(st.lists(st.sampled_from(HEADER_NAMES), max_size=3, unique=True)):
        headers[name] = draw(HEADER_VALUES)
    body = b"" if method in ("GET", "HEAD") else json.dumps(draw(JSON)).encode()
    return method, path, headers, body


def test_fuzz_http_routes_paths_queries_headers(stack):
    """Every route and any other path, by any method, with junk path parameters, query strings and
    headers: a documented answer that serves nothing from outside the static and sample files."""

    @FUZZ
    @given(call=http_requests())
    def run(call: tuple[str, str, dict[str, str | bytes], bytes]) -> None:
        method, path, headers, body = call
        response = asyncio.run(
            asyncio.wait_for(request(stack.http_port, method, path, body, headers), CALL_TIMEOUT_S)
        )
        text = response.body.decode("utf-8", "replace")
        assert response.status < 500, (method, path, response.status, text[:1000])
        if "json" in response.headers.get("content-type", ""):  # not the page's script ("Error(")
            assert_no_leak(text)
        if response.status >= 400 and method != "HEAD":
            assert response.json()["error"]["message"], (method, path, text[:1000])
        for secret in SERVED_ELSEWHERE:
            assert secret not in text, (method, path, text[:1000])

    run()


HEADERS = st.builds(
    gateway_pb2.AskHeader,
    question=st.text(max_size=30),
    media_num_bytes=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    media_sha256=st.one_of(st.just(""), st.text(max_size=70), st.text("0123456789abcdef", min_size=64, max_size=64)),
    sampling=st.builds(common_pb2.VideoSampling, fps=st.floats(width=32), num_frames=st.integers(-(2**31), 2**31 - 1)),
    generation=st.builds(common_pb2.GenerationParams, max_new_tokens=st.integers(-(2**31), 2**31 - 1),
                         temperature=st.floats(width=32), top_p=st.floats(width=32)),
)  # fmt: skip


ASK_STEPS = st.lists(st.one_of(HEADERS, st.binary(max_size=100), st.integers(0, 1 << 20)), max_size=5)
"""An Ask stream in any order: a header, a junk chunk, or (an int n) the test video's first n bytes."""


def ask_messages(steps: list, video_bytes: bytes) -> list[gateway_pb2.AskRequest]:
    return [gateway_pb2.AskRequest(header=step) if isinstance(step, gateway_pb2.AskHeader)
            else gateway_pb2.AskRequest(media_chunk=step if isinstance(step, bytes) else video_bytes[:step])
            for step in steps]  # fmt: skip


def test_fuzz_grpc_ask_stream(stack, video_bytes):
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        @FUZZ
        @given(steps=ASK_STEPS, with_key=st.booleans())
        def run(steps: list, with_key: bool) -> None:
            messages = ask_messages(steps, video_bytes)
            metadata = [("authorization", f"Bearer {API_KEY}")] if with_key else []
            try:
                for _ in stub.Ask(iter(messages), metadata=metadata, timeout=CALL_TIMEOUT_S):
                    pass
            except grpc.RpcError as error:
                assert_documented(error)

        run()


def test_healthy_and_answering_after_fuzzing(stack, media_files):
    assert stack.alive()
    response = asyncio.run(request(stack.http_port, "GET", "/health"))
    assert response.status == 200 and response.json() == {"status": "ok"}
    with EpdClient(stack.gateway, timeout_s=120, api_key=API_KEY) as client:
        result = client.ask(
            media_files["mp4"], "what colour is the moving square?", num_frames=4, max_new_tokens=4
        )
    assert result.token_ids


# --- each stage's own request stream, called directly (as the gateway would, with junk) ---

_SCALARS = {
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.text(max_size=20),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    FieldDescriptor.TYPE_DOUBLE: st.floats(),
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
}


CONSTRAINTS = st.one_of(
    st.builds(common_pb2.StructuredOutputs, json_schema=JSON.map(json.dumps)),
    st.builds(common_pb2.StructuredOutputs, regex=st.one_of(st.text(max_size=20), st.sampled_from(
        ["[a-z]+", "(a|b)*c", "\\d{3,}", "(((", "a{99999}", ".*"]))),
    st.builds(common_pb2.StructuredOutputs, choice=st.lists(st.text(max_size=8), max_size=4)),
    st.builds(common_pb2.StructuredOutputs, grammar=st.one_of(st.text(max_size=30), st.sampled_from(
        ['root ::= "yes" | "no"', "root ::= root", 'root ::= [a-z]+ "."', "root ::="]))),
)  # fmt: skip
"""Structured-output constraints that reach the compiler's parsers (JSON text as a schema, regular
expressions and grammars of the right shape) beside the field fuzzing's random text."""


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        message = protos(message_class(field.message_type), depth + 1)
        if field.message_type.full_name == "epd.v1.StructuredOutputs":
            return st.one_of(message, CONSTRAINTS)
        return message
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [999])
    return _SCALARS.get(field.type, st.integers(0, 100))


@st.composite
def protos(draw, cls, depth: int = 0):
    """Any message of `cls`: each field set or not, to any value of its type (huge, negative,
    NaN), nested messages likewise up to a depth. Oneofs keep whichever member is set last."""
    message = cls()
    if depth > 3:
        return message
    for field in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        entry = field.message_type if field.type == FieldDescriptor.TYPE_MESSAGE else None
        if entry is not None and entry.GetOptions().map_entry:  # map<string, string> (knobs): junk text
            key, val = entry.fields_by_name["key"], entry.fields_by_name["value"]
            if key.type == val.type == FieldDescriptor.TYPE_STRING:
                getattr(message, field.name).update(
                    draw(st.dictionaries(st.text(max_size=15), st.text(max_size=15), max_size=3))
                )
        elif field.is_repeated:
            values = draw(st.lists(_value(field, depth), max_size=3))
            getattr(message, field.name).extend(values)
        else:
            value = draw(_value(field, depth))
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(message, field.name).CopyFrom(value)
            else:
                setattr(message, field.name, value)
    return message


WRONG_SECRET = (
    ("x-epd-internal-auth", TEST_INTERNAL_SECRET[:-1] + ("0" if TEST_INTERNAL_SECRET[-1] != "0" else "1")),
)

STAGE_CALLS = [
    # stage, stub class, method, request class, client-streaming?
    ("encoder", encoder_pb2_grpc.EncoderServiceStub, "Encode", encoder_pb2.EncodeRequest, True),
    ("prefill", prefill_pb2_grpc.PrefillServiceStub, "Prefill", prefill_pb2.PrefillRequest, True),
    ("prefill", prefill_pb2_grpc.PrefillServiceStub, "PullKv", prefill_pb2.PullKvRequest, False),
    ("prefill", prefill_pb2_grpc.PrefillServiceStub, "ReleaseKv", prefill_pb2.ReleaseKvRequest, False),
    ("prefill", prefill_pb2_grpc.PrefillServiceStub, "GetModelInfo", prefill_pb2.GetModelInfoRequest, False),
    ("prefill", prefill_pb2_grpc.PrefillServiceStub, "Tokenize", prefill_pb2.TokenizeRequest, False),
    ("prefill", prefill_pb2_grpc.PrefillServiceStub, "Detokenize", prefill_pb2.DetokenizeRequest, False),
    ("prefill", prefill_pb2_grpc.PrefillServiceStub, "CompileStructuredOutputs",
     prefill_pb2.CompileStructuredOutputsRequest, False),
    ("decode", decode_pb2_grpc.DecodeServiceStub, "Generate", decode_pb2.GenerateRequest, False),
]  # fmt: skip


@pytest.mark.parametrize("stage,stub_class,method,request_class,streaming", STAGE_CALLS,
                         ids=[f"{c[0]}.{c[2]}" for c in STAGE_CALLS])  # fmt: skip
def test_fuzz_stage_request_streams(stack, stage, stub_class, method, request_class, streaming):
    with grpc.insecure_channel(stack.address(stage)) as channel:
        call = getattr(stub_class(channel), method)

        # Three calls in four present the secret; the others none, or one a character off.
        @settings(FUZZ, max_examples=max(MAX_EXAMPLES // 2, 5))
        @given(messages=st.lists(protos(request_class), min_size=1, max_size=4), auth=st.integers(0, 7))
        def run(messages: list, auth: int) -> None:
            authed = auth >= 2
            metadata = INTERNAL_AUTH_METADATA if authed else () if auth == 0 else WRONG_SECRET
            try:
                answer = call(
                    iter(messages) if streaming else messages[0], timeout=CALL_TIMEOUT_S, metadata=metadata
                )
                if not isinstance(answer, Message):
                    for _ in answer:
                        pass
                assert authed, "a call without the internal secret was answered"
            except grpc.RpcError as error:
                if not authed:  # refused before the servicer reads anything, never echoing what was sent
                    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (error.code(), error.details())
                    assert TEST_INTERNAL_SECRET[:16] not in (error.details() or ""), error.details()
                assert_documented(error)

        run()
    assert stack.alive()


# --- bytes that may not parse as the method's request at all (gRPC's deserializer, then the servicer) ---

RAW_CALLS = [
    (server, f"/epd.v1.{service.name}/{method.name}", method.client_streaming, method.server_streaming)
    for server, module in (("gateway", gateway_pb2), ("encoder", encoder_pb2), ("prefill", prefill_pb2),
                           ("decode", decode_pb2))
    for service in module.DESCRIPTOR.services_by_name.values()
    for method in service.methods
]  # fmt: skip


def raw_call(channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool):
    """A method of `path` that sends and returns bytes as they are (no protobuf on our side)."""
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}  # fmt: skip
    return kind[client_streaming, server_streaming](path)


@pytest.mark.parametrize("server,path,client_streaming,server_streaming", RAW_CALLS,
                         ids=[c[1].rsplit(".", 1)[1] for c in RAW_CALLS])  # fmt: skip
def test_fuzz_raw_bytes(stack, server, path, client_streaming, server_streaming):
    """Junk bytes as each method's request(s), with the API key (the gateway) or the secret (a
    stage): a documented status or an answer, never INTERNAL or UNKNOWN (a message that is not
    protobuf is INVALID_ARGUMENT)."""
    address = stack.gateway if server == "gateway" else stack.address(server)
    metadata = [("authorization", f"Bearer {API_KEY}")] if server == "gateway" else INTERNAL_AUTH_METADATA
    with grpc.insecure_channel(address) as channel:
        call = raw_call(channel, path, client_streaming, server_streaming)

        @settings(FUZZ, max_examples=max(MAX_EXAMPLES // 4, 5))
        @given(messages=st.lists(st.binary(max_size=80), min_size=1, max_size=3))
        def run(messages: list[bytes]) -> None:
            try:
                answer = call(
                    iter(messages) if client_streaming else messages[0],
                    timeout=CALL_TIMEOUT_S,
                    metadata=metadata,
                )
                if server_streaming:
                    for _ in answer:
                        pass
            except grpc.RpcError as error:
                assert_documented(error)

        run()
    assert stack.alive()
