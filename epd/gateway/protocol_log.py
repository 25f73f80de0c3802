"""What aiohttp's HTTP protocol layer logs for the gateway: a client's malformed request is one
INFO line, not an ERROR with a traceback.

aiohttp logs every request it cannot parse (a bad header, a broken chunked body; the gateway
inflates gzip and deflate bodies itself and refuses other encodings, `epd.gateway.http_body`) and
every body it cannot drain after the answer as ERROR "Error handling request" / "Unhandled
exception" with a traceback: three tracebacks for one broken gzip body, when aiohttp inflated it,
so any client could fill the gateway's log at line rate and hide real errors. They are one INFO
line, and at most one a minute (`FAULT_LINE_INTERVAL_S`): a client sending malformed requests in a
loop still wrote a line per request; the next line says how many were left out. The API's own
answer to such a request is unchanged (a 400).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

PROTOCOL_LOG = logging.getLogger("epd.gateway.http_protocol")
"""The logger the gateway's aiohttp server writes to (`web.AppRunner(logger=...)`), in place of
aiohttp's process-wide "aiohttp.server"."""

_CLIENT_FAULTS = (HttpProcessingError, RequestPayloadError)


def _client_fault(exc: BaseException | None) -> BaseException | None:
    """`exc` or an exception it was raised from, when it is the client's malformed request."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, _CLIENT_FAULTS):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


FAULT_LINE_INTERVAL_S = 60.0
"""At most one line per this many seconds about clients' malformed requests; the next one counts
the lines left out meanwhile."""


class ClientFaultsAsInfo(logging.Filter):
    """A client's malformed request: one INFO line without a traceback, at most one per
    `interval_s`. Other records pass unchanged."""

    def __init__(
        self, interval_s: float = FAULT_LINE_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()  # a filter runs on the logging thread, whichever it is
        self.reset()

    def reset(self) -> None:
        """Start a fresh window (a server that starts: the next fault gets its line)."""
        with self._lock:
            self._next_line_at = float("-inf")
            self._num_left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        fault = _client_fault(record.exc_info[1] if record.exc_info else None)
        if fault is None:
            return True
        now = self.clock()
        with self._lock:
            if now < self._next_line_at:
                self._num_left_out += 1
                return False
            self._next_line_at = now + self.interval_s
            num_left_out, self._num_left_out = self._num_left_out, 0
        detail = " ".join(str(fault).split())  # aiohttp's messages span lines
        more = f" ({num_left_out} more such lines left out since the last one)" if num_left_out else ""
        record.msg, record.args = "%s: %s%s", (record.getMessage(), detail, more)
        level = min(record.levelno, logging.INFO)
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.exc_info, record.exc_text = None, None
        return True


CLIENT_FAULTS = ClientFaultsAsInfo()
"""PROTOCOL_LOG's filter: one window per process, which holds one HTTP server (reset as it starts)."""
PROTOCOL_LOG.addFilter(CLIENT_FAULTS)
