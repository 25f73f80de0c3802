"""What aiohttp's HTTP protocol layer logs for the gateway: a client's malformed request is one
INFO line, not an ERROR with a traceback.

aiohttp logs every request it cannot parse (a bad header, a broken chunked body; the gateway
inflates gzip and deflate bodies itself and refuses other encodings, `epd.gateway.http_body`) and
every body it cannot drain after the answer as ERROR "Error handling request" / "Unhandled
exception" with a traceback: three tracebacks for one broken gzip body, when aiohttp inflated it,
so any client could fill the gateway's log at line rate and hide real errors. The API's own
answer to such a request is unchanged (a 400).
"""

from __future__ import annotations

import logging

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


class ClientFaultsAsInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        fault = _client_fault(record.exc_info[1] if record.exc_info else None)
        if fault is not None and record.levelno > logging.INFO:
            detail = " ".join(str(fault).split())  # aiohttp's messages span lines
            record.msg, record.args = "%s: %s", (record.getMessage(), detail)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


PROTOCOL_LOG.addFilter(ClientFaultsAsInfo())
