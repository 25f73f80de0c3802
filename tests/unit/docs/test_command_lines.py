"""Every command line the docs show, checked against the command's parser: every `--flag` the user
docs name is a flag of some `epd` command; every command line in any of the repository's *.md files
(the benchmarks' included) names only flags of the command it runs, and only values its choices
allow; the deploy docs' `epd` commands parse whole. Nothing here starts a process: the parsers are
built (or caught as a script's main() is about to parse) in this one."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from tests.unit.docs.doc_reading import (
    DEPLOY_DOCS,
    FLAG,
    USER_DOCS,
    all_docs,
    code_block_lines,
    documented_commands,
    documented_commands_of,
    epd_parsers,
    flag_defaults,
    flags_of,
    read,
    script_parser,
)

BENCHMARKS = "docs/benchmarks.md"
"""Its measured numbers are a record (never rewritten); its command lines must still run."""

NOT_EPD_FLAGS = {
    "--max-num-batched-tokens": "vLLM's name for --max-prefill-tokens-per-step",
    "--max-num-seqs": "vLLM's name for --max-running-requests",
    "--kv-cache-memory-bytes": "vLLM's KV cache size, --kv-budget-bytes' counterpart",
    "--shutdown-timeout": "vLLM's drain of the requests in flight, --grace-period's counterpart",
    "--quick": "bench/bench_decode.py's own flag",
    "--parts": "bench/cuda_check.py's own flag",
    "--families": "bench/cuda_check.py's own flag",
}
"""Flags the docs name that belong to something else, said so where they are named."""


@pytest.mark.parametrize("doc", USER_DOCS)
def test_every_flag_the_docs_name_is_an_epd_flag(doc):
    flags = set(FLAG.findall(read(doc)))
    unknown = sorted(flags - set(flag_defaults()) - set(NOT_EPD_FLAGS))
    assert not unknown, f"{doc} names flags no epd command has: {unknown}"


@pytest.mark.parametrize("doc", DEPLOY_DOCS)
def test_every_flag_of_an_epd_command_line_in_the_deploy_docs_is_an_epd_flag(doc):
    """Only the `epd ...` command lines: the rest are docker's, kubectl's, curl's."""
    flags = {
        flag
        for line in read(doc).splitlines()
        if re.search(r"(^|[\s`])epd (ask|serve|health|bench)\b", line)
        for flag in FLAG.findall(line.split("epd ", 1)[1])
    }
    assert flags, f"{doc}: no epd command line found"
    unknown = sorted(flags - set(flag_defaults()))
    assert not unknown, f"{doc} names flags no epd command has: {unknown}"


EPD_ARG = re.compile(r"--epd-arg[= ](--[a-z0-9-]+)")
"""bench_vs_transformers_serve.py's `--epd-arg=--flag`: a flag of the `epd serve` it starts."""


def command_parser(command: str) -> argparse.ArgumentParser:
    if command.startswith("epd "):
        return epd_parsers()[command]
    return script_parser(
        command.replace("/", ".").removesuffix(".py").replace("bench.", "epd.bench.", 1)
        if command.startswith("bench/")
        else command
    )


@pytest.mark.parametrize("doc", all_docs())
def test_every_flag_of_a_documented_command_line_is_a_flag_of_that_command(doc):
    """`epd ask ... --flag`, `python bench/bench_x.py --flag`: the flag is one of that very command
    (not just of some epd command), as the docs' benchmarks were run and must still run."""
    wrong, checked = [], 0
    for number, command, rest in documented_commands(doc):
        flags = [("epd serve", flag) for flag in EPD_ARG.findall(rest)]
        flags += [(command, flag) for flag in FLAG.findall(EPD_ARG.sub("--epd-arg", rest))]
        for where, flag in flags:
            checked += 1
            if flag not in flags_of(command_parser(where)):
                wrong.append(f"{doc}:{number}: {where} has no {flag}")
    assert checked or doc not in (*USER_DOCS, BENCHMARKS), (
        f"{doc}: no command line found (has the way they are written changed?)"
    )
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("doc", DEPLOY_DOCS)
def test_every_epd_command_of_the_deploy_docs_code_blocks_parses(doc):
    """The commands an operator copies (`epd serve prefill --port 50052 --advertise-address ...`,
    `docker compose exec gateway epd ask ...`), whole: positionals and values too, by the real
    parser, as compose/README.md says."""
    from tests.unit.deploy.epd_commands import parse_epd

    commands = [
        (number, shlex.split(m.group(1)))
        for number, line in code_block_lines(read(doc))
        if (m := re.match(r"\s*(?:docker compose exec \w+ )?epd (.*)", line))
    ]
    assert commands, f"{doc}: no epd command in its code blocks"
    wrong = []
    for number, argv in commands:
        try:
            parse_epd(argv)
        except ValueError as exc:
            wrong.append(f"{doc}:{number}: {exc}")
    assert not wrong, "\n".join(wrong)


def test_command_lines_are_read_as_written():
    """The reader the test above relies on: fences, indented blocks, continuations, comments,
    inline spans, several commands on a line."""
    text = (
        "Run `epd ask V Q --json` then:\n\n```bash\nepd serve --colocate \\\n  --http-port 0   # not --x\n"
        "PYTHONPATH=. python bench/bench_encode.py --repeats 3 && epd health H --timeout 1\n```\n\n"
        "    python -m epd.train.train_default_model --steps 1\n"
    )
    assert [(c, FLAG.findall(rest)) for _, c, rest in documented_commands_of(text)] == [
        ("epd serve", ["--colocate", "--http-port"]),
        ("bench/bench_encode.py", ["--repeats"]),
        ("epd health", ["--timeout"]),
        ("epd.train.train_default_model", ["--steps"]),
        ("epd ask", ["--json"]),
    ]


def flag_choices() -> dict[str, set[str]]:
    """flag -> the values its choices allow, over every command that has it."""
    found: dict[str, set[str]] = {}
    for parser in epd_parsers().values():
        for action in parser._actions:
            for flag in action.option_strings if action.choices else ():
                found.setdefault(flag, set()).update(map(str, action.choices))
    return found


@pytest.mark.parametrize("doc", all_docs())
def test_every_value_the_docs_give_a_flag_of_choices_is_one_of_them(doc):
    """`--schedule ttft-first`, `--dtype float32|bfloat16`, `--routing round-robin`: a renamed
    choice fails here."""
    choices = flag_choices()
    wrong = sorted(
        {
            f"{flag} {value}"
            for flag, values in re.findall(r"(--[a-z0-9-]+)[ =]([a-z0-9][\w.|-]*)", read(doc))
            if flag in choices
            for value in values.rstrip(".").split("|")
            if value not in choices[flag]
        }
    )
    assert not wrong, f"{doc} gives values these flags do not take: {wrong} (choices: {choices})"
