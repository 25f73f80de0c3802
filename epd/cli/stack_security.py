"""What the stack's services get for its security: the files the launcher hands them (a fresh
internal secret, the API keys, the gateway's client-CA bundle), their flags for those and for TLS,
their environment, and the launcher's own channels' TLS (docs/security.md)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import replace

STACK_DIR_PREFIX = "epd-stack-"


class StackFiles:
    """What the launcher hands its services in files rather than on command lines or in the
    environment (so no grandchild or `ps` sees it): a fresh internal secret, the API keys, and
    the gateway's client-CA bundle. One 0700 directory of 0600 files, removed with the stack (or,
    when the launcher was killed, by the next one of this temp directory: its pid is in the name,
    epd/cli/leftovers.py)."""

    def __init__(self) -> None:
        import tempfile

        self.dir = tempfile.mkdtemp(prefix=f"{STACK_DIR_PREFIX}{os.getpid()}-")
        self.stack_id = os.path.basename(self.dir)[len(STACK_DIR_PREFIX) :]
        """`<pid>-<random>`: the threads board is named after it, to be removed with it."""

    def write(self, name: str, data: bytes) -> str:
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def stack_security_flags(args: argparse.Namespace, files: StackFiles) -> dict[str, list[str]]:
    """The flags each kind of service of the stack gets ("stage", "gateway") for the internal
    secret, the API keys, the per-key limit and TLS. ValueError: an unusable combination or file.

    With --tls-cert every port serves TLS; the stages require client certificates of --tls-ca
    (mTLS: only the stack's gateway and decoders, which present --tls-cert, get in); the gateway
    requires them of --tls-client-ca when given, trusting --tls-ca too so that the launcher's own
    health checks (which present --tls-cert) still reach it."""
    import secrets

    from epd.cli import configs
    from epd.transport import security

    stage: list[str] = []
    gateway: list[str] = []
    if not args.internal_secret_env:  # else the services read $EPD_INTERNAL_SECRET themselves
        secret = files.write("internal-secret", secrets.token_hex(32).encode())
        followed = [
            "--internal-secret-file",
            secret,
            "--secret-check-interval-s",
            repr(args.secret_check_interval_s),
        ]
        stage += followed
        gateway += followed
    if keys := configs.api_keys(args):
        gateway += ["--api-key-file", files.write("api-keys", "\n".join(keys).encode() + b"\n")]
    if args.max_requests_per_api_key:
        gateway += ["--max-requests-per-api-key", str(args.max_requests_per_api_key)]
    tls = stack_transport(args)
    if tls.tls_cert:
        security.check_files(replace(tls, tls_client_ca=args.tls_client_ca))
        own = ["--tls-cert", tls.tls_cert, "--tls-key", tls.tls_key, "--tls-ca", tls.tls_ca]
        stage += [*own, "--tls-client-ca", tls.tls_ca]
        gateway += own
        if args.tls_client_ca:
            bundle = security.read_pem(args.tls_client_ca, "--tls-client-ca").rstrip(b"\n") + b"\n"
            bundle += security.read_pem(tls.tls_ca, "--tls-ca")
            gateway += ["--tls-client-ca", files.write("gateway-client-ca.pem", bundle)]
    return {"stage": stage, "gateway": gateway}


API_KEY_ENV = "EPD_API_KEY"


def services_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment the stack's services start with: the launcher's, less $EPD_API_KEY. The
    gateway gets the stack's keys in its file (`stack_security_flags`); left in its environment,
    it also took $EPD_API_KEY as a key when `epd serve --api-key NEW` had replaced it (an old key
    exported in the shell kept working), and every model service could read it."""
    return {name: value for name, value in environ.items() if name != API_KEY_ENV}


def stack_transport(args: argparse.Namespace):
    """The launcher's own channels (its health checks): TLS with the stack's certificate as the
    client certificate when --tls-cert is given. ValueError for flags that do not go together."""
    from epd.stages.server_config import TransportSecurity

    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert, --tls-key and --tls-ca: mTLS is TLS first")
    if args.tls_cert and not args.tls_ca:
        raise ValueError(
            "--tls-cert needs --tls-ca, the CA that signed it (the stack's services verify each "
            "other with it; for a self-signed certificate, pass the certificate itself)"
        )
    if args.tls_ca and not args.tls_cert:
        raise ValueError("--tls-ca without --tls-cert: pass the certificate and key the stack serves too")

    def absolute(path: str) -> str:  # the services may not share the launcher's directory
        return os.path.abspath(path) if path else ""

    return TransportSecurity(
        tls_cert=absolute(args.tls_cert), tls_key=absolute(args.tls_key), tls_ca=absolute(args.tls_ca)
    )
