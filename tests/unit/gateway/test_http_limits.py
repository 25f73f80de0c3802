"""The HTTP API's body limits and admission on an in-process server (real sockets, raw HTTP so
that the test controls what is sent when): 413 before an oversized body is read, "100 Continue"
only after the checks, 429 + Retry-After past a client's slots or the process's body budget,
400/401 for bodies and headers that used to end in a 500. None of these reaches the pipeline."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import aiohttp
import pytest
from aiohttp import web

from epd.gateway.admission import max_body_bytes
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from tests.raw_http import Connection, request

UPLOAD_LIMIT_BYTES = 30_000
MAX_BODY_BYTES = max_body_bytes(UPLOAD_LIMIT_BYTES)  # 40,004 + 1 MiB of JSON allowance
PLANNED_BYTES = 50 * MAX_BODY_BYTES
"""What an oversized client means to send: far more than the server may read."""
API_KEY = "k1"


async def _serve(
    fn,
    max_requests_per_client: int = 8,
    max_inflight_body_bytes: int = 0,
    api_key: str = "",
    body_timeout_s: float = 300.0,
):
    config = GatewayConfig(
        max_upload_bytes=UPLOAD_LIMIT_BYTES,
        max_requests_per_client=max_requests_per_client,
        max_inflight_body_bytes=max_inflight_body_bytes,
        body_timeout_s=body_timeout_s,
        http=HttpApiConfig(port=0, api_keys=(api_key,) if api_key else ()),
    )
    api = HttpApi(config, Pipeline(None, None, None), GatewayMetrics())  # type: ignore[arg-type]
    runner = web.AppRunner(api.app(), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        return await fn(runner.addresses[0][1], api.admission)
    finally:
        await runner.cleanup()


def _post_head(length: int | None, expect: bool = False) -> dict[str, str | bytes]:
    head: dict[str, str | bytes] = {"Content-Type": "application/json"}
    head.update({"Content-Length": str(length)} if length is not None else {"Transfer-Encoding": "chunked"})
    return {**head, "Expect": "100-continue"} if expect else head


def _assert_json_error(response, status: int, match: str) -> None:
    assert response.status == status, response.body
    error = response.json()["error"]
    assert match in error["message"], error["message"]
    assert "Traceback" not in response.body.decode() and ".py" not in error["message"]


def test_content_length_over_the_limit_is_413_before_the_body_is_read():
    async def run(port, admission):
        conn = await Connection.open(port)
        await conn.send_head("POST", "/v1/chat/completions", _post_head(PLANNED_BYTES))
        await conn.send(b'{"messages": "' + b"x" * 1000)  # a first piece, then nothing more
        response = await conn.read_response()
        await conn.close()
        return response

    response = asyncio.run(_serve(run))
    _assert_json_error(response, 413, f"at most {MAX_BODY_BYTES}")
    assert "--max-upload-bytes" in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "request_too_large"
    assert response.headers["connection"] == "close"


def test_chunked_body_is_refused_once_it_passes_the_limit():
    async def run(port, admission):
        conn = await Connection.open(port)
        await conn.send_head("POST", "/v1/chat/completions", _post_head(None))
        num_sent = 0
        piece = b"x" * 65536
        while num_sent <= MAX_BODY_BYTES:  # just past the limit, then stop sending
            await conn.send_chunk(piece)
            num_sent += len(piece)
        response = await conn.read_response()  # arrives with the rest of the body never sent
        await conn.close()
        return response, num_sent, admission.num_reserved_bytes

    response, num_sent, reserved_after = asyncio.run(_serve(run))
    _assert_json_error(response, 413, f"accepts at most {MAX_BODY_BYTES}")
    assert num_sent < PLANNED_BYTES / 10
    assert reserved_after == 0


def test_continue_comes_only_after_the_checks():
    async def run(port, admission):
        too_big = await Connection.open(port)
        await too_big.send_head("POST", "/v1/chat/completions", _post_head(PLANNED_BYTES, expect=True))
        refused = await too_big.read_response()  # the final status instead of 100: nothing sent
        await too_big.close()

        ok = await Connection.open(port)
        body = b'{"messages": []}'
        await ok.send_head("POST", "/v1/chat/completions", _post_head(len(body), expect=True))
        interim = await ok.read_response()
        await ok.send(body)
        final = await ok.read_response()
        await ok.close()
        return refused, interim, final

    refused, interim, final = asyncio.run(_serve(run))
    _assert_json_error(refused, 413, "--max-upload-bytes")
    assert interim.status == 100
    _assert_json_error(final, 400, "'messages' must be a non-empty list")


def test_the_body_budget_refuses_with_429_and_comes_back():
    budget = MAX_BODY_BYTES + 1000  # room for one large body at a time

    async def run(port, admission):
        held = await Connection.open(port)  # sends most of a large body; the server holds its bytes
        await held.send_head("POST", "/v1/chat/completions", _post_head(MAX_BODY_BYTES - 10, expect=True))
        assert (await held.read_response()).status == 100
        await held.send(b"x" * (MAX_BODY_BYTES - 20))
        while admission.num_reserved_bytes < MAX_BODY_BYTES - 20:
            await asyncio.sleep(0.01)

        declared = await request(port, "POST", "/v1/chat/completions", b"x" * 2000)  # 2000 more: too many
        chunked = await Connection.open(port)
        await chunked.send_head("POST", "/v1/chat/completions", _post_head(None))
        await chunked.send_chunk(b"x" * 5000)
        chunked_response = await chunked.read_response()
        await chunked.close()

        await held.send(b"x" * 10)  # finishing it ends the request (bad JSON)
        held_response = await held.read_response()
        await held.close()
        after = await request(port, "POST", "/v1/chat/completions", b"x" * 2000)
        return declared, chunked_response, held_response, after, admission.num_reserved_bytes

    declared, chunked, held, after, reserved_after = asyncio.run(_serve(run, max_inflight_body_bytes=budget))
    for response in (declared, chunked):
        _assert_json_error(response, 429, "--max-inflight-body-bytes")
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "rate_limit_error"
    _assert_json_error(held, 400, "not valid JSON")
    _assert_json_error(after, 400, "not valid JSON")  # the budget came back
    assert reserved_after == 0


def test_an_announced_body_holds_no_budget_until_its_bytes_arrive():
    """Bytes announced in Content-Length were reserved before any arrived: two connections that
    announced the largest body and sent nothing held the whole default budget (twice the largest
    body), with no time limit, and every other client's upload got 429."""

    async def run(port, admission):
        idle = []
        for _ in range(2):
            conn = await Connection.open(port)
            await conn.send_head("POST", "/v1/chat/completions", _post_head(MAX_BODY_BYTES))
            await conn.send(b'{"messages": "')
            idle.append(conn)
        while admission.num_requests < 2:
            await asyncio.sleep(0.01)
        other = await request(port, "POST", "/v1/chat/completions", b"[]")
        reserved = admission.num_reserved_bytes
        for conn in idle:
            await conn.close()
        return other, reserved

    other, reserved = asyncio.run(_serve(run))
    _assert_json_error(other, 400, "must be a JSON object")  # served, not 429
    assert reserved <= 2 * len(b'{"messages": "') + len(b"[]")


def test_a_body_that_does_not_arrive_in_time_is_408_and_gives_its_bytes_back():
    async def run(port, admission):
        conn = await Connection.open(port)
        await conn.send_head("POST", "/v1/chat/completions", _post_head(1000))
        await conn.send(b'{"messages": ')  # then nothing more
        # Bounded here so that a server with no body deadline fails the test instead of hanging it.
        response = await asyncio.wait_for(conn.read_response(), 30)
        await conn.close()
        return response, admission.num_reserved_bytes, admission.num_requests

    response, reserved_after, requests_after = asyncio.run(_serve(run, body_timeout_s=0.5))
    _assert_json_error(response, 408, "did not arrive within 0.5 s (the server's --body-timeout)")
    assert response.json()["error"]["type"] == "timeout"
    assert response.headers["connection"] == "close"
    assert (reserved_after, requests_after) == (0, 0)


def test_a_client_past_its_requests_in_flight_gets_429():
    async def run(port, admission):
        held = []
        for _ in range(2):
            conn = await Connection.open(port)
            await conn.send_head("POST", "/v1/chat/completions", _post_head(2, expect=True))
            assert (await conn.read_response()).status == 100  # admitted, body not sent yet
            held.append(conn)
        third = await request(port, "POST", "/demo/frames", b"{}")  # the demo's body route counts too
        models = await request(port, "GET", "/v1/models")  # bodiless routes are not limited
        for conn in held:
            await conn.send(b"[]")
            _assert_json_error(await conn.read_response(), 400, "must be a JSON object")
            await conn.close()
        again = await request(port, "POST", "/v1/chat/completions", b"[]")
        return third, models, again, admission.num_requests

    third, models, again, num_requests_after = asyncio.run(_serve(run, max_requests_per_client=2))
    _assert_json_error(third, 429, "--max-requests-per-client")
    assert third.headers["retry-after"] == "1"
    assert models.status == 200
    _assert_json_error(again, 400, "must be a JSON object")
    assert num_requests_after == 0


def test_many_concurrent_large_bodies_get_429s_or_answers_and_the_server_stays_up():
    budget = 2 * MAX_BODY_BYTES

    async def run(port, admission):
        body = json.dumps({"messages": "x" * (MAX_BODY_BYTES - 100)}).encode()

        async def post(session):
            async with session.post(
                "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                return resp.status, resp.headers.get("Retry-After"), await resp.json()

        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            results = await asyncio.gather(*(post(session) for _ in range(8)))
            async with session.get("/health") as resp:
                health = resp.status
        return results, health, admission.num_reserved_bytes, admission.num_requests

    results, health, reserved_after, requests_after = asyncio.run(_serve(run, max_inflight_body_bytes=budget))
    for status, retry_after, body in results:
        assert status in (400, 429), body
        if status == 429:
            assert retry_after == "1" and "--max-inflight-body-bytes" in body["error"]["message"]
        else:
            assert "'messages' must be a non-empty list" in body["error"]["message"]
    assert health == 200
    assert (reserved_after, requests_after) == (0, 0)


@pytest.mark.parametrize(
    "body,headers,status,match",
    [
        (b'{"model": "epd", "messages": "\xff\xfe"}', {}, 400, "not UTF-8"),
        (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400, "nests arrays/objects too deeply"),
        (b'{"messages": [], "seed": ' + b"9" * 5000 + b"}", {}, 400, "not valid JSON"),
        (b'{"media": {"fps": NaN}, "messages": [{"role": "user", "content": [{"type": "video_url", '
         b'"video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]}', {}, 400, "'fps' must be a finite number"),
        (b"[]", {"Authorization": "Bearer cl\xc3\xa9"}, 401, "missing or wrong API key"),
        (b"[]", {"Authorization": b"Bearer \xff\xfe"}, 401, "missing or wrong API key"),
        (b"[]", {"Authorization": f"Bearer {API_KEY}"}, 400, "must be a JSON object"),
        (b"not gzip", {"Content-Encoding": "gzip", "Authorization": f"Bearer {API_KEY}"}, 400,
         "not valid gzip data"),
        (b"not deflate", {"Content-Encoding": "deflate", "Authorization": f"Bearer {API_KEY}"}, 400,
         "not valid deflate data"),
    ],
)  # fmt: skip
def test_malformed_bodies_and_headers_get_4xx_json(body, headers, status, match):
    async def run(port, admission):
        return await request(port, "POST", "/v1/chat/completions", body, headers)

    _assert_json_error(asyncio.run(_serve(run, api_key=API_KEY if headers else "")), status, match)


def test_data_url_that_is_not_ascii_or_base64_is_400():
    async def run(port, admission):
        out = []
        for url in ("data:video/mp4;base64,AAAA\u00e9", "data:video/mp4;base64,A$AA", "data:video/mp4,AAAA"):
            content = [{"type": "text", "text": "q"}, {"type": "video_url", "video_url": {"url": url}}]
            body = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
            out.append(await request(port, "POST", "/v1/chat/completions", body))
        too_big = "data:video/mp4;base64," + "A" * (UPLOAD_LIMIT_BYTES * 4 // 3 + 8)
        content = [{"type": "text", "text": "q"}, {"type": "video_url", "video_url": {"url": too_big}}]
        body = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
        out.append(await request(port, "POST", "/v1/chat/completions", body))
        return out

    not_ascii, not_base64, not_base64_url, too_big = asyncio.run(_serve(run))
    _assert_json_error(not_ascii, 400, "must be ASCII")
    _assert_json_error(not_base64, 400, "not valid base64")
    _assert_json_error(not_base64_url, 400, "data: URLs must be base64")
    _assert_json_error(too_big, 413, f"at most {UPLOAD_LIMIT_BYTES} bytes")


def test_a_compressed_body_is_limited_by_its_inflated_size():
    inflated = b'{"messages": "' + b"x" * (2 * MAX_BODY_BYTES) + b'"}'
    compressed = gzip.compress(inflated)
    assert len(compressed) < MAX_BODY_BYTES // 10

    async def run(port, admission):
        response = await request(
            port, "POST", "/v1/chat/completions", compressed, {"Content-Encoding": "gzip"}
        )
        return response, admission.num_reserved_bytes

    response, reserved_after = asyncio.run(_serve(run))
    _assert_json_error(response, 413, f"accepts at most {MAX_BODY_BYTES}")
    assert reserved_after == 0


@pytest.mark.parametrize("encoding", ["br", "zstd", "BR", "compress", "gzip, br"])
def test_an_unsupported_content_encoding_is_415_json_naming_the_supported_ones(encoding):
    """aiohttp answered br and zstd (without their optional packages) with a plain-text 400 of its
    own, before any handler: no JSON error, no request id. Codings it does not know (compress) went
    through undecoded and were "not valid JSON"."""

    async def run(port, admission):
        headers = {"Content-Encoding": encoding, "x-request-id": "encoding-test-1", "Expect": "100-continue"}
        return await request(port, "POST", "/v1/chat/completions", b"\x8b\x00 compressed", headers)

    response = asyncio.run(_serve(run))
    _assert_json_error(response, 415, f"Content-Encoding '{encoding}' is not supported")
    error = response.json()["error"]
    assert "gzip or deflate" in error["message"] and "identity" in error["message"]
    assert "(request id encoding-test-1)" in error["message"] and error["code"] == 415
    assert response.headers["x-request-id"] == "encoding-test-1"
    assert response.headers["accept-encoding"] == "gzip, deflate, identity"


def _deflate(data: bytes, wbits: int) -> bytes:
    compressor = zlib.compressobj(wbits=wbits)
    return compressor.compress(data) + compressor.flush()


def test_gzip_and_deflate_bodies_are_read():
    """A JSON body that is not an object gets 400 "must be a JSON object": it was inflated and
    parsed, in each form: gzip (one member, several, zero padding), zlib's deflate and raw deflate,
    and chunked so that the compressed stream is cut anywhere."""
    body = b"[" + b'"x", ' * 200_000 + b'"x"]'  # over one inflated piece
    forms = {
        "gzip": gzip.compress(body),
        "GZip": gzip.compress(body),
        "gzip members": gzip.compress(body[:1000]) + gzip.compress(body[1000:]) + b"\0" * 8,
        "deflate": _deflate(body, zlib.MAX_WBITS),
        "raw deflate": _deflate(body, -zlib.MAX_WBITS),
        "identity": body,
    }

    async def run(port, admission):
        answers = {}
        for name, data in forms.items():
            encoding = name.split()[1] if name.startswith("raw") else name.split()[0]
            answers[name] = await request(
                port, "POST", "/v1/chat/completions", data, {"Content-Encoding": encoding}
            )
        conn = await Connection.open(port)  # chunked, in 7-byte chunks
        try:
            await conn.send_head(
                "POST", "/v1/chat/completions", {**_post_head(None), "Content-Encoding": "gzip"}
            )
            for i in range(0, len(forms["gzip"]), 7):
                await conn.send_chunk(forms["gzip"][i : i + 7])
            await conn.send_chunk(b"")
            answers["gzip chunked"] = await conn.read_response()
        finally:
            await conn.close()
        answers["gzip cut short"] = await request(
            port, "POST", "/v1/chat/completions", forms["gzip"][:-20], {"Content-Encoding": "gzip"}
        )
        answers["deflate then more"] = await request(
            port, "POST", "/v1/chat/completions", forms["deflate"] + b"more", {"Content-Encoding": "deflate"}
        )
        return answers, admission.num_reserved_bytes

    answers, reserved_after = asyncio.run(_serve(run))
    for name in (*forms, "gzip chunked"):
        _assert_json_error(answers[name], 400, "must be a JSON object")
    _assert_json_error(answers["gzip cut short"], 400, "it is not valid gzip data")
    _assert_json_error(answers["deflate then more"], 400, "it is not valid deflate data")
    assert reserved_after == 0


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("POST", "/demo/frames"),
        ("GET", "/health"),
        ("POST", "/v2/nothing"),
        ("POST", "/v1/models"),
        ("GET", "/v1/models/%0A"),
        ("GET", "/%0A/x"),
    ],
)
def test_an_unsupported_expect_is_417_json_with_the_request_id_on_every_route(method, path):
    """It was answered outside the middleware: aiohttp's plain text on GET routes and on paths (or
    methods) no route takes, and no request id (neither in the message nor as x-request-id). A
    path with a newline (%0A) was matched by no route, the catch-all's `.*` included."""

    async def run(port, admission):
        return await request(port, method, path, b"{}", {"Expect": "foo", "x-request-id": "expect-test-1"})

    response = asyncio.run(_serve(run))
    _assert_json_error(
        response, 417, "the only Expect this server supports is 100-continue (request id expect-test-1)"
    )
    assert response.headers["x-request-id"] == "expect-test-1"


def test_a_wrong_method_is_405_json_naming_the_methods_and_an_unknown_path_404():
    async def run(port, admission):
        return [
            await request(port, "POST", "/v1/models", b"{}"),
            await request(port, "GET", "/v1/chat/completions", b""),
            await request(port, "DELETE", "/static/app.js", b""),
            await request(port, "GET", "/v2/nothing", b""),
        ]

    post_models, get_chat, delete_static, unknown = asyncio.run(_serve(run))
    _assert_json_error(post_models, 405, "Method Not Allowed")
    assert set(post_models.headers["allow"].split(",")) == {"GET", "HEAD"}
    assert get_chat.status == 405 and get_chat.headers["allow"] == "POST"
    assert delete_static.status == 405 and set(delete_static.headers["allow"].split(",")) == {"GET", "HEAD"}
    _assert_json_error(unknown, 404, "Not Found")


def test_a_body_of_millions_of_tiny_values_is_refused_before_parsing():
    """30 MB of `{},{},...` took 810 MB of the gateway's memory once parsed (about 10 GB at the
    default body limit); a chat request holds a few hundred values, its bulk one data: URL."""
    from epd.gateway.http_body import MAX_JSON_VALUES, parse_json
    from epd.stages.errors import InvalidRequest

    for body in (
        b"[" + b"{}," * MAX_JSON_VALUES + b"{}]",
        b'{"messages": [' + b"0," * MAX_JSON_VALUES + b"0]}",
        b'{"a": {' + b'"k":0,' * (MAX_JSON_VALUES // 2) + b'"k": 0}}',
    ):
        with pytest.raises(InvalidRequest, match=f"this server parses at most {MAX_JSON_VALUES}"):
            parse_json(body)
    url = "data:video/mp4;base64," + "A" * (4 * MAX_JSON_VALUES)  # large, but one value
    content = [
        {"type": "text", "text": "what, where: why?" * 1000},
        {"type": "video_url", "video_url": {"url": url}},
    ]
    body = json.dumps({"messages": [{"role": "user", "content": content}], "stop": [",", ":"]}).encode()
    assert parse_json(body)["messages"][0]["content"][1]["video_url"]["url"] == url


def test_a_clients_malformed_request_is_one_info_line_not_an_error_traceback(caplog):
    """aiohttp logged each request it could not parse or drain as ERROR with a traceback (three
    for one broken gzip body), so any client could fill the gateway's log and bury real errors.
    The gateway's server (`start_http_api`) logs them as one INFO line each; the answers are JSON
    (400; 415 for br, which aiohttp refused before any handler with a plain-text 400)."""
    import logging

    from epd.gateway.http_server import start_http_api
    from epd.stages.server_config import ServerConfig

    async def scenario():
        config = GatewayConfig(server=ServerConfig(port=0), max_upload_bytes=UPLOAD_LIMIT_BYTES,
                               http=HttpApiConfig(port=0))  # fmt: skip
        http = await start_http_api(config, Pipeline(None, None, None), GatewayMetrics())  # type: ignore[arg-type]
        try:
            out = []
            for encoding in ("gzip", "br"):
                out.append(
                    await request(
                        http.port,
                        "POST",
                        "/v1/chat/completions",
                        b"not compressed",
                        {"Content-Encoding": encoding, "Content-Type": "application/json"},
                    )
                )
            conn = await Connection.open(http.port)  # a broken chunked body: aiohttp's parser fails
            try:
                await conn.send_head("POST", "/v1/chat/completions", _post_head(None))
                await conn.send(b"zz\r\nnot a chunk\r\n")
                out.append(await conn.read_response())
            finally:
                await conn.close()
            return out
        finally:
            await http.stop(0.5)

    caplog.set_level(logging.INFO)
    gzip_answer, br_answer, chunked_answer = asyncio.run(scenario())
    _assert_json_error(gzip_answer, 400, "not valid gzip data")
    _assert_json_error(br_answer, 415, "Content-Encoding 'br' is not supported")
    assert chunked_answer.status == 400
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [(r.name, r.levelname, r.getMessage()) for r in loud]
    lines = [r.getMessage() for r in caplog.records if r.name == "epd.gateway.http_protocol"]
    assert any("chunk" in line.lower() for line in lines), lines
    assert all("\n" not in line for line in lines), lines


def test_malformed_requests_in_a_loop_are_one_line_a_minute_that_counts_the_rest(monkeypatch):
    """One INFO line per malformed request still let a client that sends them in a loop write a
    line per request. The gateway's server writes one a minute (FAULT_LINE_INTERVAL_S); the next
    says how many it left out. The minute passes on the filter's own clock, moved by the test."""
    from epd.gateway import protocol_log
    from epd.gateway.http_server import start_http_api
    from epd.stages.server_config import ServerConfig
    from tests.log_records import log_records

    now_s = [1000.0]
    monkeypatch.setattr(protocol_log.CLIENT_FAULTS, "clock", lambda: now_s[0])

    async def broken_chunked_body(port: int) -> int:
        conn = await Connection.open(port)
        try:
            await conn.send_head("POST", "/v1/chat/completions", _post_head(None))
            await conn.send(b"zz\r\nnot a chunk\r\n")
            return (await conn.read_response()).status
        finally:
            await conn.close()

    async def scenario():
        config = GatewayConfig(server=ServerConfig(port=0), http=HttpApiConfig(port=0))
        http = await start_http_api(config, Pipeline(None, None, None), GatewayMetrics())  # type: ignore[arg-type]
        try:
            statuses = [await broken_chunked_body(http.port) for _ in range(5)]
            now_s[0] += protocol_log.FAULT_LINE_INTERVAL_S
            return [*statuses, await broken_chunked_body(http.port)]
        finally:
            await http.stop(0.5)

    with log_records(protocol_log.PROTOCOL_LOG.name) as records:
        statuses = asyncio.run(scenario())
    assert statuses == [400] * 6
    lines = [record.getMessage() for record in records]
    assert len(lines) == 2 and all(record.levelname == "INFO" for record in records), lines
    assert "chunk" in lines[0].lower() and "left out" not in lines[0], lines
    assert "chunk" in lines[1].lower() and lines[1].endswith(
        "(4 more such lines left out since the last one)"
    ), lines
