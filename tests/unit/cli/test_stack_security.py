"""The security `epd serve` gives its stack (epd/cli/stack_security.py): the API keys its gateway
takes, and the internal secret file every service follows at --secret-check-interval-s."""

from __future__ import annotations

import pytest

from epd.cli import configs
from epd.cli.parsers.root import build_parser
from epd.cli.stack_commands import stack_commands


def test_the_stacks_gateway_takes_only_the_keys_the_launcher_was_given(monkeypatch, tmp_path):
    """`epd serve --api-key NEW` with an old $EPD_API_KEY in the shell: NEW replaces it, as the
    flag's help says. The gateway got the keys in its file and the launcher's environment too, so
    it also took the old key from $EPD_API_KEY."""
    import os

    from epd.cli import stack_security

    monkeypatch.setenv("EPD_API_KEY", "old-key-in-the-shell")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    args = build_parser().parse_args(["serve", "--api-key", "new-key"])
    assert configs.api_keys(args) == ("new-key",)
    files = stack_security.StackFiles()
    try:
        argv = stack_commands(args)["gateway"] + stack_security.stack_security_flags(args, files)["gateway"]
        # The gateway parses its command line in the environment the launcher starts it with.
        monkeypatch.setattr(os, "environ", stack_security.services_environment(os.environ))
        gateway = build_parser().parse_args(argv[argv.index("--log-level") :])
        assert configs.api_keys(gateway) == ("new-key",)
    finally:
        files.remove()


def test_the_secret_check_interval_reaches_every_service_and_a_bad_one_is_refused(
    monkeypatch, tmp_path, capsys
):
    """`--secret-check-interval-s`: how often a service looks at its internal secret file, a
    constant of 5 s before (the rotation test waited on it). Each role's, and `epd serve`'s for
    every service of the stack (with the file it makes), down to the object that follows the file;
    refused by the parser (exit 2, naming the flag) and by the typed config below or at 0."""
    from epd.cli import stack_security
    from epd.stages.server_config import SECRET_CHECK_INTERVAL_S, TransportSecurity
    from epd.transport.internal_secrets import internal_secrets

    makers = {
        "encoder": configs.encoder_config,
        "prefill": configs.prefill_config,
        "decode": configs.decode_config,
        "gateway": configs.gateway_config,
    }

    def followed_every_s(role: str, argv: list[str]) -> float:
        args = build_parser().parse_args(argv)
        args.model = "/m"
        security = makers[role](args).server.security
        assert security.internal_secret_file  # the interval only matters with a file
        return internal_secrets(security).check_interval_s

    monkeypatch.delenv("EPD_INTERNAL_SECRET", raising=False)
    monkeypatch.delenv("EPD_INTERNAL_SECRET_FILE", raising=False)
    secret = tmp_path / "secret"
    secret.write_text("s" * 32 + "\n")
    for role in makers:
        given = ["serve", role, "--internal-secret-file", str(secret)]
        assert followed_every_s(role, [*given, "--secret-check-interval-s", "0.25"]) == 0.25
        assert followed_every_s(role, given) == SECRET_CHECK_INTERVAL_S == 5.0
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    for argv, expected in ((["serve", "--secret-check-interval-s", "0.25"], 0.25), (["serve"], 5.0)):
        args = build_parser().parse_args(argv)
        args.model = "/m"
        files = stack_security.StackFiles()
        try:
            flags = stack_security.stack_security_flags(args, files)
            for name, command in stack_commands(args).items():
                role = name.split("[")[0]
                argv = [*command, *flags["gateway" if role == "gateway" else "stage"]]
                assert followed_every_s(role, argv[argv.index("serve") :]) == expected, name
        finally:
            files.remove()
    for argv in (["serve", "decode"], ["serve"]):
        for value, why in (("0", "must be > 0 seconds"), ("-1", "must be >= 0 seconds"),
                           ("inf", "must be a finite number of seconds"), ("5s", "expected seconds")):  # fmt: skip
            with pytest.raises(SystemExit) as exit_info:
                build_parser().parse_args([*argv, "--secret-check-interval-s", value])
            assert exit_info.value.code == 2
            assert f"argument --secret-check-interval-s: {why}, got '{value}'" in capsys.readouterr().err
    for value in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="--secret-check-interval-s must be > 0 seconds"):
            TransportSecurity(secret_check_interval_s=value)
