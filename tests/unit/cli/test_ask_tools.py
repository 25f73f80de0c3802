"""`epd ask --tools / --tool-choice / --tool-call-parser` refused before any model loads or call is
made, with exit 2 and one line saying what to change."""

from __future__ import annotations

import json
import re

import pytest

from epd.cli.ask import run_ask
from epd.cli.main import build_parser
from tests.tool_data import TOOLS


@pytest.fixture
def tools(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    return str(path)


@pytest.mark.parametrize(
    "flags,expected",
    [
        ([], r"--tool-choice auto \(the default with --tools\) reads the calls out of the answer's text: give --tool-call-parser hermes"),
        (["--tool-choice", "get_forecast"], r"tool_choice names the function \"get_forecast\", which is not in 'tools' \(its functions: 'get_weather', 'get_time'\)"),
        (["--tool-choice", "required", "--regex", "a+"], r"--tool-choice required forces the answer with a structured output of its own: drop --json-schema"),
        (["--tool-call-parser", "hermes", "--question", "and tomorrow?"], r"--tools answers one request: drop --question"),
    ],
)  # fmt: skip
def test_bad_tool_flags_exit_2_saying_what_to_change(tools, flags, expected, capsys):
    assert (
        run_ask(build_parser().parse_args(["ask", "--no-video", "weather?", "--tools", tools, *flags])) == 2
    )
    err = capsys.readouterr().err
    assert re.search(expected, err), err


def test_tool_flags_without_tools_and_unreadable_tools_exit_2(tmp_path, capsys):
    ask = ["ask", "--no-video", "weather?"]
    assert run_ask(build_parser().parse_args([*ask, "--tool-choice", "required"])) == 2
    assert (
        "--tool-choice read the calls of --tools FILE: give --tools FILE or drop them"
        in capsys.readouterr().err
    )
    bad = tmp_path / "tools.json"
    bad.write_text("[{")
    assert run_ask(build_parser().parse_args([*ask, "--tools", str(bad)])) == 2
    assert f"--tools {bad}: not JSON" in capsys.readouterr().err
    bad.write_text('[{"type": "function"}]')
    assert run_ask(build_parser().parse_args([*ask, "--tools", str(bad), "--tool-choice", "none"])) == 2
    assert "tools[0]" in capsys.readouterr().err
