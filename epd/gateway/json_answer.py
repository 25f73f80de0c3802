"""Answer bodies too large to write on the event loop: one that carries a prompt's logprobs.

At `MAX_PROMPT_LOGPROB_ENTRIES` a request's answer is vLLM's JSON of half a million logprob entries:
building its dicts and writing its text took the gateway's event loop 0.9 s in one go here (3 s on
a loaded machine), and every other client's stream, over both APIs, stood still meanwhile
(docs/benchmarks.md, "Prompt logprobs on the event loop"). So such a body is built and written on a
worker thread (`json_answer`). A thread alone is not enough: `json.dumps` writes a whole value in
one C call that holds the GIL throughout (0.5 s for that answer), so `json_bytes` writes a long
list a slice at a time, and between slices the loop gets its turn (Python hands the GIL over every
`sys.getswitchinterval()`, 5 ms).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

LIST_SLICE_ITEMS = 512
"""A list longer than this is written this many items at a time. One prompt position's entry with
k = 20 top tokens is about 1 KB of JSON, so a slice is about 0.5 MB: a few ms in one C call."""


def json_bytes(value: Any) -> bytes:
    """`json.dumps(value).encode()`, the same bytes, with every list longer than `LIST_SLICE_ITEMS`
    (at any depth) written a slice at a time."""
    parts: list[bytes] = []  # bytes as they are written: no whole text beside the whole bytes
    _write(value, parts)
    return b"".join(parts)


def _write(value: Any, parts: list[bytes]) -> None:
    if isinstance(value, dict):
        parts.append(b"{")
        for i, (key, item) in enumerate(value.items()):
            # `"key": ` as json.dumps writes it (its rules for a number's, a bool's or None's key)
            parts.append(((", " if i else "") + json.dumps({key: None})[1:-5]).encode())
            _write(item, parts)
        parts.append(b"}")
    elif isinstance(value, (list, tuple)) and len(value) > LIST_SLICE_ITEMS:
        parts.append(b"[")
        for start in range(0, len(value), LIST_SLICE_ITEMS):
            if start:
                parts.append(b", ")
            parts.append(json.dumps(list(value[start : start + LIST_SLICE_ITEMS]))[1:-1].encode())
        parts.append(b"]")
    elif isinstance(value, (list, tuple)):
        parts.append(b"[")
        for i, item in enumerate(value):
            if i:
                parts.append(b", ")
            _write(item, parts)
        parts.append(b"]")
    else:
        parts.append(json.dumps(value).encode())


async def json_answer(build: Callable[[], Any], off_loop: bool) -> web.Response:
    """`web.json_response(build())`, the same response; `off_loop`: `build` and the writing run on
    a worker thread (an answer with a prompt's logprobs), the event loop free meanwhile."""
    if not off_loop:
        return web.json_response(build())
    body = await asyncio.to_thread(lambda: json_bytes(build()))
    return web.Response(body=body, content_type="application/json", charset="utf-8")
