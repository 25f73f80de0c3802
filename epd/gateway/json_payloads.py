"""The base64 payloads of a request body's `data:` URLs, set aside before the JSON is parsed and
put back into the parsed strings after (`epd.gateway.http_body.parse_json`).

A chat request's bulk is one base64 string, hundreds of MB at most; the rest is a few KB. Parsed
whole, the body cost the event loop about 3 ms per MB in one C call (every other client's stream
stood still meanwhile), and memory several times its size: `json.loads` decodes the whole body
into one str first, 4 bytes a character once a single emoji is in the question, then copies the
string out of it. Set aside, the payload is copied once, as ASCII, and only the rest is parsed.

    body:        {"messages": [... {"url": "data:video/mp4;base64,AAAA....AAAA"} ...]}
    set aside:   {"messages": [... {"url": "data:video/mp4;base64,<marker>0x"} ...]}  + ["AAAA....AAAA"]
    parsed, then every string ending in <marker>Ix gets payload I back in place of it.

Only a run that is a whole JSON string's rest after `;base64,` and plainly base64 (the alphabet,
and `\\/`, JSON's optional escape of `/`) is set aside, so the parsed value is exactly what
`json.loads` gives; anything else stays in the JSON and is parsed as it is.
"""

from __future__ import annotations

import secrets
from typing import Any

MIN_PAYLOAD_CHARS = 1 << 16
"""Shorter runs stay in the JSON: setting them aside would save nothing worth the walk."""
_MARK = b";base64,"
_BASE64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


def set_aside(body: bytes | bytearray) -> tuple[bytes | bytearray, list[str], str]:
    """(the body with each large base64 run replaced by `<marker>I` + "x", the runs as str, the
    marker); the body itself and [] when it holds none."""
    if len(body) < MIN_PAYLOAD_CHARS or body.find(_MARK) < 0:
        return body, [], ""
    marker = "epd" + secrets.token_hex(16)
    while body.find(marker.encode()) >= 0:  # a marker the body does not hold already
        marker = "epd" + secrets.token_hex(16)
    pieces: list[bytes | bytearray] = []
    payloads: list[str] = []
    kept_from = 0
    at = body.find(_MARK)
    while at >= 0:
        start = at + len(_MARK)
        end = body.find(b'"', start)  # the string's end, unless a backslash escapes it (checked below)
        if end < 0:
            break
        payload = _plain_base64(body, start, end) if end - start >= MIN_PAYLOAD_CHARS else None
        if payload is not None:
            pieces += [body[kept_from:start], f"{marker}{len(payloads)}x".encode()]
            payloads.append(payload)
            kept_from = end
        at = body.find(_MARK, end)
    if not payloads:
        return body, [], ""
    pieces.append(body[kept_from:])
    return b"".join(pieces), payloads, marker


def _plain_base64(body: bytes | bytearray, start: int, end: int) -> str | None:
    """body[start:end] as the str JSON reads it, if it is base64 characters and `\\/` escapes only."""
    run = bytes(memoryview(body)[start:end])
    if b"\\" in run:
        run = run.replace(b"\\/", b"/")  # any other escape (or an escaped quote) leaves a backslash
    if run.translate(None, _BASE64_ALPHABET):
        return None
    return run.decode("ascii")


def put_back(parsed: Any, payloads: list[str], marker: str) -> Any:
    """`parsed` with each string that ends in `<marker>I` + "x" ending in payload I instead. Walked
    without recursion: the body's nesting is bounded by the parser, not by this walk."""
    if not payloads:
        return parsed

    def restored(value: str) -> str:
        at = value.rfind(marker)
        if at < 0 or not value.endswith("x"):
            return value
        index = value[at + len(marker) : -1]
        if not index.isdecimal() or int(index) >= len(payloads):
            return value
        return value[:at] + payloads[int(index)]

    if isinstance(parsed, str):
        return restored(parsed)
    stack = [parsed]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            if isinstance(key, str) and marker in key:  # a payload in an object's key
                del node[key]
                key = restored(key)
                node[key] = value
            if isinstance(value, str):
                if marker in value:
                    node[key] = restored(value)
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return parsed
