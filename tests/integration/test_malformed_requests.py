"""Malformed and oversized requests against one real stack (HTTP API and gRPC): each gets a clear
4xx / INVALID_ARGUMENT whose JSON message names the field, never a 5xx, a traceback or a dropped
connection; oversized bodies get 413 before they are read; past a client's requests in flight (a
request of n choices counts once) or the process's body budget, 429 + Retry-After (RESOURCE_EXHAUSTED on gRPC); and the stack keeps
answering good requests afterwards (the last tests of the module)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from epd.client import NO_RETRY, EpdClient, EpdError, RetryPolicy
from epd.gateway.admission import max_body_bytes
from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.raw_http import Connection, Response, request
from tests.stack import ROOT, gateway_over

API_KEY = "malformed-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
UPLOAD_LIMIT_BYTES = 200_000
MAX_BODY_BYTES = max_body_bytes(UPLOAD_LIMIT_BYTES)
BODY_BUDGET_BYTES = MAX_BODY_BYTES + 100_000
"""Room for one largest body at a time, so that two large ones in flight overflow it."""
MAX_REQUESTS_PER_CLIENT = 2
QUESTION = "what colour is the moving square?"


@pytest.fixture(scope="module")
def stack(shared_stack, tmp_path_factory):
    """A gateway of its own (every flag here is the gateway's) over the session's stages;
    `stack.alive()` checks those too."""
    flags = [
        "--api-key", API_KEY,
        "--max-upload-bytes", str(UPLOAD_LIMIT_BYTES),
        "--max-requests-per-client", str(MAX_REQUESTS_PER_CLIENT),
        "--max-inflight-body-bytes", str(BODY_BUDGET_BYTES),
    ]  # fmt: skip
    with gateway_over(shared_stack, tmp_path_factory.mktemp("logs_malformed"), flags, http=True) as s:
        yield s


@pytest.fixture(scope="module")
def video_url(media_files) -> str:
    return "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()


def chat(video_url: str, **fields: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": QUESTION}, {"type": "video_url", "video_url": {"url": video_url}}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def with_media(**options: Any) -> Callable[[str], bytes]:
    # json.dumps writes NaN / Infinity literals, which Python's json (and many clients) accept.
    return lambda url: json.dumps(chat(url, media={"num_frames": 4, **options})).encode()


def with_fields(**fields: Any) -> Callable[[str], bytes]:
    return lambda url: json.dumps(chat(url, **fields)).encode()


def deeply_nested(url: str) -> bytes:
    return b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"


def question_with_lone_surrogate(url: str) -> bytes:
    body = chat(url)
    body["messages"][0]["content"][0]["text"] = "what \ud800 happens?"
    return json.dumps(body).encode()  # ensure_ascii writes it as the escape \ud800


def pruning_knob(name: str, value: Any) -> Callable[[str], bytes]:
    return lambda url: json.dumps(chat(url, pruning={"knobs": {name: value}})).encode()


def frames(**options: Any) -> Callable[[str], bytes]:
    return lambda url: json.dumps({"video_url": url, "media": options}).encode()


CHAT = "/v1/chat/completions"
HTTP_CASES = [
    # name, path, body(video_url) -> bytes, headers (AUTH unless given), status, text the message holds
    ("bearer token not ASCII", CHAT, with_fields(), {"Authorization": "Bearer cl\u00e9".encode()}, 401, "API key"),
    ("bearer token not UTF-8", CHAT, with_fields(), {"Authorization": b"Bearer \xff\xfe"}, 401, "API key"),
    ("fps NaN", CHAT, with_media(fps=float("nan")), None, 400, "'fps' must be a finite number"),
    ("fps infinite", CHAT, with_media(fps=float("inf")), None, 400, "'fps' must be a finite number"),
    ("fps 1e308", CHAT, with_media(fps=1e308), None, 400, "'fps' must be a finite number > 0 and <= 1000"),
    ("start_time_s NaN", CHAT, with_media(start_time_s=float("nan")), None, 400, "'start_time_s' must be"),
    ("start_time_s -inf", CHAT, with_media(start_time_s=float("-inf")), None, 400, "'start_time_s' must be"),
    ("end_time_s infinite", CHAT, with_media(end_time_s=float("inf")), None, 400, "'end_time_s' must be"),
    ("end_time_s NaN", CHAT, with_media(end_time_s=float("nan")), None, 400, "'end_time_s' must be"),
    ("temperature NaN", CHAT, with_fields(temperature=float("nan")), None, 400, "'temperature' must be"),
    ("top_p NaN", CHAT, with_fields(top_p=float("nan")), None, 400, "'top_p' must be"),
    ("nested 5000 deep", CHAT, deeply_nested, None, 400, "nests arrays/objects too deeply"),
    ("body not UTF-8", CHAT, lambda url: b'{"messages": "\xff\xfe\xfd"}', None, 400, "not UTF-8"),
    ("seed 2**64", CHAT, with_fields(seed=2**64), None, 400, "'seed' must be an integer"),
    ("max_tokens 2**40", CHAT, with_fields(max_tokens=2**40), None, 400, "'max_tokens' must be an integer"),
    ("top_k 2**40", CHAT, with_fields(top_k=2**40), None, 400, "'top_k' must be an integer"),
    ("num_frames 2**40", CHAT, with_media(num_frames=2**40), None, 400, "'num_frames' must be an integer"),
    ("max_tokens 10**400", CHAT, with_fields(max_tokens=10**400), None, 400, "'max_tokens' must be an integer"),
    ("integer of 5000 digits", CHAT, lambda url: b'{"seed": ' + b"9" * 5000 + b"}", None, 400, "not valid JSON"),
    ("lone surrogate in text", CHAT, question_with_lone_surrogate, None, 400, "not valid Unicode"),
    ("data URL not ASCII", CHAT, lambda url: json.dumps(chat(url + "\u00e9")).encode(), None, 400, "ASCII"),
    ("pruning knob NaN", CHAT, pruning_knob("kv_keep_ratio", float("nan")), None, 400, "kv_keep_ratio"),
    ("body not an object", CHAT, lambda url: b"[1, 2]", None, 400, "must be a JSON object"),
    # vLLM refuses an empty stop string too: it was dropped, hiding the client's bug.
    ("stop empty", CHAT, with_fields(stop=""), None, 400, "'stop': stop cannot contain an empty string"),
    ("stop list with an empty string", CHAT, with_fields(stop=["a", ""]), None, 400,
     "'stop': stop cannot contain an empty string"),
    # Which one wins was unsaid (vLLM's loaders take the smaller count, transformers refuses the pair).
    ("fps with num_frames", CHAT, with_media(fps=1), None, 400,
     "'media': fps and num_frames: send num_frames (exactly that many frames) or fps"),
    ("body sent as text/plain", CHAT, with_fields(), {**AUTH, "Content-Type": "text/plain"}, 415,
     "'Content-Type: application/json'"),
    ("frames: fps NaN", "/demo/frames", frames(fps=float("nan")), None, 400, "'fps' must be a finite number"),
    ("frames: not UTF-8", "/demo/frames", lambda url: b'{"video_url": "\xff"}', None, 400, "not UTF-8"),
    ("frames: too deep", "/demo/frames", deeply_nested, None, 400, "too deeply"),
]  # fmt: skip


def assert_clean_json_error(response: Response, status: int, match: str) -> str:
    assert response.status == status, response.body[:500]
    assert response.headers["content-type"].startswith("application/json")
    text = response.body.decode()
    message = response.json()["error"]["message"]
    assert match in message, message
    assert_no_internals(text)
    return message


def assert_no_internals(text: str) -> None:
    assert "Traceback" not in text and ".py" not in text and str(ROOT) not in text, text


@pytest.mark.parametrize(
    "path,make_body,headers,status,match",
    [case[1:] for case in HTTP_CASES],
    ids=[case[0] for case in HTTP_CASES],
)
def test_malformed_http_request(stack, video_url, path, make_body, headers, status, match):
    response = asyncio.run(request(stack.http_port, "POST", path, make_body(video_url), headers or AUTH))
    assert_clean_json_error(response, status, match)


def _grpc_ask(stack, header: gateway_pb2.AskHeader, data: bytes) -> grpc.RpcError:
    messages = [gateway_pb2.AskRequest(header=header)]
    messages += [gateway_pb2.AskRequest(media_chunk=data)] if data else []
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Ask(iter(messages), metadata=[("authorization", f"Bearer {API_KEY}")], timeout=60))
    return info.value


GRPC_CASES = [
    # name, header fields, send the media bytes?, text the message holds
    ("fps NaN", {"sampling": common_pb2.VideoSampling(fps=float("nan"))}, True, "fps must be a finite number"),
    ("start_time_s inf", {"sampling": common_pb2.VideoSampling(start_time_s=float("inf"))}, True, "start_time_s"),
    ("fps 1e308", {"sampling": common_pb2.VideoSampling(fps=1e308)}, True, "fps must be at most 1000"),
    ("end_time_s NaN", {"sampling": common_pb2.VideoSampling(end_time_s=float("nan"))}, True, "end_time_s"),
    ("temperature NaN", {"generation": common_pb2.GenerationParams(temperature=float("nan"))}, True, "temperature"),
    ("top_p inf", {"generation": common_pb2.GenerationParams(top_p=float("inf"))}, True, "top_p"),
    ("sha256 not hex", {"media_sha256": "not-a-hash"}, False, "media_sha256 must be"),
    ("sha256 upper case", {"media_sha256": "AB" * 32}, False, "media_sha256 must be"),
    ("sha256 a path", {"media_sha256": "../" * 21 + "x"}, False, "media_sha256 must be"),
    ("pruning knob NaN", {"pruning": common_pb2.PruningOptions(knobs={"kv_keep_ratio": "nan"})}, True,
     "kv_keep_ratio"),
    ("stop empty", {"generation": common_pb2.GenerationParams(stop=["a", ""])}, True,
     "stop cannot contain an empty string"),
    ("allowed id outside the vocabulary", {"generation": common_pb2.GenerationParams(allowed_token_ids=[3, 512])},
     True, "allowed_token_ids: token id 512 is outside 0 to 511"),
    ("bad word of spaces", {"generation": common_pb2.GenerationParams(bad_words=["red", "  "])}, True,
     "bad_words cannot contain an empty string or one of spaces alone"),
    ("too many bad words", {"generation": common_pb2.GenerationParams(bad_words=["w"] * 129)}, True,
     "bad_words has 129 words; at most 128"),
    ("fps with num_frames", {"sampling": common_pb2.VideoSampling(fps=1, num_frames=4)}, True,
     "fps 1 and num_frames 4: send num_frames (exactly that many frames) or fps"),
    ("sha256 not the bytes'", {"media_sha256": "ab" * 32}, True,
     f"media_sha256 {'ab' * 32} is not the sha256 of the uploaded bytes"),
    # The deprecated question is about the media: without any, the gateway says what to send (it
    # was the encoder's "the media is empty", which did not name the text-only form).
    ("question without media", {}, False,
     'none was sent: send the video or image (media_chunk bytes, or media_sha256), or, for a question without '
     'media, send messages = [{role: "user", parts: [{type: "text", text: QUESTION}]}] instead of question'),
]  # fmt: skip


@pytest.mark.parametrize(
    "fields,send_media,match", [case[1:] for case in GRPC_CASES], ids=[case[0] for case in GRPC_CASES]
)
def test_malformed_grpc_request(stack, media_files, fields, send_media, match):
    data = media_files["mp4"].read_bytes() if send_media else b""
    header = gateway_pb2.AskHeader(question=QUESTION, media_num_bytes=len(data), **fields)
    error = _grpc_ask(stack, header, data)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert match in error.details()
    assert_no_internals(error.details())


def _post_head(length: int | None, expect: bool = False) -> dict[str, str | bytes]:
    head: dict[str, str | bytes] = {**AUTH, "Content-Type": "application/json"}
    head.update({"Content-Length": str(length)} if length is not None else {"Transfer-Encoding": "chunked"})
    return {**head, "Expect": "100-continue"} if expect else head


def test_oversized_bodies_get_413_before_they_are_read(stack):
    planned_bytes = 100 * MAX_BODY_BYTES  # what the client means to send; it sends a sliver

    async def run():
        declared = await Connection.open(stack.http_port)
        await declared.send_head("POST", CHAT, _post_head(planned_bytes))
        await declared.send(b'{"messages": "' + b"x" * 65536)
        by_length = await declared.read_response()
        await declared.close()

        chunked = await Connection.open(stack.http_port)
        await chunked.send_head("POST", CHAT, _post_head(None))
        num_sent = 0
        while num_sent <= MAX_BODY_BYTES:  # just past the limit, then nothing more
            await chunked.send_chunk(b"x" * 65536)
            num_sent += 65536
        by_counting = await chunked.read_response()
        await chunked.close()
        return by_length, by_counting, num_sent

    by_length, by_counting, num_sent = asyncio.run(run())
    for response in (by_length, by_counting):
        message = assert_clean_json_error(response, 413, f"at most {MAX_BODY_BYTES}")
        assert "--max-upload-bytes" in message
    assert num_sent < planned_bytes // 50


def test_past_the_body_budget_requests_get_429_with_retry_after(stack):
    async def run():
        held = await Connection.open(stack.http_port)  # most of a large body sent; its bytes are held
        await held.send_head("POST", CHAT, _post_head(MAX_BODY_BYTES - 100, expect=True))
        interim = await held.read_response()
        await held.send(b"x" * (MAX_BODY_BYTES - 200))
        # Until the gateway has read (and reserved) what was sent: a deadline, not a count of
        # tries, since a loaded machine (CI) took more than 100 x 50 ms to read it.
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            second = await request(stack.http_port, "POST", CHAT, b"x" * 200_000, AUTH)
            if second.status != 400 or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
        await held.send(b"x" * 100)  # completing it ends the request (bad JSON)
        held_final = await held.read_response()
        await held.close()
        return interim, second, held_final

    interim, second, held_final = asyncio.run(run())
    assert interim.status == 100
    assert_clean_json_error(second, 429, "--max-inflight-body-bytes")
    assert second.headers["retry-after"] == "1"
    assert_clean_json_error(held_final, 400, "not valid JSON")


def test_a_client_past_its_requests_in_flight_gets_429_and_resource_exhausted(stack, media_files):
    async def hold_two() -> list[Connection]:
        held = []
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            conn = await Connection.open(stack.http_port)
            await conn.send_head("POST", CHAT, _post_head(2, expect=True))
            assert (await conn.read_response()).status == 100  # admitted, body held back
            held.append(conn)
        return held

    async def finish(held: list[Connection]) -> list[Response]:
        out = []
        for conn in held:
            await conn.send(b"[]")
            out.append(await conn.read_response())
            await conn.close()
        return out

    loop = asyncio.new_event_loop()
    try:
        held = loop.run_until_complete(hold_two())
        http_third = loop.run_until_complete(request(stack.http_port, "POST", CHAT, b"[]", AUTH))
        data = media_files["mp4"].read_bytes()
        grpc_error = _grpc_ask(
            stack, gateway_pb2.AskHeader(question=QUESTION, media_num_bytes=len(data)), data
        )
        with EpdClient(stack.gateway, timeout_s=60, api_key=API_KEY, retry=NO_RETRY) as client:
            with pytest.raises(EpdError, match="--max-requests-per-client") as sdk_error:
                client.ask(data, QUESTION, max_new_tokens=2)
        finished = loop.run_until_complete(finish(held))
    finally:
        loop.close()

    assert_clean_json_error(http_third, 429, "--max-requests-per-client")
    assert http_third.headers["retry-after"] == "1"
    # One count per client over both front doors: the gRPC call is the same client's third.
    assert grpc_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-requests-per-client" in grpc_error.details()
    # The SDK keeps HTTP's 429-not-413: busy, with when to retry (it dropped the server's mark).
    assert sdk_error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and sdk_error.value.retry_after_s == 1
    for response in finished:
        assert_clean_json_error(response, 400, "must be a JSON object")


def test_an_sdk_upload_over_the_limit_is_not_marked_busy(stack):
    """A limit (HTTP's 413: send less) carries no retry mark, so a RetryPolicy that lists
    RESOURCE_EXHAUSTED does not send the same too-large video again (`RetryPolicy.should_retry`)."""
    retry = RetryPolicy(
        max_attempts=3, retryable=(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
    )
    with EpdClient(stack.gateway, timeout_s=60, api_key=API_KEY, retry=retry) as client:
        with pytest.raises(EpdError, match="--max-upload-bytes") as info:
            client.ask(b"\0" * (UPLOAD_LIMIT_BYTES + 1), QUESTION, max_new_tokens=2)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_after_s is None


def test_the_sdk_sends_what_the_other_doors_refuse(stack, media_files):
    """An empty stop string was dropped by the SDK (so the server never saw the client's bug), and
    fps with num_frames is refused as on HTTP: the same INVALID_ARGUMENT, not a silent choice."""
    with EpdClient(stack.gateway, timeout_s=60, api_key=API_KEY) as client:
        for options, match in (
            ({"stop": ""}, "stop cannot contain an empty string"),
            ({"fps": 2.0, "num_frames": 4}, "fps 2 and num_frames 4: send num_frames"),
        ):
            with pytest.raises(EpdError, match=match) as info:
                client.ask(media_files["mp4"], QUESTION, max_new_tokens=2, **options)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_media_sha256_that_is_not_the_uploads_is_refused_naming_both(stack, media_files):
    """The gateway routes by the header's hash (the encoder replica whose cache holds it) while the
    encoder hashed the bytes and used its own: a wrong hash sent the media to a replica that later
    references by the right hash would miss. The encoder, which hashes the bytes anyway, refuses."""
    import hashlib

    data = media_files["mp4"].read_bytes()
    wrong = hashlib.sha256(b"other media").hexdigest()
    header = gateway_pb2.AskHeader(question=QUESTION, media_num_bytes=len(data), media_sha256=wrong)
    error = _grpc_ask(stack, header, data)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert wrong in error.details() and hashlib.sha256(data).hexdigest() in error.details()


# -- the stack still serves (keep these last) ---------------------------------------------------


def test_a_good_http_request_is_answered_afterwards(stack, video_url):
    body = json.dumps(chat(video_url, media={"num_frames": 4}, seed=2**40, temperature=0.7)).encode()
    response = asyncio.run(request(stack.http_port, "POST", CHAT, body, AUTH))
    assert response.status == 200, response.body[:500]
    completion = response.json()
    assert completion["object"] == "chat.completion"
    assert completion["epd"]["token_ids"] and completion["epd"]["num_frames"] == 4


def test_a_good_grpc_request_is_answered_afterwards(stack, media_files):
    with EpdClient(stack.gateway, timeout_s=120, api_key=API_KEY) as client:
        result = client.ask(media_files["mp4"], QUESTION, num_frames=4, max_new_tokens=4)
    assert result.token_ids


def test_health_afterwards(stack):
    response = asyncio.run(request(stack.http_port, "GET", "/health"))
    assert response.status == 200 and response.json() == {"status": "ok"}
    assert stack.alive()


def test_a_request_of_n_choices_counts_once_against_its_clients_requests_in_flight(stack, video_url):
    """With one of its two slots held, the client's request of 16 choices runs: n choices are one
    request to --max-requests-per-client (vLLM takes any n up to its bound), and the third request
    is refused as before, whatever its n."""

    async def run() -> tuple[Response, Response]:
        held = await Connection.open(stack.http_port)
        await held.send_head("POST", CHAT, _post_head(2, expect=True))
        assert (await held.read_response()).status == 100  # admitted, its body held back
        body = json.dumps(chat(video_url, n=16, temperature=1.0, seed=7, max_tokens=1)).encode()
        answered = await request(stack.http_port, "POST", CHAT, body, AUTH)
        await held.send(b"[]")
        await held.read_response()  # ends it (a 400): the slot is back
        slots = [await Connection.open(stack.http_port) for _ in range(MAX_REQUESTS_PER_CLIENT)]
        for conn in slots:
            await conn.send_head("POST", CHAT, _post_head(2, expect=True))
            assert (await conn.read_response()).status == 100
        refused = await request(stack.http_port, "POST", CHAT, body, AUTH)
        await held.close()
        for conn in slots:  # ended as the other tests end them
            await conn.send(b"[]")
            await conn.read_response()
            await conn.close()
        return answered, refused

    answered, refused = asyncio.run(run())
    assert answered.status == 200, answered.body
    assert len(answered.json()["choices"]) == 16
    assert_clean_json_error(refused, 429, "--max-requests-per-client")
