"""Where a service listens, how it is secured (TLS files, the internal secret), and the message
sizes every server and channel agrees on. No gRPC here:
service configs (encoder_svc.config, ...) embed `ServerConfig`, and engines read those configs.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field
from pathlib import Path

from epd.stages.model_thread import CLOSE_WAIT_S

CHUNK_BYTES = 1 << 20
"""Payload per message. With the 4 MiB channel limit this leaves room for headers and lets the
receiver start copying early."""
MAX_MESSAGE_BYTES = 4 << 20
"""gRPC receive/send limit we set on purpose on every server and channel."""
SECRET_CHECK_INTERVAL_S = 5.0
"""`TransportSecurity.secret_check_interval_s`'s default: a stat every 5 s costs nothing, and a
rotation step waits no longer than that (plus, in Kubernetes, the kubelet's own delay)."""


@dataclass(frozen=True)
class TransportSecurity:
    """TLS and internal authentication of a service: of its server, and of the channels it opens
    to other stages (gateway -> stages, decode -> prefill). Paths only: the gRPC side
    (`epd.transport.security`) reads and checks the files at start-up. The default is what
    in-process tests use: plaintext, no secret."""

    tls_cert: str = ""
    """PEM certificate chain this service presents: as a server, and as a client to other stages
    when `tls_ca` is set (mTLS). Needs `tls_key`."""
    tls_key: str = ""
    """PEM private key of `tls_cert`."""
    tls_client_ca: str = ""
    """PEM CA bundle client certificates must chain to: set, every client needs a valid one (mTLS)."""
    tls_ca: str = ""
    """PEM CA bundle verifying the stage servers this service calls; set, its stage channels use TLS."""
    tls_server_name: str = ""
    """Name the stage servers' certificates are checked against instead of the host dialed: for
    servers reached by address, e.g. decode pulling KV caches from prefill pods by pod IP."""
    internal_secret: str = field(default="", repr=False)
    """Shared secret the stages require on every call but health and reflection (metadata
    `x-epd-internal-auth`), and that this service presents on its calls to stages; "" = none."""
    previous_internal_secrets: tuple[str, ...] = field(default=(), repr=False)
    """Secrets this service's server accepts besides `internal_secret`, never presents: the other
    lines of the secret file, so that a secret rotates without downtime (docs/security.md,
    "Rotating the internal secret")."""
    internal_secret_file: str = field(default="", repr=False)
    """The file the secrets above were read from (`--internal-secret-file`): re-read when it
    changes, so a rotation takes no restart (`epd.transport.internal_secrets`); "" = fixed."""
    secret_check_interval_s: float = SECRET_CHECK_INTERVAL_S
    """Seconds between looks at `internal_secret_file` (`--secret-check-interval-s`: a stat; the
    file is re-read only when it changed; the calls in between use what was read). A rotation step
    is in effect everywhere this long after the file changed (plus, in Kubernetes, the kubelet's
    own delay in updating a mounted Secret, about a minute): wait that long before the next step."""

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError(
                "--tls-cert and --tls-key go together: pass both (PEM certificate chain and its key)"
            )
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: mTLS is TLS first")
        if self.tls_server_name and not self.tls_ca:  # else plaintext channels, the name unused
            raise ValueError("--tls-server-name needs --tls-ca: the name is checked on TLS channels only")
        if self.previous_internal_secrets and not self.internal_secret:
            raise ValueError(
                "previous internal secrets need a current one (the first line of the secret file)"
            )
        if not all(self.previous_internal_secrets):
            raise ValueError("an empty internal secret is none: it cannot be accepted")
        if self.internal_secret_file and not self.internal_secret:
            raise ValueError("an internal secret file needs the secrets read from it")
        if not 0 < self.secret_check_interval_s < math.inf:  # 0 would stat the file on every call
            raise ValueError(
                "--secret-check-interval-s must be > 0 seconds (how often the internal secret file "
                f"is looked at for a change), got {self.secret_check_interval_s}"
            )

    @property
    def accepted_internal_secrets(self) -> tuple[str, ...]:
        """Every secret this service's server accepts: the current one first, then the previous."""
        return (self.internal_secret, *self.previous_internal_secrets) if self.internal_secret else ()

    @property
    def verifies_clients(self) -> bool:
        """mTLS on the server: a client without a certificate from `tls_client_ca` cannot connect."""
        return bool(self.tls_client_ca)


MAX_CONNECTION_AGE_S = 300.0
"""`ServerConfig.max_connection_age_s`: new replicas are in routing within about 5 minutes of
serving (gRPC adds +-10% jitter), at the cost of one reconnect per caller per 5 minutes."""


@dataclass(frozen=True)
class ServerConfig:
    """Where a service listens and how it drains."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 in containers."""
    port: int = 0
    """TCP port; 0 binds a free one the kernel picks (`ports_file` and the log say which)."""
    ports_file: str = ""
    """Once the server listens (before the model loads), its bound ports are written here as JSON,
    `{"grpc": PORT}` (the gateway's with `"http": PORT` when it serves HTTP), replacing the file
    whole (`--ports-file`): how a launcher or a test learns a port 0 bound without racing another
    process for a port it picked, closed and passed on. "" writes none."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    """Largest gRPC message sent or received; tensors are chunked below it."""
    grace_s: float = 5.0
    """On shutdown, in-flight calls get this long to finish."""
    close_timeout_s: float = CLOSE_WAIT_S
    """After the drain, the service's threads (model steps, prompt renders, video decodes,
    structured-output compiles) get this long in all to end (`close_in_turn`, one deadline); one
    still running then is named in a WARNING and left to the exit (`--close-timeout-s`)."""
    security: TransportSecurity = field(default_factory=TransportSecurity)
    """TLS (mTLS) and the internal secret, of this server and of its channels to stages."""
    max_connection_age_s: float = MAX_CONNECTION_AGE_S
    """A stage server ends each client connection this long after it opened (an HTTP/2 GOAWAY:
    calls in flight finish on it, new ones open a new connection); 0 = never. A gateway given a
    plain `name:port` for a scaled stage reaches it through one channel whose name gRPC resolves
    again only when a connection ends: without this, replicas added by `kubectl scale` got no
    calls until some connection broke. (A `dns:///` name the gateway resolves itself, on its
    own schedule: `epd.gateway.dns_replicas`.)"""

    def __post_init__(self) -> None:
        if not 0 <= self.close_timeout_s < math.inf:
            raise ValueError(f"close_timeout_s must be a number of seconds >= 0, got {self.close_timeout_s}")
        if not self.max_connection_age_s >= 0:
            raise ValueError(
                f"max_connection_age_s must be >= 0 (0 = never), got {self.max_connection_age_s}"
            )
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_bytes must be at least {MIN_MESSAGE_BYTES} (one {CHUNK_BYTES}-byte media or "
                f"tensor chunk plus its header), got {self.max_message_bytes}"
            )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


MIN_MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)
"""Smallest workable message limit: every stream (uploads, tensors, KV caches) is cut into
CHUNK_BYTES pieces, and a piece travels with a small header (tensor name, shape, offsets)."""


MAX_SECRET_BYTES = 4096
MIN_SECRET_CHARS = 16
"""A shorter internal secret is guessable; `openssl rand -hex 32` (64 chars) is what the docs use."""


MAX_SECRETS = 8
"""Most secrets one secret file (or $EPD_INTERNAL_SECRET) holds: the current one and those still
accepted while a rotation rolls out (one is enough for that; a few leave room for slow rollouts)."""


def read_secrets(path: str) -> tuple[str, ...]:
    """The internal secrets in `path`, one a line (`parse_secrets`); ValueError if unusable."""
    try:
        data = Path(path).read_bytes()[: (MAX_SECRET_BYTES + 1) * MAX_SECRETS + 1]
    except OSError as exc:
        raise ValueError(f"--internal-secret-file {path}: cannot read it ({exc.strerror or exc})") from None
    return parse_secrets(data.decode("utf-8", "replace"), f"--internal-secret-file {path}")


def parse_secrets(text: str, where: str) -> tuple[str, ...]:
    """Internal secrets, one a line: the first is the one this service presents, every one is
    accepted by its server. Lines are stripped; blank ones are skipped (an empty string is no
    secret, and a file's trailing newline is no line); each is checked (`check_secret`)."""
    secrets = [line.strip() for line in text.splitlines() if line.strip()]
    if not secrets:
        raise ValueError(f"{where}: holds no internal secret (e.g. `openssl rand -hex 32`)")
    if len(secrets) > MAX_SECRETS:
        raise ValueError(
            f"{where}: holds {len(secrets)} internal secrets; at most {MAX_SECRETS} (one a line)"
        )
    if len(set(secrets)) != len(secrets):
        raise ValueError(f"{where}: names an internal secret twice")
    return tuple(check_secret(secret, where) for secret in secrets)


def check_secret(secret: str, where: str) -> str:
    if len(secret) > MAX_SECRET_BYTES:
        raise ValueError(f"{where}: the internal secret is longer than {MAX_SECRET_BYTES} bytes")
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{where}: the internal secret must be at least {MIN_SECRET_CHARS} characters "
            "(e.g. `openssl rand -hex 32`)"
        )
    if not secret.isprintable() or not secret.isascii():
        raise ValueError(f"{where}: the internal secret must be printable ASCII (gRPC metadata)")
    return secret


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` can be reached only from this machine (the gateway's API
    key and a stage's internal secret may then be left off)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # "" (every interface), 0.0.0.0, or a name that may resolve anywhere
