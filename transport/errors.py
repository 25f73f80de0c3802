"""Domain errors and the one place where they become gRPC status codes.

Engines raise these (or `video.types.MediaError`) with a message that tells the caller what to
change; servicer methods are wrapped by `rpc_errors`, which aborts the call with the mapped
status. Anything unexpected becomes INTERNAL with a generic message: internals (decoder text,
paths, addresses) never reach a client, and the full traceback goes to the server log.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from video.types import MediaError, MediaLimitError

log = logging.getLogger(__name__)


class EpdError(Exception):
    """Base of errors whose message is safe and useful to show a client."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequest(EpdError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(EpdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(EpdError):
    code = grpc.StatusCode.NOT_FOUND


class Unavailable(EpdError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(EpdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UpstreamError(EpdError):
    """A downstream service answered with a status; the gateway passes it on unchanged."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, client-safe message) for any exception."""
    if isinstance(exc, EpdError):
        return exc.code, str(exc)
    if isinstance(exc, MediaLimitError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, MediaError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.INTERNAL, "internal error; the server log has details"


def rpc_errors(method):
    """Wrap a grpc.aio servicer method (coroutine or async generator) so that errors abort the
    call with the mapped status instead of reaching grpc as an unknown exception."""

    async def _abort(context, exc: BaseException):
        code, message = status_of(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("internal error in %s", method.__qualname__)
        else:
            log.info("%s -> %s: %s", method.__qualname__, code.name, message)
        await context.abort(code, message)

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
