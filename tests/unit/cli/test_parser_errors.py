"""`epd` reports a flag it does not know as an unknown flag, not as whatever word follows it."""

from __future__ import annotations

import pytest

from epd.cli.parsers.root import build_parser


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["serve", "--bad-flag", "x"], "unknown flag --bad-flag (see epd serve --help)"),
        (["serve", "--bad-flag=3", "encoder"], "unrecognized arguments: --bad-flag=3"),
        (["serve", "x"], "argument role: invalid choice: 'x'"),  # a wrong role is still named as one
        (["serve", "encoder", "--bad-flag", "x"], "unrecognized arguments: --bad-flag x"),
    ],
)
def test_unknown_flags_are_named(capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert expected in capsys.readouterr().err


def test_version_names_the_installed_epd(capsys):
    """As `vllm --version`: there was no way to ask which epd is installed."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"epd {version('epd')}\n"


def test_known_flags_still_parse():
    args = build_parser().parse_args(["serve", "encoder", "--port", "0", "--max-demux-s", "2.5"])
    assert (args.role, args.port, args.max_demux_s) == ("encoder", 0, 2.5)


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--endpoint", "h:1", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    ],
)
def test_epd_ask_tls_flags_are_checked_before_anything_loads(tmp_path, capsys, extra, expected):
    from epd.cli.ask import run_ask

    video = tmp_path / "v.mp4"
    video.write_bytes(b"\x00")
    assert run_ask(build_parser().parse_args(["ask", str(video), "q?", *extra])) == 2
    assert expected in capsys.readouterr().err


def test_epd_serve_tls_flags_that_do_not_go_together_are_named():
    from epd.cli.stack_security import stack_transport

    parser = build_parser()
    for argv, expected in [
        (["--tls-cert", "c", "--tls-key", "k"], "--tls-cert needs --tls-ca"),
        (["--tls-client-ca", "x"], "--tls-client-ca needs --tls-cert"),
        (["--tls-ca", "x"], "--tls-ca without --tls-cert"),
    ]:
        with pytest.raises(ValueError, match=expected):
            stack_transport(parser.parse_args(["serve", *argv]))


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--grace-period", "7", "prefill"],
        ["serve", "--close-timeout-s=2", "decode", "--model", "m"],
        ["--log-level", "INFO", "serve", "--grace-period", "1", "gateway"],
    ],
)
def test_a_services_flag_before_its_role_is_refused_not_ignored(capsys, argv):
    """argparse parses `epd serve --grace-period 7 prefill`'s flag as the stack's, then the role's
    default overwrites it: the service would run with 30 s, silently. `epd` refuses it, saying
    where the flag goes."""
    from epd.cli.main import parse_command

    with pytest.raises(SystemExit) as info:
        parse_command(argv)
    assert info.value.code == 2
    role = next(token for token in argv if token in ("prefill", "decode", "gateway"))
    assert f"before the role {role!r} would be ignored" in capsys.readouterr().err


def test_a_services_flag_after_its_role_is_its_own():
    from epd.cli.parsers.serve import flags_before_role

    argv = ["serve", "prefill", "--grace-period", "7", "--model", "decode"]
    assert build_parser().parse_args(argv).grace_period == 7.0
    assert flags_before_role(argv) == []  # a flag's value that names a role is not one
