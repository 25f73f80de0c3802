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
    0. its Content-Type must be application/json (`not_json_content_type`), else 415 before a
       byte is read, as vLLM refuses it: text/plain, form and multipart bodies are what a page of
       another site can POST without a CORS preflight, from browsers too old to send the
       Sec-Fetch-Site header `browser_guard` reads;
    4a. a gzip or deflate body is inflated here (aiohttp's own decoding is off,
       `AIOHTTP_HANDLER_ARGS`), piece by piece, each piece counted as it comes; any other
       Content-Encoding is refused with 415 before a byte is read (`unsupported_encoding`);
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
import zlib
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.web_protocol import RequestPayloadError

from epd.gateway import json_payloads
from epd.gateway.admission import Ticket
from epd.stages.errors import DeadlineExceeded, InvalidRequest, ResourceExhausted
from epd.transport.aio_cancel import within

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
        body = await within(_read_body(request, max_body_bytes, ticket), timeout_s)
    except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
        raise BodyTimedOut(
            f"the request body did not arrive within {timeout_s:g} s (the server's --body-timeout); "
            "send it faster, or a smaller or more compressed video"
        ) from None
    if len(body) < THREAD_PARSE_BYTES:
        return parse_json(body)
    return await asyncio.to_thread(parse_json, body)  # the event loop goes on between its C calls


SUPPORTED_ENCODINGS = ("gzip", "deflate", "identity")
"""The Content-Encodings of a request body the gateway reads (inflated by `Inflater`)."""

AIOHTTP_HANDLER_ARGS = {"auto_decompress": False}
"""aiohttp's request handler leaves bodies as they came (`web.Application(handler_args=...)`):
told `Content-Encoding: br` or `zstd` without their optional packages, aiohttp answered a plain-text
400 of its own before any handler (no JSON, no request id); and bodies are inflated by `Inflater`."""


def not_json_content_type(request: web.Request) -> str | None:
    """The request's Content-Type when it is not application/json (any parameters, such as
    charset, allowed; "" when the header is missing), None when it is: answered 415 before the
    body is read."""
    content_type = request.headers.get("Content-Type", "")
    if content_type.split(";", 1)[0].strip().lower() == "application/json":
        return None
    return content_type


def not_json_content_type_message(content_type: str) -> str:
    got = f"Content-Type {content_type.strip()[:60]!r}" if content_type.strip() else "no Content-Type"
    return f"the request body must be JSON sent with 'Content-Type: application/json' (got {got})"


def unsupported_encoding(request: web.Request) -> str | None:
    """The request's Content-Encoding when it is not one of SUPPORTED_ENCODINGS (None when it is,
    or when there is none): answered 415 before the body is read."""
    encoding = request.headers.get("Content-Encoding")
    if encoding is None or encoding.strip().lower() in ("", *SUPPORTED_ENCODINGS):
        return None
    return encoding


def unsupported_encoding_message(encoding: str) -> str:
    return (
        f"Content-Encoding {encoding.strip()[:40]!r} is not supported; send the JSON body as it is "
        f"(identity) or compressed with gzip or deflate"
    )


INFLATE_PIECE_BYTES = 256 << 10
"""Most inflated bytes made from a body's bytes at once: each piece is counted against the limits
before the next is made, so a small bomb cannot inflate past them, and the event loop goes on
between pieces."""


class Inflater:
    """A gzip or deflate body inflated piece by piece (`pieces`, then `end`); zlib.error when it is
    not what its Content-Encoding says. Several gzip members follow each other (as `gzip -c a b`
    writes); "deflate" is the zlib format, or raw deflate (what some clients send, as aiohttp reads)."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._stream: Any = None  # zlib's Decompress for the member being read

    def _start(self, first_byte: int) -> Any:
        if self.encoding == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        zlib_format = first_byte & 0x0F == 8  # zlib's header: compression method 8
        return zlib.decompressobj(zlib.MAX_WBITS if zlib_format else -zlib.MAX_WBITS)

    def pieces(self, data: bytes) -> Iterator[bytes]:
        """The inflated pieces of the body's next bytes, each at most INFLATE_PIECE_BYTES."""
        while True:
            if self._stream is None or self._stream.eof:
                if not data or (self._stream is not None and not data.strip(b"\0")):
                    return  # nothing left, or the zero padding gzip allows after its last member
                if self._stream is not None and self.encoding != "gzip":
                    raise zlib.error("bytes after the end of the deflate stream")
                self._stream = self._start(data[0])
            piece = self._stream.decompress(data, INFLATE_PIECE_BYTES)
            if piece:
                yield piece
            data = self._stream.unused_data if self._stream.eof else self._stream.unconsumed_tail
            if not data and not self._stream.eof and len(piece) < INFLATE_PIECE_BYTES:
                return  # all in: the next bytes of the body come with the next chunk
            # else: more input left, or a full piece (zlib may hold more output for no more input)

    def end(self) -> None:
        """zlib.error when the body stopped inside its compressed stream."""
        if self._stream is not None and not self._stream.eof:
            raise zlib.error("the compressed stream ends early")


async def _read_body(request: web.Request, max_body_bytes: int, ticket: Ticket | None) -> bytearray:
    # Grown as bytes arrive, not preallocated from Content-Length: a client that announces a
    # large body and sends nothing costs no memory. Each chunk (inflated, for a compressed body)
    # is reserved as it comes.
    body = bytearray()
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    inflater = Inflater(encoding) if encoding in ("gzip", "deflate") else None

    def take(piece: bytes) -> None:
        if len(body) + len(piece) > max_body_bytes:
            raise body_too_large(f"more than {max_body_bytes}", max_body_bytes)
        if ticket is not None:
            ticket.reserve_bytes(len(piece))
        body.extend(piece)

    try:
        async for chunk in request.content.iter_any():
            if inflater is None:
                take(chunk)
                continue
            for piece in inflater.pieces(chunk):
                take(piece)
                await asyncio.sleep(0)  # a large body's inflation shares the event loop
        if inflater is not None:
            inflater.end()
    except (RequestPayloadError, zlib.error):  # not the gzip/deflate it says, or broken chunking
        why = f"it is not valid {encoding} data" if inflater else "its chunked transfer encoding is broken"
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
