"""Reading an HTTP request's JSON body under the gateway's limits, without trusting its size:

    1. Content-Length over the limit -> 413 before a byte of the body is read;
    2. the declared length must fit in what is left of the process-wide body budget
       (`epd.gateway.admission`) -> 429 when it does not;
    3. only then does a client that sent `Expect: 100-continue` get its "100 Continue", so a
       refused client never sends the body at all;
    4. the body is read chunk by chunk, each chunk's bytes reserved from the budget as they arrive
       (429 when it is spent), and refused with 413 as soon as it passes the limit; the whole body
       must arrive within `--body-timeout` (408). Bytes are reserved as they arrive, never as
       announced: two connections that announced the largest body and sent nothing held the
       whole default budget, with no time limit, and every other upload got 429;
    5. it is parsed as UTF-8 JSON; an invalid, non-UTF-8, too deeply nested or too broad body
       (more than MAX_JSON_VALUES values: each costs tens of bytes once parsed) is a 400.

Memory: the raw body (N bytes) is parsed straight from the bytes and dropped right after; its
data: URL payloads are set aside first (`epd.gateway.json_payloads`): copied out (N), checked and
decoded to their str (N), so ~3N at its peak for a moment, 2N while the rest (at most
MAX_JSON_BYTES) is parsed. Parsed whole, the body's decoded text alone took 4N once a single
emoji was in it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.web_protocol import RequestPayloadError

from epd.gateway import json_payloads
from epd.gateway.admission import Ticket
from epd.stages.errors import DeadlineExceeded, InvalidRequest, ResourceExhausted

TICKET_KEY = web.RequestKey("epd_admission_ticket", Ticket)
"""Where the admission middleware leaves the request's ticket for `read_json_body`."""


def body_too_large(num_bytes: int | str, max_body_bytes: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"the request body is {num_bytes} bytes but this server accepts at most {max_body_bytes} "
        "(base64 media up to the server's --max-upload-bytes, plus the JSON around it); send a "
        "smaller or more compressed video"
    )


class BodyTimedOut(DeadlineExceeded):
    """The client did not send its whole body in time: HTTP 408 (the client's delay, not an
    upstream's 504)."""

    http_status = 408


async def read_json_body(request: web.Request, max_body_bytes: int, timeout_s: float = 300.0) -> Any:
    """The request's JSON body; raises ResourceExhausted (413), Overloaded (429), BodyTimedOut
    (408, not all of it within `timeout_s`) or InvalidRequest (400). The bytes are reserved on the
    request's admission ticket as they arrive; it gives them back when the request ends."""
    ticket = request.get(TICKET_KEY)
    declared = request.content_length
    if declared is not None:
        if declared > max_body_bytes:
            raise body_too_large(declared, max_body_bytes)
        if ticket is not None:
            ticket.check_room(declared)
    if request.version == HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue":
        # Sent only now (see `defer_continue`): the client learns it may send the body after the
        # checks above passed.
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
    try:
        body = await asyncio.wait_for(_read_body(request, max_body_bytes, ticket), timeout_s)
    except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
        raise BodyTimedOut(
            f"the request body did not arrive within {timeout_s:g} s (the server's --body-timeout); "
            "send it faster, or a smaller or more compressed video"
        ) from None
    if len(body) < THREAD_PARSE_BYTES:
        return parse_json(body)
    return await asyncio.to_thread(parse_json, body)  # the event loop goes on between its C calls


async def _read_body(request: web.Request, max_body_bytes: int, ticket: Ticket | None) -> bytearray:
    # Grown as bytes arrive, not preallocated from Content-Length: a client that announces a
    # large body and sends nothing costs no memory. Each chunk (inflated, for a compressed body)
    # is reserved as it comes.
    body = bytearray()
    try:
        async for chunk in request.content.iter_any():
            if len(body) + len(chunk) > max_body_bytes:
                raise body_too_large(f"more than {max_body_bytes}", max_body_bytes)
            if ticket is not None:
                ticket.reserve_bytes(len(chunk))
            body += chunk
    except RequestPayloadError:  # aiohttp could not inflate or de-chunk what arrived
        encoding = request.headers.get("Content-Encoding", "")
        why = f"it is not valid {encoding} data" if encoding else "its chunked transfer encoding is broken"
        raise InvalidRequest(
            f"the request body could not be read: {why}; send the JSON as it is, or compressed as its "
            "Content-Encoding says (gzip or deflate)"
        ) from None
    return body


THREAD_PARSE_BYTES = 1 << 20
"""Bodies this large or larger are parsed on a worker thread."""

MAX_JSON_VALUES = 1 << 20
"""Most JSON values one body may hold. A chat request has a few hundred (its texts are at most
prefill's 262,144 characters); what is large in it is one string, the data: URL. Parsed, a value
costs tens of bytes for the 2-3 of the body: 30 MB of `{},{},...` took 810 MB of the gateway's
memory, so a body at the default limit (about 358 MB) would have taken about 10 GB."""


def check_breadth(body: bytes | bytearray) -> None:
    """InvalidRequest when `body` may hold more than MAX_JSON_VALUES values, judged before parsing:
    every value but a container's first follows a comma, every member has a colon, and every
    container opens with a bracket (those in strings count too, so this is an upper bound)."""
    if len(body) <= MAX_JSON_VALUES:
        return  # each value takes at least one byte
    num_values = body.count(b",") + body.count(b":") + body.count(b"[") + body.count(b"{")
    if num_values > MAX_JSON_VALUES:
        raise InvalidRequest(
            f"the request body holds up to {num_values} JSON values (commas, colons, arrays, objects); "
            f"this server parses at most {MAX_JSON_VALUES}, and a chat request needs a few hundred"
        )


MAX_JSON_BYTES = 16 << 20
"""Most bytes of JSON parsed per body once its data: URL payloads are set aside
(`epd.gateway.json_payloads`): a chat request's texts are at most prefill's 262,144 characters
(1 MiB of UTF-8); a larger rest is refused before it costs a parse."""


def parse_json(body: bytes | bytearray) -> Any:
    """JSON from UTF-8 bytes (json also accepts UTF-16/32 with their BOM-less detection), no
    broader than MAX_JSON_VALUES values (`check_breadth`), its data: URL payloads set aside while
    the rest, at most MAX_JSON_BYTES, is parsed. CPU-bound for a large body (a few C calls over
    all of it): `read_json_body` runs it on a worker thread."""
    check_breadth(body)
    rest, payloads, marker = json_payloads.set_aside(body)
    if len(rest) > MAX_JSON_BYTES:
        raise ResourceExhausted(
            f"the request body is {len(rest)} bytes of JSON apart from the base64 payloads of its data: URLs; "
            f"this server parses at most {MAX_JSON_BYTES}: send the media as a base64 data: URL in UTF-8 JSON, "
            "and a shorter conversation"
        )
    try:
        return json_payloads.put_back(json.loads(rest), payloads, marker)
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not UTF-8 text; send JSON encoded as UTF-8") from None
    except RecursionError:
        raise InvalidRequest(
            "the request body nests arrays/objects too deeply; a chat request needs only a few levels"
        ) from None
    except ValueError as exc:  # json.JSONDecodeError, or an integer of thousands of digits
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise InvalidRequest(f"the request body is not valid JSON{where}") from None


async def defer_continue(request: web.Request) -> None:
    """Expect handler of every route: it sends nothing and refuses nothing. aiohttp's default sends
    "100 Continue" before any check, and answers any other Expect with a plain-text 417 outside
    the middleware (no request id, not OpenAI's error shape). `read_json_body` sends the 100 after
    its checks; the HTTP API's middleware answers `unsupported_expect`."""
    return None


def unsupported_expect(request: web.Request) -> bool:
    """An Expect header other than 100-continue (HTTP/1.1's only one): answered 417."""
    expect = request.headers.get("Expect")
    return expect is not None and expect.lower() != "100-continue"
