"""`epd serve`'s parsed arguments for the tests of the children's command lines it makes
(epd/cli/stack_commands.py): a stack's, a child's as its role parses it, and the check that a flag
its role refuses stops the stack (and --colocate) before anything starts."""

from __future__ import annotations

import re

import pytest

from epd.cli.launcher import serve_stack
from epd.cli.parsers.root import build_parser
from epd.cli.process_exit import EXIT_USAGE
from epd.cli.stack_commands import stage_flag_problem


def _parsed(command: list[str]):
    return build_parser().parse_args(command[command.index("serve") :])


def _stack(flags: list[str]):
    args = build_parser().parse_args(["serve", *flags])
    args.model = "/m"
    return args


def _assert_refused_alone_by_the_stack_and_colocated(
    capsys, role, make, make_colocated, flags, expected
) -> None:
    """`epd serve ROLE FLAGS` refuses them (`make`), `epd serve FLAGS` too before anything starts
    (one line, exit 2), and --colocate (`make_colocated`), all with `expected` in the message."""
    with pytest.raises(ValueError, match=re.escape(expected)):
        make(build_parser().parse_args(["serve", role, *flags]))
    args = build_parser().parse_args(["serve", *flags])
    assert expected in (stage_flag_problem(args) or "")
    assert serve_stack(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("epd serve: ") and expected in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match=re.escape(expected)):
        make_colocated(build_parser().parse_args(["serve", "--colocate", *flags]))
