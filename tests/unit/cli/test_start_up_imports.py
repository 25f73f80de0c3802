"""The `epd` command line is parsed without numpy, torch or pydantic: every `epd` command (its
`--help` too) builds the whole parser, whose defaults come from the components' config dataclasses,
and importing numpy alone cost ~0.1 s of `epd serve --help`'s ~0.28 s (docs/benchmarks.md,
"Start-up"). What a command needs at run time it imports when it runs."""

from __future__ import annotations

import pytest

from tests.import_log import imported_packages, who_imported

FORBIDDEN = ("numpy", "torch", "pydantic")

PARSE = """
import contextlib, io
from epd.cli.main import main

with contextlib.redirect_stdout(io.StringIO()) as shown:
    try:
        main({argv!r})
    except SystemExit as exc:
        assert exc.code == 0, exc.code
assert shown.getvalue().startswith({expected!r}), shown.getvalue()[:200]
"""


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--version"], "epd "),
        (["--help"], "usage: epd "),
        (["serve", "--help"], "usage: epd serve "),
        (["serve", "gateway", "--help"], "usage: epd serve gateway "),
        (["serve", "encoder", "--help"], "usage: epd serve encoder "),
        (["serve", "prefill", "--help"], "usage: epd serve prefill "),
        (["serve", "decode", "--help"], "usage: epd serve decode "),
        (["ask", "--help"], "usage: epd ask "),
        (["health", "--help"], "usage: epd health "),
        (["bench", "--help"], "usage: epd bench "),
    ],
)
def test_the_command_line_is_parsed_without_numpy_torch_or_pydantic(argv, expected):
    loaded, log = imported_packages(PARSE.format(argv=argv, expected=expected))
    assert "epd" in loaded and "argparse" in loaded, "the check must see the real parse"
    for name in FORBIDDEN:
        assert name not in loaded, f"epd {' '.join(argv)} loads {name}:\n{who_imported(log, name)}"


def test_importing_the_command_loads_none_of_them():
    loaded, log = imported_packages("import epd.cli.main")
    assert "epd" in loaded
    for name in FORBIDDEN:
        assert name not in loaded, f"importing epd.cli.main loads {name}:\n{who_imported(log, name)}"
