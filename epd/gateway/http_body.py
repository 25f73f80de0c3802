"""Reading an HTTP request's JSON body under the gateway's limits, without trusting its size:

    1. Content-Length over the limit -> 413 before a byte of the body is read;
    2. the declared length (or, for a chunked body, each chunk as it comes) is reserved from the
       process-wide body budget (`epd.gateway.admission`) -> 429 when it is spent;
    3. only then does a client that sent `Expect: 100-continue` get its "100 Continue", so a
       refused client never sends the body at all;
    4. the body is read chunk by chunk and refused with 413 as soon as it passes the limit;
    5. it is parsed as UTF-8 JSON; an invalid, non-UTF-8 or too deeply nested body is a 400.

Memory: the raw body (N bytes) is parsed straight from the bytes and dropped right after; the
parse needs the decoded text (N) and the data: URL string it yields (N), so ~3N at its peak.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.web_protocol import RequestPayloadError

from epd.gateway.admission import Ticket
from epd.stages.errors import InvalidRequest, ResourceExhausted

TICKET_KEY = web.RequestKey("epd_admission_ticket", Ticket)
"""Where the admission middleware leaves the request's ticket for `read_json_body`."""


def body_too_large(num_bytes: int | str, max_body_bytes: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"the request body is {num_bytes} bytes but this server accepts at most {max_body_bytes} "
        "(base64 media up to the server's --max-upload-bytes, plus the JSON around it); send a "
        "smaller or more compressed video"
    )


async def read_json_body(request: web.Request, max_body_bytes: int) -> Any:
    """The request's JSON body; raises ResourceExhausted (413), Overloaded (429) or
    InvalidRequest (400). The bytes are reserved on the request's admission ticket, which gives
    them back when the request ends."""
    ticket = request.get(TICKET_KEY)
    declared = request.content_length
    num_reserved = 0
    if declared is not None:
        if declared > max_body_bytes:
            raise body_too_large(declared, max_body_bytes)
        if ticket is not None:
            ticket.reserve_bytes(declared)
        num_reserved = declared
    if request.version == HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue":
        # Sent only now (see `defer_continue`): the client learns it may send the body after the
        # checks above passed.
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
    # Grown as bytes arrive, not preallocated from Content-Length: a client that announces a
    # large body and sends nothing costs no memory. Bytes past the reservation (a chunked body,
    # or a compressed one that aiohttp inflates) are reserved as they come.
    body = bytearray()
    try:
        async for chunk in request.content.iter_any():
            num_bytes = len(body) + len(chunk)
            if num_bytes > max_body_bytes:
                raise body_too_large(f"more than {max_body_bytes}", max_body_bytes)
            if num_bytes > num_reserved:
                if ticket is not None:
                    ticket.reserve_bytes(num_bytes - num_reserved)
                num_reserved = num_bytes
            body += chunk
    except RequestPayloadError:  # aiohttp could not inflate or de-chunk what arrived
        encoding = request.headers.get("Content-Encoding", "")
        why = f"it is not valid {encoding} data" if encoding else "its chunked transfer encoding is broken"
        raise InvalidRequest(
            f"the request body could not be read: {why}; send the JSON as it is, or compressed as its "
            "Content-Encoding says (gzip or deflate)"
        ) from None
    return parse_json(body)


def parse_json(body: bytes | bytearray) -> Any:
    """JSON from UTF-8 bytes (json also accepts UTF-16/32 with their BOM-less detection)."""
    try:
        return json.loads(body)
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
