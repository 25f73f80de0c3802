"""`epd` reports a flag it does not know as an unknown flag, not as whatever word follows it."""

from __future__ import annotations

import pytest

from epd.cli.main import build_parser


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


def test_known_flags_still_parse():
    args = build_parser().parse_args(["serve", "encoder", "--port", "0", "--max-demux-s", "2.5"])
    assert (args.role, args.port, args.max_demux_s) == ("encoder", 0, 2.5)
