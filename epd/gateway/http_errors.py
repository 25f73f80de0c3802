"""The HTTP status and OpenAI error body of any error the gateway answers with (no HTTP in here):
the gRPC status a domain error maps to (`epd.transport.errors.status_of`, the one place) becomes
an HTTP status and an OpenAI error type, as vLLM's OpenAI server answers them. The chat, legacy
completions and Responses routes, the SSE stream's error event and the web demo share them."""

from __future__ import annotations

from typing import Any

import grpc

from epd.stages.errors import Busy
from epd.transport.errors import status_of

# gRPC status (from epd.transport.errors.status_of) -> HTTP status and OpenAI error type.
_HTTP_OF_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    # The model cannot be loaded (`ModelLoadError`): the server's to fix, not the request's; vLLM
    # answers a request to an engine that failed with 500 too.
    grpc.StatusCode.FAILED_PRECONDITION: (500, "server_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (413, "request_too_large"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.ABORTED: (502, "server_error"),  # a stage failed mid-answer (after its first token)
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def http_status_of(code: grpc.StatusCode) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of a gRPC status code."""
    return _HTTP_OF_STATUS.get(code, (500, "server_error"))


def http_error_of(exc: BaseException) -> tuple[int, str, str]:
    """(HTTP status, OpenAI error type, client-safe message) of any exception. A refusal for
    load (`Busy`: the front door's admission, or a stage's full queue or KV budget passed on with
    its retry mark) is a 429 to retry; every other limit is a 413."""
    if isinstance(exc, Busy) or getattr(exc, "retry_after_s", None):
        return 429, "rate_limit_error", str(exc)
    code, message = status_of(exc)
    status, error_type = http_status_of(code)
    # An error of the HTTP layer's own may name a status gRPC has no code for (408: the client's
    # body came too slowly, where DEADLINE_EXCEEDED alone would say 504, an upstream's delay).
    return getattr(exc, "http_status", status), error_type, message


def error_body(message: str, error_type: str, status: int) -> dict[str, Any]:
    """vLLM's error object: `code` is the HTTP status as an integer, in a response and in an error
    event of a stream alike (which has answered 200 already: the code says what it would be)."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}
