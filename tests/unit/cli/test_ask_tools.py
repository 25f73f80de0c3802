"""`epd ask --tools / --tool-choice / --tool-call-parser / --no-parallel-tool-calls` read as the chat
API reads its fields, and refused before any model loads or call is made, with exit 2 and one line
saying what to change."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from epd.cli.ask import run_ask
from epd.cli.ask_tools import ask_tools
from epd.cli.parsers.root import build_parser
from tests.tool_data import CALL_TEXT, TOOLS


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


def test_no_parallel_tool_calls_keeps_the_answers_first_call_alone(tools, capsys):
    """The chat API's `"parallel_tool_calls": false`: vLLM keeps the first of the calls parsed."""
    time_call = CALL_TEXT.replace("get_weather", "get_time")
    answer = SimpleNamespace(answer=f"{CALL_TEXT}\n{time_call}", finish_reason="stop")  # what is read
    ask = ["ask", "--no-video", "weather?", "--tools", tools, "--tool-call-parser", "hermes"]
    both = ask_tools(build_parser().parse_args(ask))
    first = ask_tools(build_parser().parse_args([*ask, "--no-parallel-tool-calls"]))
    assert both is not None and first is not None
    assert [call.name for call in both.answer(answer).calls] == ["get_weather", "get_time"]
    assert [call.name for call in first.answer(answer).calls] == ["get_weather"]
    assert first.answer(answer).finish_reason == "tool_calls"
    # without --tools there are no calls to keep
    assert (
        run_ask(build_parser().parse_args(["ask", "--no-video", "weather?", "--no-parallel-tool-calls"])) == 2
    )
    assert (
        "--no-parallel-tool-calls read the calls of --tools FILE: give --tools FILE or drop them"
        in capsys.readouterr().err
    )
