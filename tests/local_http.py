"""Loopback HTTP for tests: a server that records every path asked of it (a test names its URL in
a payload, a playlist entry or a media URL, and then asserts that nothing fetched it), and the JSON
and SSE client calls the integration tests make of the gateway's HTTP API (`post_json`,
`sse_chunks`)."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager


def post_json(port: int, path: str, body: dict) -> tuple[int, dict]:
    """POST `body` to 127.0.0.1:`port``path`: (HTTP status, the JSON answer), errors included."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def sse_chunks(port: int, path: str, body: dict) -> list[dict]:
    """POST `body` with `"stream": true` to `path`: the answer's events' data (chat's chunks, the
    Responses API's events), `[DONE]` left out."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        raw = reply.read()
    return [json.loads(line[len(b"data: "):]) for line in raw.splitlines()
            if line.startswith(b"data: ") and line != b"data: [DONE]"]  # fmt: skip


class RecordingServer(http.server.ThreadingHTTPServer):
    seen: list[str]
    """Paths requested so far (every answer is 404)."""

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class _Handler(http.server.BaseHTTPRequestHandler):
    server: RecordingServer

    def do_GET(self):  # noqa: N802 - http.server's name
        self.server.seen.append(self.path)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@contextmanager
def recording_server() -> Iterator[RecordingServer]:
    """A RecordingServer on 127.0.0.1 (a free port), served on a thread while the block runs."""
    server = RecordingServer(("127.0.0.1", 0), _Handler)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
