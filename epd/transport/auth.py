"""An optional API key on gRPC services: `authorization: Bearer <key>` metadata, the same header
the HTTP API checks, so one key (`--api-key` / `EPD_API_KEY`) guards both front-door APIs.

Only the methods under `protected_prefixes` are checked: health and reflection stay open, so
probes (compose, Kubernetes, `epd health`) need no key.
"""

from __future__ import annotations

import hmac

import grpc

MISSING_KEY_MESSAGE = (
    "missing or wrong API key; send metadata 'authorization: Bearer <key>' (SDK: api_key=...)"
)


def bearer_token(metadata) -> str:
    """The token of the first `authorization: Bearer ...` entry, or ""."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            scheme, _, token = str(value).partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return ""


def key_matches(token: str, api_key: str) -> bool:
    """Constant-time comparison of any two strings. Compared as UTF-8 bytes: `compare_digest`
    refuses non-ASCII str, and aiohttp hands header bytes that are not UTF-8 over as lone
    surrogates, which "surrogatepass" encodes instead of raising."""
    return hmac.compare_digest(token.encode("utf-8", "surrogatepass"), api_key.encode("utf-8", "surrogatepass"))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str, protected_prefixes: tuple[str, ...]) -> None:
        if not api_key:
            raise ValueError("ApiKeyInterceptor needs a non-empty api_key")
        self.api_key = api_key
        self.protected_prefixes = protected_prefixes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.protected_prefixes):
            return handler
        if key_matches(bearer_token(handler_call_details.invocation_metadata), self.api_key):
            return handler
        return _denying_handler(handler)


MAX_DRAINED_MESSAGES = 512
"""Request messages read and dropped before refusing a client-streaming call (see `_deny`)."""


async def _deny(request_or_iterator, context) -> None:
    if hasattr(request_or_iterator, "__aiter__"):
        # Aborting while the client is still sending makes its side fail with INTERNAL "Internal
        # error from Core" instead of our status (grpc.aio race), so read what it sends first:
        # dropped as it arrives, never stored, and only up to a bound.
        num_messages = 0
        async for _ in request_or_iterator:
            num_messages += 1
            if num_messages >= MAX_DRAINED_MESSAGES:
                break
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY_MESSAGE)


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call before reading it."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(_deny, handler.request_deserializer, handler.response_serializer)
