"""TLS (mTLS) and the internal secret on the wire: the credentials of a service's gRPC server, and
the channels it opens to other stages.

A service calls `configure(security)` once at start-up (`epd serve ROLE`); from then on every
channel to a stage (`stage_channel`: the gateway's replica pools and health checks, decode's KV
pulls, `epd.transport.server.traced_channel`) uses TLS when a CA is set (presenting this
service's certificate as its client certificate: mTLS), and presents the internal secret when
one is set. Unconfigured (in-process tests), channels are plaintext and carry no secret.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from epd.stages.server_config import TransportSecurity
from epd.transport.auth import INTERNAL_AUTH_KEY
from epd.transport.internal_secrets import InternalSecrets, internal_secrets

MAX_PEM_BYTES = 1 << 20
"""A certificate bundle or key larger than this is not one (a wrong path, e.g. a model file)."""


def read_pem(path: str, flag: str) -> bytes:
    """The PEM file of `flag`; ValueError with one line saying what is wrong with it."""
    try:
        data = Path(path).read_bytes()[: MAX_PEM_BYTES + 1]
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > MAX_PEM_BYTES or b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (expected -----BEGIN ...-----)")
    return data


def check_files(security: TransportSecurity) -> None:
    """Read every file `security` names and check that the key is the certificate's: ValueError
    with one line (the service exits 2) rather than a handshake failure at the first call."""
    if security.tls_cert:
        read_pem(security.tls_cert, "--tls-cert")
        read_pem(security.tls_key, "--tls-key")
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                security.tls_cert, security.tls_key
            )
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"--tls-cert/--tls-key: not a certificate and its matching key ({exc})"
            ) from None
    for path, flag in ((security.tls_client_ca, "--tls-client-ca"), (security.tls_ca, "--tls-ca")):
        if path:
            read_pem(path, flag)  # a missing or unreadable file says so, as for the certificate
            try:
                ssl.create_default_context(cafile=path)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"{flag} {path}: not a PEM CA bundle ({exc})") from None


def server_credentials(security: TransportSecurity) -> grpc.ServerCredentials | None:
    """TLS credentials of a server (client certificates required when `tls_client_ca` is set);
    None: plaintext."""
    if not security.tls_cert:
        return None
    pair = (read_pem(security.tls_key, "--tls-key"), read_pem(security.tls_cert, "--tls-cert"))
    client_ca = read_pem(security.tls_client_ca, "--tls-client-ca") if security.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def server_ssl_context(security: TransportSecurity) -> ssl.SSLContext | None:
    """The same for the gateway's HTTP API (aiohttp's `ssl_context`); None: plain HTTP."""
    if not security.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_client_ca:
        context.load_verify_locations(cafile=security.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


@dataclass(frozen=True)
class _ClientSecurity:
    credentials: grpc.ChannelCredentials | None  # None: plaintext channels
    secrets: InternalSecrets  # the first presented; followed in their file
    server_name: str = ""  # TransportSecurity.tls_server_name


_client = _ClientSecurity(None, InternalSecrets(()))


def client_credentials(security: TransportSecurity) -> grpc.ChannelCredentials | None:
    """TLS channel credentials verifying servers against `tls_ca`, with this service's own
    certificate as the client certificate when it has one; None (no CA): plaintext."""
    if not security.tls_ca:
        return None
    key = read_pem(security.tls_key, "--tls-key") if security.tls_cert else None
    chain = read_pem(security.tls_cert, "--tls-cert") if security.tls_cert else None
    return grpc.ssl_channel_credentials(read_pem(security.tls_ca, "--tls-ca"), key, chain)


def configure(security: TransportSecurity) -> None:
    """This process's channels to stages from now on (call it before opening any)."""
    global _client
    check_files(security)
    _client = _ClientSecurity(
        client_credentials(security), internal_secrets(security), security.tls_server_name
    )


def _with_secret(details: grpc.aio.ClientCallDetails, secrets: InternalSecrets) -> grpc.aio.ClientCallDetails:
    # Read per call: a channel outlives a rotation of the secret file (InternalSecrets.current).
    metadata = [*(details.metadata or ()), (INTERNAL_AUTH_KEY, secrets.presented)]
    return details._replace(metadata=grpc.aio.Metadata(*metadata))  # type: ignore[attr-defined]


class _Secret:
    def __init__(self, secrets: InternalSecrets) -> None:
        self.secrets = secrets  # `presented` read per call


class _SecretUnaryUnary(_Secret, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_secret(client_call_details, self.secrets), request)


class _SecretUnaryStream(_Secret, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_secret(client_call_details, self.secrets), request)


class _SecretStreamUnary(_Secret, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_secret(client_call_details, self.secrets), request_iterator)


class _SecretStreamStream(_Secret, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_secret(client_call_details, self.secrets), request_iterator)


def stage_channel(
    target: str,
    options: Sequence[tuple[str, Any]] | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    server_name: str = "",
) -> grpc.aio.Channel:
    """A channel to a stage, secured as `configure` said: TLS when a CA is set, the internal
    secret on every call when one is set. The server's certificate is checked against the
    operator's --tls-server-name when set, else `server_name` when given (the DNS name the gateway
    resolved `target`, an IP address, from), else the host of `target`."""
    client = _client
    if client.secrets.presented:
        secret = client.secrets
        interceptors = [
            *interceptors,
            _SecretUnaryUnary(secret),
            _SecretUnaryStream(secret),
            _SecretStreamUnary(secret),
            _SecretStreamStream(secret),
        ]
    opts = list(options or ())
    if client.credentials is None:
        return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)
    if name := client.server_name or server_name:
        opts.append(("grpc.ssl_target_name_override", name))
    return grpc.aio.secure_channel(target, client.credentials, options=opts, interceptors=interceptors)


def blocking_channel(target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A synchronous channel secured the same way, for health checks (`epd health`, the stack's
    supervisor); health needs no secret, so none is sent."""
    opts = list(options)
    if _client.credentials is None:
        return grpc.insecure_channel(target, options=opts)
    if _client.server_name:
        opts.append(("grpc.ssl_target_name_override", _client.server_name))
    return grpc.secure_channel(target, _client.credentials, options=opts)
