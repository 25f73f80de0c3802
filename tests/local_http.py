"""A loopback HTTP server that records every path asked of it: a test names its URL in a
payload (a playlist entry, a media URL) and then asserts that nothing fetched it."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager


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
