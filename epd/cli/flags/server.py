"""Every service's server flags: where it listens (`ServerConfig`), how it stops (--grace-period,
--close-timeout-s), transport security (`TransportSecurity`: TLS, the internal secret), and `epd
serve`'s front door keys and TLS."""

from __future__ import annotations

import argparse

from epd.cli.flags.arg_types import env, port_number, seconds, secret_check_interval
from epd.cli.flags.modes import STACK, serves_only
from epd.stages.model_thread import CLOSE_WAIT_S


def add_grace_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grace-period",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT/SIGHUP, requests in flight get this long to finish before they are "
        "cut off (an idle service exits at once; a second signal, 1 s or more after the first, stops "
        "at once); then the service's threads get --close-timeout-s more",
    )
    add_close_timeout_flag(p)


def add_close_timeout_flag(p: argparse.ArgumentParser) -> argparse.Action:
    return p.add_argument(
        "--close-timeout-s",
        type=seconds,
        default=CLOSE_WAIT_S,
        metavar="SECONDS",
        help="after the drain (or `epd ask`'s last answer), the threads still running (a model step, "
        "a prompt render, a video decode, a structured output's compile) get this long in all to end; "
        "one still running then is named in a warning and left to the exit (0: wait for none). A "
        "deployment's stop grace must cover --grace-period + this + 7 s (at least --grace-period + 12 s)",
    )


def add_server_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 in containers)")
    p.add_argument(
        "--port", type=port_number, default=default_port, help="gRPC port (0: a free port the kernel picks)"
    )
    add_ports_file_flag(p)
    add_grace_flag(p)
    add_security_flags(p)


def add_ports_file_flag(p: argparse.ArgumentParser) -> None:
    """Every service's, and `epd serve`'s (the stack's ports, or --colocate's front door's)."""
    p.add_argument(
        "--ports-file",
        default="",
        metavar="PATH",
        help='once listening, write the bound ports to PATH as JSON, replacing it whole: {"grpc": '
        "PORT} (the gateway's, and --colocate's, with \"http\": PORT too; the stack's with the "
        'stage replicas\' lists, "encoder": [PORT, ...], ...): with --port 0 (--http-port auto) '
        "how a script learns the ports the kernel picked",
    )


def add_tls_client_flags(g) -> None:
    g.add_argument(
        "--tls-ca",
        default="",
        metavar="PATH",
        help="PEM CA bundle verifying the stage servers this service calls: set, its channels to "
        "them use TLS, presenting --tls-cert/--tls-key as client certificate (mTLS)",
    )
    g.add_argument(
        "--tls-cert",
        default="",
        metavar="PATH",
        help="PEM certificate chain this service presents (its gRPC and HTTP ports; and to stages)",
    )
    g.add_argument("--tls-key", default="", metavar="PATH", help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-server-name",
        default="",
        metavar="NAME",
        help="name the called servers' certificates are checked against instead of the host dialed "
        "(decode reaching prefill pods by IP: the name their certificate carries); needs --tls-ca",
    )


def add_security_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transport security (docs/security.md)")
    add_tls_client_flags(g)
    g.add_argument(
        "--tls-client-ca",
        default="",
        metavar="PATH",
        help="PEM CA bundle client certificates must chain to: every client then needs one (mTLS)",
    )
    g.add_argument(
        "--internal-secret-file",
        default=env("EPD_INTERNAL_SECRET_FILE", ""),
        metavar="PATH",
        help="file holding the shared secret stages require on every call but health (the gateway "
        "and decode present it); several, one a line, while it rotates: the first is "
        "presented, every one accepted (docs/security.md); default: $EPD_INTERNAL_SECRET_FILE, "
        "else the secret itself in $EPD_INTERNAL_SECRET. A stage refuses to start without one "
        "unless --tls-client-ca (mTLS) or --insecure-no-internal-auth (`epd serve` gives its own one)",
    )
    add_secret_check_flag(g)
    g.add_argument(
        "--insecure-no-internal-auth",
        action="store_true",
        help="serve a stage to any caller that reaches its port, without the internal secret: "
        "development on a closed machine or network only",
    )
    p.set_defaults(internal_secret_env=env("EPD_INTERNAL_SECRET", ""))


def add_secret_check_flag(g) -> argparse.Action:
    """Every service's (`add_security_flags`), and `epd serve`'s, which passes it to the stack's
    services (`epd.cli.stack_security.stack_security_flags`; --colocate has no internal secret)."""
    from epd.stages.server_config import SECRET_CHECK_INTERVAL_S

    return g.add_argument(
        "--secret-check-interval-s",
        type=secret_check_interval,
        default=SECRET_CHECK_INTERVAL_S,
        metavar="SECONDS",
        help="how often the internal secret file is looked at (a stat; re-read when it changed): "
        "a rotation step is in effect everywhere this long after the file changed "
        f"(default {SECRET_CHECK_INTERVAL_S:g}; docs/security.md)",
    )


def add_stack_security_flags(p: argparse.ArgumentParser) -> None:
    """`epd serve` (the stack, or --colocate): the front door's keys and limits, and TLS."""
    g = p.add_argument_group("front door and TLS (the stack or --colocate; docs/security.md)")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on the gateway (default: $EPD_API_KEY); repeatable, "
        "each key its own cache tenant (handed to the gateway in a 0600 file, not its command line)",
    )
    g.add_argument("--api-key-file", default="", metavar="PATH", help="more API keys, one per line")
    g.add_argument(
        "--max-requests-per-api-key",
        type=int,
        default=0,
        help="requests one API key may have in flight over all its clients (0 = no limit)",
    )
    g.add_argument(
        "--tls-cert",
        default="",
        metavar="PATH",
        help="PEM certificate (valid for 127.0.0.1) every service serves: the gateway's gRPC and "
        "HTTP ports become TLS/HTTPS, and the stages take only the stack's own calls (mTLS)",
    )
    g.add_argument("--tls-key", default="", metavar="PATH", help="PEM private key of --tls-cert")
    tls_ca = g.add_argument(
        "--tls-ca",
        default="",
        metavar="PATH",
        help="PEM CA that signed --tls-cert (a self-signed certificate is its own CA); needed with it",
    )
    g.add_argument(
        "--tls-client-ca",
        default="",
        metavar="PATH",
        help="PEM CA bundle clients of the gateway must present a certificate of (mTLS at the front door)",
    )
    secret_check = add_secret_check_flag(g)
    p.set_defaults(api_key_env=env("EPD_API_KEY", ""))
    why = (
        "the stack's calls between its services (the CA verifying their certificates, the internal "
        "secret's rotation); the colocated stages are called inside the process (--tls-cert and "
        "--tls-key alone serve the front door's TLS)"
    )
    serves_only(STACK, why, tls_ca, secret_check)
