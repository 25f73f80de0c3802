"""The one place where domain errors (`epd.stages.errors`, `epd.video.types.MediaError`,
`epd.model_runtime.loader.ModelLoadError`, `epd.model_runtime.sampling.SamplingFailed` and
`InvalidConstraint`, `ConstraintBusy`) become gRPC status codes.

Engines raise domain errors with a message that tells the caller what to
change; servicer methods are wrapped by `rpc_errors`, which aborts the call with the mapped
status. Anything unexpected becomes INTERNAL with a generic message: internals (decoder text,
paths, addresses) never reach a client, and the full traceback goes to the server log.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError

from epd.model_runtime.loader import ModelLoadError
from epd.model_runtime.sampling import ConstraintBusy, InvalidConstraint, SamplingFailed
from epd.stages.errors import (
    DeadlineExceeded,
    EpdError,
    InvalidRequest,
    KvSourceLost,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServerMisconfigured,
    Unavailable,
)
from epd.stages.server_config import MAX_MESSAGE_BYTES
from epd.transport.aio_cancel import lost_while_sending
from epd.transport.status_metadata import RETRY_AFTER_KEY, retry_after_in
from epd.video.types import DecoderCrashed, MediaError, MediaLimitError

log = logging.getLogger(__name__)


# The one mapping from domain errors to gRPC status codes (most specific class first).
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    # The server's flags do not fit its model (`--reasoning-parser` on a model without the think
    # markers): the operator's to fix, as a model that does not load; the message says which flag.
    (ServerMisconfigured, grpc.StatusCode.FAILED_PRECONDITION),
    (KvSourceLost, grpc.StatusCode.ABORTED),
    (DecoderCrashed, grpc.StatusCode.UNAVAILABLE),
    (MediaLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MediaError, grpc.StatusCode.INVALID_ARGUMENT),
    # One request's scores could not be sampled (its settings or input): not the replica's failure,
    # so not a status the gateway sanitises, retries elsewhere or turns into a broken stream.
    (SamplingFailed, grpc.StatusCode.INVALID_ARGUMENT),
    # Too many slow structured-output compiles still run (they cannot be stopped): retry later,
    # marked for retry as a full queue (`retry_after_of`).
    (ConstraintBusy, grpc.StatusCode.RESOURCE_EXHAUSTED),
    # A structured-output constraint that does not compile (or no xgrammar to compile it): the
    # request's to change, wherever it is found (the front door, prefill or decode).
    (InvalidConstraint, grpc.StatusCode.INVALID_ARGUMENT),
    # The server's model, not the request, is wrong: nothing in the request can fix it. Its message
    # (the model's local path, the file at fault) goes to the server log, `MODEL_NOT_LOADED` to
    # the client.
    (ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),
    # A request message that is not protobuf (a stream's, parsed as the servicer reads it; a
    # one-message request's, parsed by `server.UnaryRequestParsing`): the caller's to fix. No
    # servicer parses protobuf of its own, so no other DecodeError can reach here.
    (DecodeError, grpc.StatusCode.INVALID_ARGUMENT),
)

MODEL_NOT_LOADED = "the server cannot load its model; its operator must fix it (the server log says why)"
"""What a client is told for a `ModelLoadError`, whose own message names paths on the server."""


REPLICA_STAYS_KEY = "epd-replica-stays"
"""Trailing metadata of an UNAVAILABLE that is one request's failure on a replica that goes on
serving (`DecoderCrashed`: its decoder child died and was replaced). The gateway then neither
counts the replica as lost nor sends the request to another replica (a video that crashes the
decoder would crash each one in turn), and passes the stage's own message on instead of its fixed
"unavailable" text, since it was written for the client. The client may still retry."""
_REPLICA_STAYS: tuple[type[BaseException], ...] = (DecoderCrashed,)


def _replica_stays(exc: grpc.aio.AioRpcError) -> bool:
    return any(key == REPLICA_STAYS_KEY for key, _ in exc.trailing_metadata() or ())


class UpstreamError(EpdError):
    """A downstream service answered with a status; the gateway passes it on (see `stage_error`)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s
        """Set when the stage said it was busy (`Busy`): the same request may succeed later."""


# Statuses that gRPC itself raises (no connection, deadline, transport faults) or that our
# services give only with a generic text: their details carry peer addresses and gRPC debug
# strings, never anything a client can act on. Every other status comes from `rpc_errors` of
# our own stage, whose message was written for the client.
_SANITISED = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "did not answer in time",
    grpc.StatusCode.INTERNAL: "failed",
    grpc.StatusCode.UNKNOWN: "failed",
    grpc.StatusCode.UNIMPLEMENTED: "failed",
    grpc.StatusCode.DATA_LOSS: "failed",
}


GRPC_MESSAGE_TOO_LARGE = "message larger than max"
"""In the RESOURCE_EXHAUSTED that gRPC raises itself for a message over a channel's limit ("Sent
message larger than max (5339167 vs. 4194304)"): gRPC's text, never one of our services'."""


def replica_lost(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed try says its replica is gone (not the request's own failure): UNAVAILABLE,
    or gRPC's INTERNAL for a send on a broken connection."""
    code = exc.code()
    if _replica_stays(exc):
        return False
    # gRPC's own INTERNAL for a send on a connection that has just broken: the replica is gone.
    return code == grpc.StatusCode.UNAVAILABLE or lost_while_sending(code, exc.details() or "")


def stage_error(
    exc: grpc.aio.AioRpcError, stage: str, request_id: str, logged: bool = False
) -> UpstreamError:
    """The client-safe error for a stage's failed call: `stage` is "encode", "prefill" or
    "decode". Transport-level statuses get a fixed message naming the stage and the request
    id (the detail goes to the server log under that id, unless the caller `logged` it already);
    our stage's own messages pass on."""
    code = exc.code()
    what = _SANITISED.get(code)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and GRPC_MESSAGE_TOO_LARGE in (exc.details() or ""):
        log.warning("request %s: %s stage -> %s: %s", request_id, stage, code.name, exc.details())
        return UpstreamError(
            code,
            f"the request is larger than the {stage} stage takes in one message "
            f"({MAX_MESSAGE_BYTES >> 20} MiB of conversation text and settings); send a "
            f"shorter conversation (request id {request_id})",
        )
    if what is None or _replica_stays(exc):
        return UpstreamError(
            code, exc.details() or f"{stage} stage failed (request id {request_id})", retry_after_of(exc)
        )
    if not logged:
        log.warning(
            "request %s: %s stage -> %s: %s | %s",
            request_id,
            stage,
            code.name,
            exc.details(),
            exc.debug_error_string(),
        )
    return UpstreamError(code, f"{stage} stage {what} (request id {request_id})")


def broken_stream(stage: str, num_tokens: int, request_id: str) -> UpstreamError:
    """A stage's replica failed after `num_tokens` tokens had gone to the client: nothing can be
    retried under the client (it holds part of an answer), so ABORTED (retry the whole request at
    a higher level), not UNAVAILABLE (which clients and proxies may retry as if nothing had
    happened). The replica's address goes to the server log, not to the client."""
    return UpstreamError(
        grpc.StatusCode.ABORTED,
        f"the {stage} replica failed after {num_tokens} tokens; the answer is incomplete; retry the "
        f"request (request id {request_id})",
    )


def failed_after_retry(err: UpstreamError, stage: str) -> UpstreamError:
    """`err` of a try that came after another replica of `stage` had failed (before any answer):
    says so, since e.g. a KV cache the first replica took may be gone for the second."""
    return UpstreamError(
        err.code,
        f"{err} (after a {stage} replica failed before answering and the request was retried)",
        err.retry_after_s,
    )


def retry_after_of(exc: BaseException) -> int | None:
    """Seconds to wait before retrying, when `exc` says its service was busy (None otherwise)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return None
        return retry_after_in(exc.trailing_metadata())
    return getattr(exc, "retry_after_s", None)


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The status code `status_of` gives `exc`, without its side effect (it logs the details of a
    sanitised upstream error, which a caller that only counts the call must not log again)."""
    if isinstance(exc, UpstreamError):
        return exc.code
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code()
    return grpc.StatusCode.INTERNAL  # another EpdError, or anything unexpected


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, client-safe message) for any exception."""
    code = code_of(exc)
    if isinstance(exc, ModelLoadError):
        return code, MODEL_NOT_LOADED
    if isinstance(exc, DecodeError):
        return (
            code,
            f"a request message is not valid protobuf ({exc}): send the messages protos/epd/v1 defines",
        )
    if isinstance(exc, (UpstreamError, EpdError)) or any(isinstance(exc, kind) for kind, _ in _CODES):
        return code, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        # Normally turned into `stage_error` at the call site; a raw one may hold addresses.
        if code in _SANITISED:
            log.warning("upstream call -> %s: %s", code.name, exc.details())
            return code, "an upstream service failed; the server log has details"
        return code, exc.details() or ""
    return code, "internal error; the server log has details"


def rpc_errors(method):
    """Wrap a grpc.aio servicer method (coroutine or async generator) so that errors abort the
    call with the mapped status instead of reaching grpc as an unknown exception."""

    async def _abort(context, exc: BaseException):
        code, message = status_of(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("internal error in %s", method.__qualname__)
        elif isinstance(exc, ModelLoadError):  # the detail the client is not told
            log.error("%s -> %s: %s", method.__qualname__, code.name, exc)
        else:
            log.info("%s -> %s: %s", method.__qualname__, code.name, message)
        retry_after_s = retry_after_of(exc)
        metadata: tuple[tuple[str, str], ...] = ()
        if retry_after_s is not None:
            metadata += ((RETRY_AFTER_KEY, str(retry_after_s)),)
        if isinstance(exc, _REPLICA_STAYS):
            metadata += ((REPLICA_STAYS_KEY, "1"),)
        await context.abort(code, message, trailing_metadata=metadata)

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def gen_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except (GeneratorExit, _AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - mapped in status_of
                await _abort(context, exc)

        return gen_wrapper

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except _AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped in status_of
            await _abort(context, exc)

    return wrapper


# context.abort raises this; it must pass through untouched.
_AbortError = grpc.aio.AbortError
