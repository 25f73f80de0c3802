"""What the deployment files' commands mean to the real `epd` (the image's ENTRYPOINT)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from unittest.mock import patch

from epd.cli import configs
from epd.cli.launcher import _EXIT_MARGIN_S
from epd.cli.parsers.root import build_parser
from epd.decode_svc.kv_pull import KvPuller
from epd.decode_svc.stage import CONFIRM_WAIT_S
from epd.gateway.kv_release import RELEASES_WAIT_S
from epd.stages.errors import InvalidRequest
from epd.transport.server import CUT_MARGIN_S

ROOT = Path(__file__).resolve().parents[3]
STAGES = ("encoder", "prefill", "decode")
BUILDERS = {
    "encoder": configs.encoder_config,
    "prefill": configs.prefill_config,
    "decode": configs.decode_config,
    "gateway": configs.gateway_config,
}


def parse_epd(argv: list[str], env: dict[str, str] | None = None):
    """`epd ARGV` with the container's environment (epd reads EPD_* as flag defaults);
    an invalid command raises ValueError with argparse's message."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    err = io.StringIO()
    with patch.dict(os.environ, {**clean, **(env or {})}, clear=True):
        try:
            with contextlib.redirect_stderr(err):
                return build_parser().parse_args(argv)
        except SystemExit:
            raise ValueError(
                f"`epd {' '.join(argv)}` is not a valid command: {err.getvalue().strip()}"
            ) from None


def after_the_drain_s(role: str, close_timeout_s: float) -> float:
    """What a service (`epd serve ROLE`, not --colocate) still does after its drain of --grace-period,
    at most: the gateway gives the calls it cut their statuses (`CUT_MARGIN_S`, HTTP's too), then the
    KV releases still running (`RELEASES_WAIT_S`); a stage closes its threads against one deadline
    (`close_in_turn`, --close-timeout-s: a stuck model step or prompt render gets that long), decode
    first its receipts to prefill (`CONFIRM_WAIT_S`)."""
    if role == "gateway":
        return CUT_MARGIN_S + RELEASES_WAIT_S
    return (CONFIRM_WAIT_S if role == "decode" else 0.0) + close_timeout_s


def stop_bound_s(role: str, grace_period_s: float, close_timeout_s: float) -> float:
    """How long `epd serve ROLE --grace-period G --close-timeout-s C` may take from SIGTERM to its
    exit: the drain, what follows it, and the exit itself (the margin `epd serve`'s launcher gives,
    `_EXIT_MARGIN_S`). A pod's terminationGracePeriodSeconds, compose's stop_grace_period and the
    launcher's wait (`serve.stop_wait_s`) must cover it: past them the service is SIGKILLed
    mid-close."""
    return grace_period_s + after_the_drain_s(role, close_timeout_s) + _EXIT_MARGIN_S


SECRET_FROM = "internal secret read from "
"""The secret files are not here: their path stands in for the secret (see `secret_file`)."""


def serve_config(argv: list[str], env: dict[str, str] | None = None):
    """(role, typed config) that `epd serve ROLE ...` builds."""
    args = parse_epd(argv, env)
    if args.command != "serve" or args.role not in BUILDERS:
        raise ValueError(f"`epd {' '.join(argv)}` is not `epd serve ROLE`")
    with patch.object(configs, "read_secrets", lambda path: (SECRET_FROM + path,)):
        return args.role, BUILDERS[args.role](args)


def secret_file(cfg) -> str:
    """The file a service reads its internal secret from ("" if it has none from a file)."""
    secret = cfg.server.security.internal_secret
    return secret.removeprefix(SECRET_FROM) if secret.startswith(SECRET_FROM) else ""


def internal_secret_problems(cfgs: dict, mounted: dict[str, str]) -> list[str]:
    """Every service reads the internal secret from a file where the shared secret is mounted
    (`mounted`: role -> the path of the mounted secret in its container); the stages, which refuse
    calls without it, and the gateway and decode, which present it."""
    problems = []
    for role, cfg in cfgs.items():
        path = secret_file(cfg)
        if not path:
            problems.append(f"{role}: no --internal-secret-file (the stages refuse calls without the secret)")
        elif path != mounted.get(role):
            problems.append(
                f"{role}: --internal-secret-file {path} is not where the secret is mounted "
                f"({mounted.get(role) or 'nowhere'})"
            )
    return problems


def kv_source_problems(allow_kv_from, advertised: str) -> list[str]:
    """Decoders must admit the address prefill advertises, and not the same host on another port."""
    puller = KvPuller(tuple(allow_kv_from), 1, 1.0)
    host = advertised.rpartition(":")[0]
    problems = []
    for address, should_pass in (
        (advertised, True),
        (f"{host}:22", False),
        ("attacker.example:50052", False),
    ):
        try:
            puller.check_allowed(address)
            allowed = True
        except InvalidRequest:
            allowed = False
        if allowed != should_pass:
            verb = "refuses" if should_pass else "admits"
            problems.append(f"decode --allow-kv-from {','.join(allow_kv_from)} {verb} {address}")
    return problems


def api_key_problems(gateway_cfg, key: str) -> list[str]:
    """The gateway runs with exactly the key its environment gives (one open without a key does
    not get here: `configs.gateway_config` refuses it)."""
    problems = []
    if gateway_cfg.http.api_keys != (key,) or gateway_cfg.http.no_api_key:
        problems.append(
            f"gateway: does not take its API key from EPD_API_KEY (no_api_key={gateway_cfg.http.no_api_key})"
        )
    return problems
