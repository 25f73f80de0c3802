"""Domain errors: what went wrong, in words a client can act on. No gRPC here.

Engines and libraries raise these (or `epd.video.types.MediaError`); the transport layer maps them
to status codes in one place (`epd.transport.errors.status_of`), and the HTTP front door maps
those to HTTP statuses (`epd.gateway.http_errors.http_status_of`).
"""

from __future__ import annotations


class EpdError(Exception):
    """Base of errors whose message is safe and useful to show a client (INTERNAL when raised bare)."""


class InvalidRequest(EpdError, ValueError):
    """The request itself is wrong: change it (INVALID_ARGUMENT)."""


class ResourceExhausted(EpdError):
    """A limit was reached: smaller input, or retry later (RESOURCE_EXHAUSTED)."""


class Busy(ResourceExhausted):
    """A queue or budget is full *now*: the same request may succeed later (RESOURCE_EXHAUSTED,
    marked for retry: HTTP 429 + Retry-After, where any other ResourceExhausted is a 413, send
    less). The message names the flags that raise the limit."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotFound(EpdError):
    """Something the request names does not exist (any more) (NOT_FOUND)."""


class Unavailable(EpdError):
    """The service cannot take the request now; retrying may work (UNAVAILABLE)."""


class DeadlineExceeded(EpdError):
    """The work did not finish within its time limit (DEADLINE_EXCEEDED)."""


class KvSourceLost(EpdError):
    """The prefill replica that held a request's KV cache went away before a decoder had the cache
    (ABORTED): the decoders are fine, the request must be prefilled again (the gateway does that
    once, `epd.gateway.pipeline`)."""


class ServerMisconfigured(EpdError):
    """The server's own flags do not fit its model: its operator must change them, nothing in the
    request can (FAILED_PRECONDITION, HTTP 500). The message names the flag and the model."""


class PermissionDenied(EpdError):
    """The server's policy does not allow what the request asks for (PERMISSION_DENIED)."""
