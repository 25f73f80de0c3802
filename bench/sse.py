"""An OpenAI-compatible server's streamed answer read as its JSON chunks: what the bench clients
that stream (bench/common.py's `ask`, bench/openai_load.py's load, bench/bench_upload_stall.py)
share, so that each reads epd, vLLM and `transformers serve` alike.

The stream is server-sent events: lines ending in \\n, \\r\\n or \\r, an event's `data:` lines
ended by a blank line. The bytes go in as they arrive (`SseChunks.feed`: a read may end anywhere,
in a line or between the \\r and \\n of one, or hold several events); out come the events' data
read as JSON. `data: [DONE]` ends the answer (`done`; what follows is not read). Comment lines
(`: keep-alive`, which epd sends until the first token, `--sse-keepalive`) and the other fields
(`event:`, `id:`, `retry:`) carry no chunk. An error mid-stream, after the 200 (vLLM's and epd's
`data: {"error": {...}}`, an older vLLM's `{"object": "error", ...}`, or an `event: error`), raises
RuntimeError("error in stream: ...").

Plain Python (no epd, no aiohttp): `bench/common.py`'s callers import nothing more for it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

DONE = b"[DONE]"


class SseChunks:
    """One streamed answer's parser: `feed` it every read, in order."""

    def __init__(self) -> None:
        self.done = False
        """`data: [DONE]` was read: the answer is complete."""
        self._pending = b""  # the start of a line not ended yet
        self._cr_ended = False  # the last line ended in \r: a \n opening the next read belongs to it
        self._data: list[bytes] = []  # the current event's data lines
        self._event = b""  # the current event's type (`event:`), b"" for a plain message

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The chunks of every event that `data` completes, in order (none once `done`)."""
        chunks: list[dict[str, Any]] = []
        if self.done:
            return chunks
        if self._cr_ended and data.startswith(b"\n"):
            data = data[1:]  # the \n of a CRLF whose \r ended the last read
        lines = (self._pending + data).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        self._pending = lines.pop()  # b"" when `data` ended a line
        self._cr_ended = data.endswith(b"\r")  # its line ended, but a \n may open the next read
        for line in lines:
            chunk = self._line(line)
            if self.done:
                break
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    def _line(self, line: bytes) -> dict[str, Any] | None:
        """One whole line: the chunk of the event it ends (a blank line), else None."""
        if not line:
            return self._dispatch()
        if line.startswith(b":"):
            return None  # a comment: a keep-alive
        name, _, value = line.partition(b":")
        value = value.removeprefix(b" ")
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._event = value
        return None  # `id:`, `retry:` and unknown fields: nothing the bench reads

    def _dispatch(self) -> dict[str, Any] | None:
        data, event = b"\n".join(self._data), self._event
        self._data, self._event = [], b""
        if not data and not event:
            return None  # a blank line between events, or after a comment
        if data.strip() == DONE:
            self.done = True
            return None
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise RuntimeError(f"not a JSON object in stream: {data[:300]!r}")
        if event == b"error" or chunk.get("error") or chunk.get("object") == "error":
            raise RuntimeError(f"error in stream: {str(chunk.get('error') or chunk)[:300]}")
        return chunk


def stream_chunks(reads: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The chunks of a stream read in pieces (`http.client`'s `iter(lambda: resp.read1(n), b"")`),
    until [DONE] or the end of the stream."""
    parser = SseChunks()
    for data in reads:
        yield from parser.feed(data)
        if parser.done:
            return


async def async_stream_chunks(reads: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any]]:
    """`stream_chunks` of an asynchronous stream (aiohttp's `resp.content.iter_any()`)."""
    parser = SseChunks()
    async for data in reads:
        for chunk in parser.feed(data):
            yield chunk
        if parser.done:
            return
