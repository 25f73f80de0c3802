"""How the SDK reaches a gateway: plain or TLS channel, and the metadata sent with every call."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from epd.client.retry import RetryPolicy

MAX_MESSAGE_BYTES = 4 << 20
"""Same message limit as the servers (media goes in 1 MiB chunks)."""


@dataclass(frozen=True)
class ChannelSettings:
    tls: bool = False
    """Use TLS; with no `root_certificates_path`, the system's trusted roots."""
    root_certificates_path: str = ""
    """PEM file of the CA that signed the gateway's certificate (turns TLS on)."""
    server_name_override: str = ""
    """Host name to check the certificate against, when it differs from the endpoint's. Turns TLS
    on (a name is checked on TLS only: alone, it left the channel plaintext, the API key in clear)."""
    api_key: str = ""
    """Sent as `authorization: Bearer <api_key>` metadata (the gateway's --api-key)."""
    metadata: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    """Extra metadata sent with every call."""
    client_certificate_path: str = ""
    """PEM certificate chain presented to a gateway that requires client certificates (its
    --tls-client-ca, mTLS); with `client_key_path`. Turns TLS on."""
    client_key_path: str = ""
    """PEM private key of `client_certificate_path`."""

    def __post_init__(self) -> None:
        if bool(self.client_certificate_path) != bool(self.client_key_path):
            raise ValueError(
                "client_certificate_path and client_key_path go together: pass both "
                "(the PEM certificate and its private key)"
            )

    @property
    def uses_tls(self) -> bool:
        return bool(
            self.tls
            or self.root_certificates_path
            or self.client_certificate_path
            or self.server_name_override
        )

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        auth = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()
        return auth + tuple(self.metadata)


def channel_credentials(settings: ChannelSettings) -> grpc.ChannelCredentials | None:
    """The TLS credentials of `settings` (None: plaintext), their files read now: a missing one is
    an error when the client is made, not at its first call."""
    if not settings.uses_tls:
        return None
    roots = (
        _read(settings.root_certificates_path, "root certificates")
        if settings.root_certificates_path
        else None
    )
    key = chain = None
    if settings.client_certificate_path:
        chain = _read(settings.client_certificate_path, "client certificate")
        key = _read(settings.client_key_path, "client key")
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)


def open_channel(
    endpoint: str, settings: ChannelSettings, retry: RetryPolicy, credentials: grpc.ChannelCredentials | None
) -> grpc.aio.Channel:
    """A grpc.aio channel, bound to the event loop running now (grpc.aio's channels are)."""
    options: list[tuple[str, str | int]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # gRPC's own reconnect backoff (1 s, growing to 120 s) would outlast our retries: a call
        # retried after the server came up must find the channel trying to connect again.
        ("grpc.initial_reconnect_backoff_ms", max(100, int(retry.initial_backoff_s * 1000))),
        ("grpc.max_reconnect_backoff_ms", max(100, int(retry.max_backoff_s * 1000))),
        ("grpc.min_reconnect_backoff_ms", 100),
    ]
    if settings.server_name_override:
        options.append(("grpc.ssl_target_name_override", settings.server_name_override))
    if credentials is None:
        return grpc.aio.insecure_channel(endpoint, options=options)
    return grpc.aio.secure_channel(endpoint, credentials, options=options)


def _read(path_text: str, what: str) -> bytes:
    path = Path(path_text)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    return path.read_bytes()
