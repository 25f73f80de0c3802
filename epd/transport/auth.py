"""Who may call a gRPC service.

- The front door: an optional API key, `authorization: Bearer <key>` metadata, the same header
  the HTTP API checks, so one key (`--api-key` / `EPD_API_KEY`) guards both front-door APIs.
  Only the methods under `protected_prefixes` are checked.
- The stages: the internal secret (`--internal-secret-file` / `EPD_INTERNAL_SECRET`), metadata
  `x-epd-internal-auth`, that the gateway and decode (pulling KV from prefill) present
  (`InternalSecretInterceptor`, `epd.transport.security.stage_channel`). The file may hold several,
  one a line: the first is presented, every one accepted (a rotation without downtime).

Health and reflection stay open either way, so probes (compose, Kubernetes, `epd health`) need
neither key nor secret.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Callable, Sequence

import grpc

from epd.transport.internal_secrets import InternalSecrets

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
    return hmac.compare_digest(
        token.encode("utf-8", "surrogatepass"), api_key.encode("utf-8", "surrogatepass")
    )


def any_key_matches(token: str, api_keys: Sequence[str]) -> bool:
    """Whether `token` is one of `api_keys`, comparing with every key (constant time each, no early
    exit), so the time says nothing about which key, or how many, came close."""
    found = False
    for key in api_keys:
        found |= key_matches(token, key)
    return found


INTERNAL_AUTH_KEY = "x-epd-internal-auth"
"""Metadata key of the internal secret."""
MISSING_SECRET_MESSAGE = (
    "this stage requires the internal secret (--internal-secret-file); it is not a public endpoint"
)
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Methods every caller may use: probes and tooling."""


def metadata_value(metadata, key: str) -> str:
    for k, value in metadata or ():
        if k.lower() == key:
            return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)
    return ""


class InternalSecretInterceptor(grpc.aio.ServerInterceptor):
    """A stage's check of the internal secret on every call but health and reflection; a call
    without one of `secrets` (or with another) is refused UNAUTHENTICATED before the servicer reads
    it. Several secrets: the current one and those a rotation still accepts (docs/security.md);
    each is compared in constant time (`any_key_matches`)."""

    def __init__(self, secrets: Sequence[str] | InternalSecrets) -> None:
        """`secrets`: fixed, or followed in their file (`InternalSecrets`: a rotation without a
        restart; the file's reader never lets them become empty)."""
        if not isinstance(secrets, InternalSecrets):
            secrets = InternalSecrets(secrets)
        if not secrets.current() or not all(secrets.current()):  # "" would let a call without the metadata in
            raise ValueError("InternalSecretInterceptor needs non-empty secrets")
        self.secrets = secrets

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        presented = metadata_value(handler_call_details.invocation_metadata, INTERNAL_AUTH_KEY)
        if presented and any_key_matches(presented, self.secrets.current()):
            return handler
        return _denying_handler(handler, MISSING_SECRET_MESSAGE)


RefusalCounter = Callable[[str, str], None]
"""Told of each call an interceptor refused: its method's full name ("/pkg.Service/Method") and the
status name its client got (UNAUTHENTICATED; CANCELLED when the client went away first)."""


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        api_keys: Sequence[str],
        protected_prefixes: tuple[str, ...],
        on_refused: RefusalCounter | None = None,
    ) -> None:
        """`on_refused`: told of each refused call (the servicer never sees one, so cannot count it)."""
        if not api_keys or not all(api_keys):
            raise ValueError("ApiKeyInterceptor needs non-empty API keys")
        self.api_keys = tuple(api_keys)
        self.protected_prefixes = protected_prefixes
        self.on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.protected_prefixes):
            return handler
        if any_key_matches(bearer_token(handler_call_details.invocation_metadata), self.api_keys):
            return handler
        return _denying_handler(handler, on_refused=self._refusal_of(handler_call_details.method))

    def _refusal_of(self, method: str) -> Callable[[str], None] | None:
        on_refused = self.on_refused
        return None if on_refused is None else lambda code: on_refused(method, code)


MAX_DRAINED_MESSAGES = 512
"""Request messages read and dropped before refusing a client-streaming call (see `_deny`)."""


async def _deny(request_or_iterator, context, message: str, on_refused: Callable[[str], None] | None) -> None:
    code = grpc.StatusCode.UNAUTHENTICATED
    try:
        if hasattr(request_or_iterator, "__aiter__"):
            # Aborting while the client is still sending makes its side fail with INTERNAL "Internal
            # error from Core" instead of our status (grpc.aio race), so read what it sends first:
            # dropped as it arrives, never stored, and only up to a bound.
            num_messages = 0
            async for _ in request_or_iterator:
                num_messages += 1
                if num_messages >= MAX_DRAINED_MESSAGES:
                    break
    except asyncio.CancelledError:
        code = grpc.StatusCode.CANCELLED  # its client went away while we read
        raise
    finally:
        if on_refused is not None:
            on_refused(code.name)
    await context.abort(code, message)


def _denying_handler(
    handler: grpc.RpcMethodHandler,
    message: str = MISSING_KEY_MESSAGE,
    on_refused: Callable[[str], None] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call before reading it;
    `on_refused` is told the status its client got. Its request messages stay bytes (no
    deserializer): a refused caller's messages are not parsed, so junk in its stream, drained
    before the refusal, is refused UNAUTHENTICATED as any other, not gRPC's UNKNOWN for the
    DecodeError that parsing it raised."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]

    async def deny(request_or_iterator, context) -> None:
        await _deny(request_or_iterator, context, message, on_refused)

    return make(deny, None, handler.response_serializer)


# -- Cache tenancy: the default cache_salt of a request ------------------------------------------

_CACHE_SALT_DOMAIN = b"epd cache_salt v1\0"
"""Separates this use of a secret from any other (the internal secret authenticates stages)."""


def api_key_cache_salt(api_key: str, secret: str = "") -> str:
    """The tenant of requests made with `api_key`: "key-" + HMAC-SHA256(secret, key) in hex, never
    the key itself (the salt travels to the stages and into cache keys). "" without a key: the
    shared tenant. With no `secret` the HMAC key is empty: still one-way, but a low-entropy API key
    could be guessed from its salt by whoever reads the stage traffic; a secret closes that."""
    if not api_key:
        return ""
    mac = hmac.new(secret.encode("utf-8", "surrogatepass"), _CACHE_SALT_DOMAIN, hashlib.sha256)
    mac.update(api_key.encode("utf-8", "surrogatepass"))
    return "key-" + mac.hexdigest()


def tenant_cache_salt(key_salt: str, request_salt: str) -> str:
    """The salt a request's caches are keyed by: its API key's (`api_key_cache_salt`) refined by
    the salt the request names (vLLM's per-request `cache_salt`). Both given: a hash of the pair,
    so a caller can split its own key's tenant further but never name another key's tenant."""
    if not key_salt or not request_salt:
        return key_salt or request_salt
    return (
        "key+req-"
        + hashlib.sha256(f"{key_salt}\0{request_salt}".encode("utf-8", "surrogatepass")).hexdigest()
    )


def request_cache_salt(keys_required: bool, presented_key: str, request_salt: str, secret: str = "") -> str:
    """A front-door request's tenant: with API keys configured (`keys_required`), the key it
    presented (already checked: one tenant per key) refined by its own `request_salt`; with none,
    `request_salt` alone ("" = the one shared tenant)."""
    return tenant_cache_salt(api_key_cache_salt(presented_key, secret) if keys_required else "", request_salt)
