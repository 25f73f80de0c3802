"""vLLM's `--help=KEYWORD` on every `epd` command (epd/cmdline/keyword_help.py): one group of
flags by its name, the flags whose names contain the keyword (without case, `_` as `-`), the list
of groups, everything; no match says so and what to try. Each prints to stdout and exits 0."""

from __future__ import annotations

import re

import pytest

from epd.cli.main import parse_command
from epd.cli.parsers.root import _commands, bench_suite_parser, build_parser


def _help(capsys, words: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_command(words)
    assert exit_.value.code == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def _flags(text: str) -> set[str]:
    """The flags a help text describes (each line's first word that is a long flag)."""
    return set(re.findall(r"^\s+(?:-\w, )?(--[\w-]+)", text, re.MULTILINE))


def test_a_group_by_its_name_without_case_and_with_underscores(capsys):
    out = _help(capsys, ["serve", "--help=Request_Defaults"])
    assert out.startswith("request defaults:\n")
    assert _flags(out) == {"--generation-config", "--override-generation-config"}


def test_a_group_wins_over_the_flags_containing_its_name(capsys):
    out = _help(capsys, ["serve", "--help=model"])
    assert out.startswith("model:\n")
    assert "--model" in _flags(out) and "--max-model-len" not in _flags(out)


@pytest.mark.parametrize("keyword", ["max_model", "MAX-MODEL-LEN", "model-len"])
def test_the_flags_whose_names_contain_the_keyword(capsys, keyword):
    out = _help(capsys, ["serve", f"--help={keyword}"])
    assert out.startswith("epd serve: flags matching '")
    assert _flags(out) == {"--max-model-len"}


def test_a_role_and_ask_search_their_own_flags(capsys):
    gateway = _flags(_help(capsys, ["serve", "gateway", "--help=api_key"]))
    assert gateway == {"--api-key", "--api-key-file", "--no-api-key", "--max-requests-per-api-key"}
    # before argparse: ask's VIDEO is not needed, and a --config after it is not read
    ask = _help(capsys, ["ask", "--help=stop", "--config", "/no/such.yaml"])
    assert {"--stop", "--stop-token-id"} <= _flags(ask) and "--tls-ca" not in _flags(ask)


@pytest.mark.parametrize(
    ("words", "flag"),
    [(["bench", "serve"], "--concurrency"), (["bench", "quality"], "--presets")],
)
def test_a_bench_suite_searches_its_own_flags(capsys, words, flag):
    out = _help(capsys, [*words, f"--help={flag[2:]}"])
    assert out.startswith(f"epd {' '.join(words)}: flags matching '{flag[2:]}'")
    assert _flags(out) == {flag}


def test_all_is_the_whole_help(capsys):
    for words in (["serve"], ["serve", "decode"], ["bench", "serve"]):
        assert _help(capsys, [*words, "--help=all"]) == _help(capsys, [*words, "--help"])


def test_no_match_says_what_to_try(capsys):
    out = _help(capsys, ["serve", "prefill", "--help=max_modl"])
    assert out == (
        "epd serve prefill: no group or flags matching 'max-modl'.\n"
        "Use '--help=listgroup' to see its groups, or '--help' to see all its flags.\n"
    )


def _every_command():
    parser = build_parser()
    words = {c.prog: c.prog.split()[1:] for c in (parser, *_commands(parser))}
    return [*words.values(), ["bench", "serve"], ["bench", "quality"]]


@pytest.mark.parametrize("words", _every_command(), ids=" ".join)
def test_every_group_listgroup_names_is_shown_by_its_name(capsys, words):
    listing = _help(capsys, [*words, "--help=listgroup"]).splitlines()
    assert listing[0].startswith(f"epd{''.join(' ' + w for w in words)}: groups of flags")
    names = [line.split()[0] for line in listing[1:]]
    assert "options" in names and len(names) == len(set(names))
    for line in listing[1:]:
        name, title = line.split(maxsplit=1)
        assert _help(capsys, [*words, f"--help={name}"]).startswith(f"{title}:\n")


def test_a_bench_suites_help_shows_its_config_and_keyword_help(capsys):
    out = _help(capsys, ["bench", "quality", "--help"])
    assert {"--config", "--help", "--presets"} <= _flags(out) and "--help=KEYWORD" in out
    assert "--config" in _flags(bench_suite_parser("serve").format_help())


@pytest.mark.parametrize(
    ("words", "group", "flags"),
    [
        (["bench", "serve"], "Server", {"--endpoint", "--openai", "--openai-dialect", "--media-as"}),
        (["bench", "serve"], "load", {"--concurrency", "--request-rate", "--num-requests", "--videos"}),
        (["bench", "quality"], "data", {"--num-test", "--data", "--max-questions"}),
    ],
)
def test_a_bench_suites_flags_are_in_groups(capsys, words, group, flags):
    out = _help(capsys, [*words, f"--help={group}"])
    assert out.startswith(f"{group.lower()} (") and flags <= _flags(out)
