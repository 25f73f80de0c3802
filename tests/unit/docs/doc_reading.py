"""Reading the repository's docs for the tests that check them against the code: which docs there
are, their text, the command lines and flags they show (with every `epd` command's parser and a
script's, caught as its main() is about to parse), the proto names and metrics the code has.
Nothing here starts a process."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
from functools import cache
from pathlib import Path
from unittest import mock

from epd.cli.parsers.root import bench_suite_parser, build_parser
from epd.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[3]

USER_DOCS = ("README.md", "docs/architecture.md", "docs/security.md")

VLLM_GUIDE = "docs/from-vllm.md"
"""Names vLLM's and SGLang's flags beside epd's: its own tests (test_vllm_guide.py) read its
tables; the paths, code names, RPCs and metrics it cites are checked as the user docs' are."""

DEPLOY_DOCS = ("compose/README.md", "deploy/README.md")

OTHER_DOCS = ("epd/train/README.md",)

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w*-])")
"""A flag as the docs write one (`--max-*`, a family of flags, is none)."""


@cache
def epd_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every `epd` command's parser by its command line: `epd`, `epd ask`, `epd serve`,
    `epd serve encoder`, ..., and the bench suites, whose flags `epd bench SUITE` passes on to the
    suite's parser (`bench_suite_parser`: with --config, as `parse_command` reads them)."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    walk(subparser, f"{name} {sub}")

    walk(build_parser(), "epd")
    found["epd bench serve"] = bench_suite_parser("serve")
    found["epd bench quality"] = bench_suite_parser("quality")
    return found


def flag_defaults() -> dict[str, dict[str, object]]:
    """flag -> {command: its default there}."""
    defaults: dict[str, dict[str, object]] = {}
    for name, parser in epd_parsers().items():
        for action in parser._actions:
            for flag in action.option_strings:
                defaults.setdefault(flag, {})[name] = action.default
    return defaults


def read(doc: str) -> str:
    return (ROOT / doc).read_text()


def repository_files() -> set[str]:
    """Paths (relative, with their folders) of the checkout, through no symlink (epd/ holds
    symlinks to the top-level folders; .venv is one)."""
    paths: set[str] = set()
    for folder, dirs, files in os.walk(ROOT):
        rel = Path(folder).relative_to(ROOT)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        paths.update(str(rel / name) for name in dirs + files)
    return paths


def all_docs() -> list[str]:
    """Every *.md of the repository (not under a dot folder or a symlink)."""
    return sorted(p for p in repository_files() if p.endswith(".md"))


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@cache
def script_parser(module: str) -> argparse.ArgumentParser:
    """The parser a script's `main()` builds (bench/*.py, `python -m epd.train...`), caught as it
    is about to parse: nothing of the script runs, and no process starts."""

    def caught(parser, *args, **kwargs):
        raise _Parsed(parser)

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", caught),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", caught),
        mock.patch.object(sys, "argv", [module]),
    ):
        try:
            importlib.import_module(module).main()
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError(f"{module}.main() returned without parsing its arguments")


COMMAND = re.compile(
    r"\bepd (?P<epd>(?:ask|health|serve(?: (?:encoder|prefill|decode|gateway))?|bench (?:serve|quality)))\b"
    r"|(?:\bpython[\w.]* (?:-m )?|(?<![\w/])-m )?(?<![\w/])(?P<script>bench/\w+\.py|epd\.(?:bench|train|synth)\.\w+)\b"
)
"""The commands the docs show: `epd ...`, `python bench/X.py`, `python -m epd.train.X`, ..."""


def code_block_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every line of a code block (a fenced one, or indented by four
    spaces; `\\` continuations joined, `# comments` dropped)."""
    found: list[tuple[int, str]] = []
    fenced, held = False, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            if line.endswith("\\"):
                held += line[:-1]
                continue
            found.append((number, re.split(r"\s#\s", held + line)[0]))
        held = ""
    return found


def command_lines(text: str) -> list[tuple[int, str]]:
    """`code_block_lines`, and the text of every `inline code` span."""
    found = code_block_lines(text)
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    found += [
        (prose.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " "))
        for m in re.finditer(r"`([^`]+)`", prose)
    ]
    return found


def documented_commands(doc: str) -> list[tuple[int, str, str]]:
    """(line, command, what follows it up to the next command) for every command a doc shows."""
    found = []
    for number, line in command_lines(read(doc)):
        matches = list(COMMAND.finditer(line))
        ends = [m.start() for m in matches[1:]] + [len(line)] if matches else []
        for m, end in zip(matches, ends, strict=True):
            command = f"epd {m.group('epd')}" if m.group("epd") else m.group("script")
            found.append((number, command, line[m.end() : end]))
    return found


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def documented_commands_of(text: str) -> list[tuple[int, str, str]]:
    with mock.patch(f"{__name__}.read", lambda doc: text):
        return documented_commands("-")


def proto_messages_and_services() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """{message name: its fields and nested types}, {service name: its RPCs}, from epd.v1."""
    import pkgutil

    import epd.v1

    messages: dict[str, set[str]] = {}
    services: dict[str, set[str]] = {}

    def add(descriptor) -> None:
        messages[descriptor.name] = set(descriptor.fields_by_name) | {n.name for n in descriptor.nested_types}
        for nested in descriptor.nested_types:
            add(nested)

    for module in pkgutil.iter_modules(epd.v1.__path__):
        if module.name.endswith("_pb2"):
            file = importlib.import_module(f"epd.v1.{module.name}").DESCRIPTOR
            for message in file.message_types_by_name.values():
                add(message)
            services.update({s.name: set(s.methods_by_name) for s in file.services_by_name.values()})
    return messages, services


def exposed_metrics() -> set[str]:
    """Every metric family a gateway's /metrics has (HELP lines are written with or without samples)."""
    return set(re.findall(r"^# HELP (\w+) ", GatewayMetrics().render(), re.M))


def markdown_table(text: str, first_header: str) -> list[list[str]]:
    """The rows (cells, stripped) of the table whose header's first cell is `first_header`."""
    rows: list[list[str]] = []
    inside = False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells and cells[0] == first_header:
            inside = True
        elif not cells:
            if inside:
                return rows
        elif inside and not set(line) <= set("|-: "):
            rows.append(cells)
    assert rows, f"no table headed {first_header!r} (has the way it is written changed?)"
    return rows


def spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)
