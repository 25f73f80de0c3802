"""A body's data: URL payloads are set aside while its JSON is parsed (epd/gateway/json_payloads.py):
the parsed request is exactly `json.loads`'s, the payload never goes through the JSON parser, and
the rest is parsed off the event loop and under a size limit."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading

import pytest

from epd.gateway import http_body, json_payloads
from epd.gateway.http_body import MAX_JSON_BYTES, parse_json
from epd.stages.errors import InvalidRequest, ResourceExhausted

PAYLOAD = base64.b64encode(os.urandom(3 * json_payloads.MIN_PAYLOAD_CHARS)).decode()
"""Base64 with '/' and '+' in it, long enough to be set aside."""


def _chat(url: str, text: str = "what happens? \U0001f600", **extra) -> bytes:
    content = [{"type": "text", "text": text}, {"type": "video_url", "video_url": {"url": url}}]
    return json.dumps(
        {"messages": [{"role": "user", "content": content}], **extra}, ensure_ascii=False
    ).encode()


SET_ASIDE = [
    _chat("data:video/mp4;base64," + PAYLOAD),
    _chat("data:video/mp4;base64," + PAYLOAD).replace(b"/", b"\\/"),  # JSON's optional escape of '/'
    _chat("data:video/mp4;base64," + PAYLOAD, stop=["data:x;base64," + PAYLOAD]),  # two of them
    _chat("data:video/mp4;base64," + PAYLOAD, **{"k;base64," + PAYLOAD: 1}),  # one in a key
    _chat("data:video/mp4;base64," + PAYLOAD, text="see data:;base64," + PAYLOAD),  # one in a text
]
KEPT = [
    _chat("data:video/mp4;base64," + PAYLOAD[:100]),  # too short to be worth it
    _chat("data:video/mp4;base64," + PAYLOAD + "\n"),  # an escape but \/
    _chat("data:video/mp4;base64," + PAYLOAD + "\u00e9"),  # not ASCII
    _chat("data:video/mp4;base64," + PAYLOAD + '"'),  # an escaped quote: the string goes on
    _chat("data:video/mp4;base64, " + PAYLOAD),  # a space
    _chat("data:video/mp4;base64," + PAYLOAD[:8] + "\\/" + PAYLOAD[8:]),  # a backslash, then '/'
]


@pytest.mark.parametrize("body", SET_ASIDE + KEPT)
def test_the_parsed_body_is_exactly_json_loads(body):
    expected = json.loads(body)
    assert parse_json(body) == expected
    assert parse_json(bytearray(body)) == expected


def test_large_base64_strings_are_set_aside_and_nothing_else():
    for body in SET_ASIDE:
        rest, payloads, marker = json_payloads.set_aside(body)
        assert payloads and len(rest) < len(PAYLOAD) and marker.encode() in rest
    for body in KEPT:
        assert json_payloads.set_aside(body) == (body, [], "")


def test_what_is_not_json_stays_not_json():
    for body in (b'{"a": 1;base64,' + PAYLOAD.encode() + b'"}', b'{"a": "x;base64,' + PAYLOAD.encode()):
        with pytest.raises(InvalidRequest, match="not valid JSON"):
            parse_json(body)


def test_the_payload_does_not_go_through_the_json_parser(monkeypatch):
    """Parsed whole, the body cost the event loop about 3 ms per MB in one C call, and memory 4
    bytes a character of all of it (the decoded text) once the question held an emoji."""
    parsed_sizes = []
    real_loads = json.loads

    def recording_loads(text, *args, **kwargs):
        parsed_sizes.append(len(text))
        return real_loads(text, *args, **kwargs)

    monkeypatch.setattr(http_body.json, "loads", recording_loads)
    url = "data:video/mp4;base64," + PAYLOAD * 20
    parsed = parse_json(_chat(url))
    assert parsed["messages"][0]["content"][1]["video_url"]["url"] == url
    assert parsed_sizes and max(parsed_sizes) < 1000


def test_a_body_that_is_large_apart_from_its_payloads_is_refused_before_parsing():
    body = _chat("data:video/mp4;base64," + PAYLOAD, text="x" * MAX_JSON_BYTES)
    with pytest.raises(ResourceExhausted, match=f"this server parses at most {MAX_JSON_BYTES}"):
        parse_json(body)


def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch):
    threads = []
    real_parse = http_body.parse_json
    monkeypatch.setattr(
        http_body, "parse_json", lambda body: threads.append(threading.get_ident()) or real_parse(body)
    )

    class Request(dict):
        content_length = None
        version = None
        headers: dict = {}

        class content:  # noqa: N801 - aiohttp's attribute name
            @staticmethod
            async def iter_any():
                yield _chat("data:video/mp4;base64," + PAYLOAD * 6)

    async def read():
        return threading.get_ident(), await http_body.read_json_body(Request(), 1 << 30)  # type: ignore[arg-type]

    loop_thread, parsed = asyncio.run(read())
    assert parsed["messages"][0]["content"][1]["video_url"]["url"].endswith(PAYLOAD)
    assert threads and threads[0] != loop_thread
