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
    """Host name to check the certificate against, when it differs from the endpoint's."""
    api_key: str = ""
    """Sent as `authorization: Bearer <api_key>` metadata (the gateway's --api-key)."""
    metadata: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    """Extra metadata sent with every call."""

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        auth = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()
        return auth + tuple(self.metadata)


def open_channel(endpoint: str, settings: ChannelSettings, retry: RetryPolicy) -> grpc.aio.Channel:
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
    if not (settings.tls or settings.root_certificates_path):
        return grpc.aio.insecure_channel(endpoint, options=options)
    roots = None
    if settings.root_certificates_path:
        path = Path(settings.root_certificates_path)
        if not path.is_file():
            raise FileNotFoundError(f"root certificates file not found: {path}")
        roots = path.read_bytes()
    return grpc.aio.secure_channel(
        endpoint, grpc.ssl_channel_credentials(root_certificates=roots), options=options
    )
