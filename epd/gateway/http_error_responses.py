"""The HTTP API's error answers as aiohttp responses: OpenAI-style JSON errors (their status and
body from `epd.gateway.http_errors`, the one mapping), aiohttp's own refusals as JSON errors too,
and the answer to a request whose handler raised."""

from __future__ import annotations

import logging

from aiohttp import web

from epd.gateway.admission import RETRY_AFTER_S
from epd.gateway.http_errors import error_body, http_error_of
from epd.transport import tracing

log = logging.getLogger(__name__)


def json_error(status: int, message: str, error_type: str) -> web.Response:
    """An OpenAI-style error; its message names the request id (`tracing.with_request_id`)."""
    response = web.json_response(
        error_body(tracing.with_request_id(message), error_type, status), status=status
    )
    if status == 429:
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def aiohttp_error_response(exc: web.HTTPException) -> web.Response:
    """aiohttp's own refusal (an unknown route, a wrong method, a body too large) as an
    OpenAI-style JSON error; a 405 keeps its Allow header (the methods the path takes)."""
    error_type = "request_too_large" if exc.status == 413 else "invalid_request_error"
    message = exc.text if exc.status == 413 and exc.text else (exc.reason or "error")
    response = json_error(exc.status, message, error_type)
    if "Allow" in exc.headers:
        response.headers["Allow"] = exc.headers["Allow"]
    return response


def exception_response(exc: BaseException) -> web.Response:
    """The JSON error answer to a request that raised `exc` (a 500 logged with its traceback)."""
    status, error_type, message = http_error_of(exc)
    if status == 500:
        log.exception("internal error in the HTTP API", exc_info=exc)
    return json_error(status, message, error_type)
