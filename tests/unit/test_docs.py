"""What the user documentation says, checked against the code, so that a renamed flag, a changed
default, a moved file or a new metric fails here instead of misleading a user: every `--flag` the
docs name is a flag of some `epd` command, with the default they give; every repository path and
code name they cite exists; every metric they name is one /metrics exposes, and every one it
exposes is named in README.md. Every command line in any of the repository's *.md files (the
benchmarks' included) names only flags of the command it runs, and only values its choices allow;
the deploy docs' `epd` commands parse whole; the environment variables, RPCs and proto fields the
docs name exist; README's set-up matches the scripts and pins it describes, its default ports the
services', its account of the default model that model's card; every list of the served families
names each one the loader serves. Nothing here starts a process: the
parsers are built (or caught as a script's main() is about to parse) in this one."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import shlex
import sys
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

from epd.bench.quality import build_parser as bench_quality_parser
from epd.bench.serve import build_parser as bench_serve_parser
from epd.cli.parsers.root import build_parser
from epd.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = ("README.md", "docs/architecture.md", "docs/security.md")
VLLM_GUIDE = "docs/from-vllm.md"
"""Names vLLM's and SGLang's flags beside epd's: its own tests below read its tables; the paths,
code names, RPCs and metrics it cites are checked as the user docs' are."""
DEPLOY_DOCS = ("compose/README.md", "deploy/README.md")
OTHER_DOCS = ("epd/train/README.md",)
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

NOT_PATHS = {
    "video/mp4": "a MIME type",
    "compose/Kubernetes": "prose: compose or Kubernetes",
    "compose/.env": "the operator's own file, which compose/README.md has them create",
}
"""Words with a slash in the docs that are not repository paths."""

EXTERNAL_NAMES = {
    "SupportsMultiModal": "vLLM's model interface, named for comparison",
    "VLLM_API_KEY": "vLLM's environment variable, named for comparison",
    "_get_top_logprobs": "vLLM's chat serving function, where the guide was checked",
    "MinTokensLogitsProcessor": "vLLM's min_tokens logits processor, named for comparison",
    "all_stop_token_ids": "vLLM's SamplingParams field that min_tokens holds back",
    "maybe_filter_parallel_tool_calls": "vLLM's parallel_tool_calls: false, named for comparison",
    "VLLM_MAX_N_SEQUENCES": "vLLM's bound on n, named for comparison",
    "echo_without_generation": "vLLM's completions echo with max_tokens 0, named for comparison",
    "_parse_chat_message_content_mm_part": "vLLM's chat content part parser, named for comparison",
    "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "vLLM's bound on its teardown, --close-timeout-s' counterpart",
}
"""Code names the docs cite that are not epd's (nor used by it)."""

OTHER_PROJECTS_FILES = ("vllm/", "sglang/", "python/sglang/", "transformers/", "src/transformers/")
OTHER_PROJECTS = ("vllm-project/vllm", "sgl-project/sglang", "huggingface/transformers")
"""How the docs name another project's file (docs/from-vllm.md says what it was checked against):
by its path in that project (`vllm/engine/arg_utils.py`), or with the project's repository
(`vllm-project/vllm`, a GitHub address). A bare name is epd's."""


def cited_file_names(text: str) -> set[str]:
    """The `.py` and `.proto` file names `text` cites as epd's: each name with the path written
    before it, less those that path says are another project's."""
    names = set()
    for m in re.finditer(r"(?<![\w./:-])(?P<path>[\w.:/-]*/)?(?P<name>\w+\.(?:py|proto))\b", text):
        path = m.group("path") or ""
        if not (path.startswith(OTHER_PROJECTS_FILES) or any(repo in path for repo in OTHER_PROJECTS)):
            names.add(m.group("name"))
    return names


def test_a_file_of_another_project_is_not_taken_for_epds():
    text = (
        "vLLM's `vllm/entrypoints/openai/cli_args.py`, SGLang's `python/sglang/srt/server_args.py`,"
        " transformers' transformers/models/qwen2_vl/modeling_qwen2_vl.py, and"
        " https://github.com/vllm-project/vllm/blob/main/vllm/v1/engine/logprobs.py; epd's `kv_store.py`,"
        " prefill_svc/no_such_file.py, `other_name.py` and epd/v1/vllm.proto"
    )
    assert cited_file_names(text) == {"kv_store.py", "no_such_file.py", "other_name.py", "vllm.proto"}


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w*-])")
"""A flag as the docs write one (`--max-*`, a family of flags, is none)."""


@cache
def epd_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every `epd` command's parser by its command line: `epd`, `epd ask`, `epd serve`,
    `epd serve encoder`, ..., and the bench suites, whose flags `epd bench SUITE` passes on."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    walk(subparser, f"{name} {sub}")

    walk(build_parser(), "epd")
    found["epd bench serve"] = bench_serve_parser()
    found["epd bench quality"] = bench_quality_parser()
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

EPD_ARG = re.compile(r"--epd-arg[= ](--[a-z0-9-]+)")
"""bench_vs_transformers_serve.py's `--epd-arg=--flag`: a flag of the `epd serve` it starts."""


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


def command_parser(command: str) -> argparse.ArgumentParser:
    if command.startswith("epd "):
        return epd_parsers()[command]
    return script_parser(
        command.replace("/", ".").removesuffix(".py").replace("bench.", "epd.bench.", 1)
        if command.startswith("bench/")
        else command
    )


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


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


def documented_commands_of(text: str) -> list[tuple[int, str, str]]:
    with mock.patch(f"{__name__}.read", lambda doc: text):
        return documented_commands("-")


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


def repository_text(*suffixes: str) -> str:
    return "\n".join(
        (ROOT / p).read_text(errors="replace")
        for p in sorted(repository_files())
        if p.endswith(suffixes) and not p.endswith(".md") and (ROOT / p).is_file()
    )


def test_every_environment_variable_the_docs_name_is_read():
    """`EPD_*` variables: read by the code, a compose file or a manifest (tests: `EPD_FUZZ_EXAMPLES`)."""
    read_somewhere = set(
        re.findall(r"\bEPD_[A-Z0-9_]+", repository_text(".py", ".yml", ".yaml", ".sh", "Dockerfile"))
    )
    named = {(doc, name) for doc in all_docs() for name in re.findall(r"\bEPD_[A-Z0-9_]+\b", read(doc))}
    assert named, "no EPD_* variable found in the docs"
    missing = sorted(f"{doc}: {name}" for doc, name in named if name not in read_somewhere)
    assert not missing, f"the docs name environment variables nothing reads: {missing}"


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


@pytest.mark.parametrize("doc", (*USER_DOCS, *DEPLOY_DOCS, VLLM_GUIDE))
def test_every_rpc_and_proto_field_the_docs_name_exists(doc):
    """`PrefillService.PullKv`, `epd.v1.LoadService/GetLoad`, `AskHeader.cache_salt`: a name of the
    wire format (a domain class of the same name, such as the gateway's `AskRequest`, answers for
    itself in the code-names test above)."""
    messages, services = proto_messages_and_services()
    python_classes = set(re.findall(r"^\s*class (\w+)", repository_text(".py"), re.M))
    text, wrong = read(doc), []
    for owner, name in set(re.findall(r"\b([A-Z]\w+)[./](\w+)", text)):
        if owner in services and name not in services[owner]:
            wrong.append(f"{owner}.{name}: {owner} has the RPCs {sorted(services[owner])}")
        elif owner in messages and owner not in python_classes and name not in messages[owner]:
            wrong.append(f"{owner}.{name}: {owner} has the fields {sorted(messages[owner])}")
    assert not wrong, f"{doc}:\n" + "\n".join(sorted(wrong))


def test_the_readmes_set_up_is_the_scripts_and_the_pins():
    """README's two commands are the scripts CI runs, and the versions it says they install are
    requirements/ci.txt's pins."""
    text = " ".join(read("README.md").split())
    for script in ("scripts/setup.sh", "scripts/test.sh"):
        assert f"bash {script}" in text, f"README.md no longer gives `bash {script}`"
    assert "exec bash scripts/test.sh" in read(".ci/run") and "bash scripts/setup.sh" in read(
        "scripts/test.sh"
    )
    assert "-r requirements/ci.txt -e ." in read("scripts/setup.sh"), (
        "README says setup.sh installs the pins, editable"
    )
    pins = dict(re.findall(r"^([\w-]+)==(\S+)", read("requirements/ci.txt"), re.M))
    stated = re.search(
        r"`requirements/ci\.txt` \(torch (\S+) \+ torchvision (\S+), transformers (\S+?);", text
    )
    assert stated, (
        "README.md no longer says which versions requirements/ci.txt pins where this test reads them"
    )
    assert stated.groups() == (pins["torch"], pins["torchvision"], pins["transformers"])


_UNITS = {"": 1, "s": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def stated_value(text: str) -> float | None:
    """The value a doc gives for a default, from the start of `text` ("8192", "120 s", "4 GiB",
    "2^36", "3840x2160", "0 = off"), or None when it is not one (a service name, a sentence)."""
    text = text.strip()
    if m := re.match(r"2\^(\d+)\b", text):
        return float(2 ** int(m.group(1)))
    if m := re.match(r"(\d+)x(\d+)\b", text):
        return float(int(m.group(1)) * int(m.group(2)))
    if m := re.match(r"(\d+(?:\.\d+)?)(?: ?(s|KiB|MiB|GiB))?(?![\w.^x])", text):
        return float(m.group(1)) * _UNITS[m.group(2) or ""]
    return None


def stated_defaults(text: str) -> list[tuple[str, str]]:
    """(flag, what the doc gives as its default) wherever a doc gives one: "`--flag` (8192)",
    "`--flag` seconds (default 30", "`--flag`, default 120 s", the usage block's
    "#   --flag N: ... (default 2", and tables with a "default" column."""
    found = re.findall(r"`(--[a-z0-9-]+)`(?: [a-z]+)?,? \((?:default )?([^;,)]*)", text)
    found += re.findall(r"`(--[a-z0-9-]+)`(?: seconds)?, default ([^;,)]*)", text)
    found += re.findall(
        r"^#\s+(?:--[a-z0-9-]+ )*(--[a-z0-9-]+)[^\n:]*:[^\n]*?\(default:? ([^;,)]*)", text, re.M
    )
    header: list[str] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if "default" in cells:
            header = cells
        elif not cells:
            header = []
        elif header and len(cells) == len(header) and not set(line) <= set("|-: "):
            flags = [c for c in cells if c.startswith("`--")]
            if flags and (m := re.match(r"`(--[a-z0-9-]+)`", flags[0])):
                found.append((m.group(1), cells[header.index("default")]))
    return found


@pytest.mark.parametrize("doc", USER_DOCS + DEPLOY_DOCS + OTHER_DOCS)
def test_the_defaults_the_docs_give_are_the_flags_defaults(doc):
    defaults = (
        flag_defaults()
        if doc not in OTHER_DOCS
        else {
            flag: {"train": action.default}
            for action in script_parser("epd.train.train_default_model")._actions
            for flag in action.option_strings
        }
    )
    checked, wrong = 0, []
    for flag, text in stated_defaults(read(doc)):
        value = stated_value(text)
        if value is None or flag not in defaults:
            continue
        checked += 1
        actual = {
            c: d for c, d in defaults[flag].items() if isinstance(d, (int, float)) and not isinstance(d, bool)
        }
        if actual and not any(abs(float(d) - value) <= 1e-9 * max(1.0, value) for d in actual.values()):
            wrong.append(f"{flag}: the doc says {text.strip()!r}, the parsers' defaults are {actual}")
    assert checked, f"{doc}: no stated default found (has the way defaults are written changed?)"
    assert not wrong, f"{doc}:\n" + "\n".join(wrong)


def test_stated_defaults_are_read_as_written():
    """The reader the test above relies on: each form a doc uses, and what is not a default."""
    text = (
        "`--a` (8192) `--b` seconds (default 30; idle) `--c`, default 1 GiB; 0 off `--d` (gateway, "
        "encoder)\n#   --x --e N: calls (default 2)\n| what | flag | default |\n|---|---|---|\n"
        "| x | `--f` (encoder) | 3840x2160 |\n"
    )
    assert sorted(stated_defaults(text)) == [
        ("--a", "8192"),
        ("--b", "30"),
        ("--c", "1 GiB"),
        ("--d", "gateway"),
        ("--e", "2"),
        ("--f", "3840x2160"),
        ("--f", "encoder"),
    ]
    assert [
        stated_value(t) for t in ("8192", "120 s", "4 GiB", "2^36", "0 = off", "0.3 s", "gateway", "2x")
    ] == [8192, 120, 4 << 30, 2**36, 0, 0.3, None, None]


@pytest.mark.parametrize("doc", (*USER_DOCS, *DEPLOY_DOCS, *OTHER_DOCS, VLLM_GUIDE))
def test_every_repository_path_the_docs_cite_exists(doc):
    """From the repository's root, or from the doc's own folder (deploy/README.md's `k8s/...`)."""
    files = repository_files()
    here = Path(doc).parent
    top = {p for p in files if "/" not in p} | {Path(p).name for p in files if Path(p).parent == here}
    cited = set(re.findall(r"(?<![\w/.-])((?:[\w-]+/)+[\w.-]*[\w/])", read(doc)))
    missing = sorted(
        p
        for p in cited - set(NOT_PATHS)
        if p.split("/")[0] in top
        and p.rstrip("/") not in files
        and not (ROOT / p).exists()
        and not (ROOT / here / p).exists()
    )
    assert not missing, f"{doc} cites paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", (*USER_DOCS, VLLM_GUIDE))
def test_every_file_name_the_docs_cite_exists(doc):
    """The code layout names files without their folder (`media_open.py`, `kv_store.py`)."""
    names = {Path(p).name for p in repository_files()}
    cited = cited_file_names(read(doc))
    assert not sorted(cited - names), f"{doc} cites files that do not exist: {sorted(cited - names)}"


@pytest.mark.parametrize("doc", (*USER_DOCS, VLLM_GUIDE))
def test_every_code_name_the_docs_cite_exists(doc):
    """`Class`, `Class.attribute`, `function()`, `CONSTANT` in backticks: each part is a name the
    code (or a library epd calls, by the name epd uses) has."""
    code = "\n".join(
        (ROOT / p).read_text(errors="replace") for p in repository_files() if p.endswith((".py", ".proto"))
    )
    words = set(re.findall(r"\w+", code))
    missing = []
    for quoted in sorted(set(re.findall(r"`([^`\n]+)`", read(doc)))):
        m = re.fullmatch(r"([A-Za-z_][\w.]*?)(\.py)?(\(.*\))?", quoted.strip())
        if not m or m.group(2):
            continue
        name = m.group(1)
        if not (m.group(3) or "_" in name or "." in name or any(c.isupper() for c in name)):
            continue  # a plain word (`fifo`, `stop`): not a code name
        parts = [p for p in name.split(".") if p]
        if name not in EXTERNAL_NAMES and any(p not in words for p in parts):
            missing.append(quoted)
    assert not missing, f"{doc} cites names the code does not have: {missing}"


def exposed_metrics() -> set[str]:
    """Every metric family a gateway's /metrics has (HELP lines are written with or without samples)."""
    return set(re.findall(r"^# HELP (\w+) ", GatewayMetrics().render(), re.M))


@pytest.mark.parametrize("doc", (*USER_DOCS, VLLM_GUIDE))
def test_every_metric_the_docs_name_is_exposed(doc):
    exposed = exposed_metrics()
    named = set(re.findall(r"\bepd_[a-z0-9_]+\b", read(doc)))
    missing = sorted(
        n for n in named if not (n in exposed or n.endswith("_") and any(e.startswith(n) for e in exposed))
    )
    assert not missing, f"{doc} names metrics /metrics does not have: {missing}"


def test_every_exposed_metric_is_named_in_the_readme():
    text = read("README.md")
    named = set(re.findall(r"\bepd_[a-z0-9_]+\b", text))
    prefixes = {n for n in named if n.endswith("_")}
    unnamed = sorted(
        e for e in exposed_metrics() if e not in named and not any(e.startswith(p) for p in prefixes)
    )
    assert not unnamed, f"README.md's Metrics section does not name: {unnamed}"


def test_the_shipped_files_say_how_to_make_them_again():
    """The demo model's card and the sample's JSON give the command that made them: a module that
    exists under that name (they named `train.train_default_model` and `synth.sample` after those
    moved under epd/), and, for the model, flags the trainer takes."""
    from epd.train.train_default_model import parse_args

    def module_exists(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package that is not there
            return False

    card = json.loads(read("models/epd-tiny-videoqa/epd_model_card.json"))
    sample = json.loads(read("samples/sample.json"))
    for command in (card["command"], card["data"]["generator"], sample["made_by"]):
        words = shlex.split(command)
        module = words[words.index("-m") + 1]
        assert module_exists(module), f"{command!r}: no module {module}"
    assert module_exists(card["built_by"]), card["built_by"]
    words = shlex.split(card["command"])
    parse_args(words[words.index("-m") + 2 :])  # argparse exits on a flag the trainer no longer has


def quoted_names(text: str) -> list[str]:
    """The backticked names of a list as README.md writes one ("`a`, `b`, and `c`")."""
    return re.findall(r"`(\w+)`", text)


def test_the_readmes_lists_of_result_fields_are_the_sdks_and_the_http_apis():
    """README.md lists the fields of `epd ask --json` (AskResult.to_dict()) and of the HTTP API's
    `epd` object by name: those lists are the names the code writes, no more, no fewer."""
    from epd.client.types import result_from_proto
    from epd.gateway.ask_types import AskSummary
    from epd.gateway.servicer import summary_to_proto
    from epd.gateway.summary_fields import epd_details

    summary = AskSummary(
        request_id="r",
        answer="a",
        token_ids=[1],
        finish_reason="stop",
        num_frames=2,
        num_visual_tokens=4,
        num_prompt_tokens=9,
        timings_ms={"ttft": 1.0, "total": 2.0},
        kv_num_bytes=0,
        encoder_cache_hit=False,
        media_sha256="",
        frame_timestamps_s=[0.0, 0.5],
    )
    text = " ".join(read("README.md").split())
    ask_json = re.search(r"`--json` prints the SDK's result as one object (.*?) \(see \[Stages", text)
    http_epd = re.search(
        r"carries an `epd` object: the whole summary under the SDK's names (.*?)\. Caches", text
    )
    assert ask_json and http_epd, "README.md no longer lists the result's fields where this test reads them"
    sdk_names = set(quoted_names(ask_json.group(1))) - {"epd", "AskResult"}
    assert sdk_names == set(result_from_proto(summary_to_proto(summary), []).to_dict())
    assert set(quoted_names(http_epd.group(1))) == set(epd_details(summary)) | {"kept_tokens"}


def test_the_readmes_accuracy_of_the_default_model_is_its_cards():
    """README.md's size and accuracy of models/epd-tiny-videoqa (overall and per question type) are
    what its card records: a retrained model must not leave the old numbers behind."""
    card = json.loads(read("models/epd-tiny-videoqa/epd_model_card.json"))
    text = " ".join(read("README.md").split())
    size = re.search(r"`models/epd-tiny-videoqa`: a ([\d.]+)M-parameter", text)
    overall = re.search(
        r"it answers \*\*([\d.]+)%\*\* of its test questions correctly \((.*?)`epd bench quality`\)", text
    )
    assert size and overall, (
        "README.md no longer gives the default model's size and accuracy where this test reads them"
    )
    assert float(size.group(1)) == round(card["num_parameters"] / 1e6, 1)
    assert float(overall.group(1)) == round(100 * card["accuracy"]["test"], 1)
    types = {
        "what happens at the end": "end",
        "which appears first": "first",
        "counts": "count",
        "directions": "direction",
        "colours": "colour",
        "shapes": "shape",
        "exits": "leaves",
        "entries": "enters",
        "which appears last": "last",
    }
    stated = {}
    for percent, names in re.findall(r"(\d+)% ([^,;]+)", overall.group(2)):
        for name in re.split(r" and ", names.strip().strip('"')):
            stated[types[name.strip('"')]] = int(percent)
    by_type = card["accuracy"]["test_by_type"]
    assert stated == {t: int(100 * by_type[t] + 0.5) for t in by_type}, (
        "README's per-type accuracy is not the card's"
    )


def test_the_token_cache_format_version_is_the_codes():
    """docs/architecture.md gives the token cache key's format version (it said 3 after the key
    became 4): a bump must update the paragraph that says what the key holds."""
    from epd.encoder_svc import token_cache

    stated = re.search(
        r"\*\*Token cache\*\* \(`encoder_svc/token_cache\.py`\): key = format version \((\d+)\)",
        read("docs/architecture.md"),
    )
    assert stated, (
        "docs/architecture.md no longer gives the token cache key's format version where this test reads it"
    )
    assert int(stated.group(1)) == token_cache._KEY_VERSION


FAMILY_NAMES = {
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_vl_moe": "Qwen3-VL",
    "qwen3_5": "Qwen3.5",
    "llava_onevision": "LLaVA-OneVision",
    "glm4v": "GLM-4.1V",
    "internvl": "InternVL",
}
"""The name each list of the served families gives a model type the loader serves."""


def test_every_list_of_the_served_families_names_each():
    """README.md's opening and its table, from-vllm.md's "Supported models", every model service's
    and `epd ask`'s --model help and the loader's refusal name every family the loader serves (a
    family added in one place was missing from the others)."""
    from epd.model_runtime.loader import SUPPORTED
    from tests.families import FAMILIES

    assert sorted(FAMILY_NAMES) == sorted(FAMILIES), "name a new family here, then in every list below"
    readme = read("README.md")
    guide = " ".join(read(VLLM_GUIDE).split())
    supported = re.search(r"\*\*Supported models\*\*(.*?)(?: - \*\*|$)", guide)
    assert supported, f"{VLLM_GUIDE} no longer lists the supported models where this test reads them"
    parsers = epd_parsers()
    lists = {
        "README.md's opening": " ".join(readme.split("\n## ", 1)[0].split()),
        f"{VLLM_GUIDE}'s Supported models": supported.group(1),
        "the loader's SUPPORTED": SUPPORTED,
    }
    for command in ("epd ask", "epd serve", "epd serve encoder", "epd serve prefill", "epd serve decode"):
        (model,) = [a for a in parsers[command]._actions if "--model" in a.option_strings]
        lists[f"{command} --model's help"] = model.help or ""
    missing = [
        f"{where}: {name}"
        for where, text in lists.items()
        for name in FAMILY_NAMES.values()
        if name not in text
    ]
    table = {spans(row[1])[0] for row in markdown_table(readme, "family")}
    assert not missing and table == set(FAMILIES), (missing, sorted(table ^ set(FAMILIES)))


def test_the_readmes_ports_are_the_services_defaults():
    """ "Default ports: gateway 50050, ..." and the replicas' "port + 10·i" are what the parsers use."""
    from epd.cli.parsers.serve import REPLICA_PORT_STEP
    from epd.decode_svc.config import DEFAULT_PORT as DECODE
    from epd.encoder_svc.config import DEFAULT_PORT as ENCODER
    from epd.gateway.config import DEFAULT_PORT as GATEWAY
    from epd.prefill_svc.config import DEFAULT_PORT as PREFILL

    text = " ".join(read("README.md").split())
    stated = re.search(r"Default ports: gateway (\d+), encoder (\d+), prefill (\d+), decode (\d+)\.", text)
    step = re.search(r"Replica \*i\* of a stage listens on the stage's port \+ (\d+)·\*i\*", text)
    assert stated and step, "README.md no longer gives the default ports where this test reads them"
    assert tuple(map(int, stated.groups())) == (GATEWAY, ENCODER, PREFILL, DECODE)
    assert int(step.group(1)) == REPLICA_PORT_STEP
    parsers = epd_parsers()
    assert [
        parsers[f"epd serve {role}"].get_default("port")
        for role in ("gateway", "encoder", "prefill", "decode")
    ] == [GATEWAY, ENCODER, PREFILL, DECODE]


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


@pytest.mark.parametrize("table", ["vLLM flag", "SGLang flag"])
def test_the_vllm_guide_puts_each_epd_flag_where_the_parser_has_it(table):
    """Each row's epd flags are flags of every command its "where" cell names (`epd serve`,
    `epd serve prefill`, `epd`), and a row naming flags names where they go."""
    parsers = epd_parsers()
    wrong = []
    for vllm, epd, where in markdown_table(read(VLLM_GUIDE), table):
        flags = [f for span in spans(epd) for f in FLAG.findall(span) if span.startswith("--")]
        commands = [span for span in spans(where) if span in parsers]
        if flags and not commands:
            wrong.append(f"{vllm}: {flags} with no epd command named in {where!r}")
        wrong += [
            f"{vllm}: {command} has no {flag}"
            for command in commands
            for flag in flags
            if flag not in flags_of(parsers[command])
        ]
    assert not wrong, "\n".join(wrong)


def test_the_vllm_guide_covers_vllms_common_serve_flags():
    named = {f for row in markdown_table(read(VLLM_GUIDE), "vLLM flag") for f in FLAG.findall(row[0])}
    common = {
        "--host", "--port", "--served-model-name", "--max-model-len", "--max-num-seqs",
        "--max-num-batched-tokens", "--gpu-memory-utilization", "--dtype", "--api-key", "--chat-template",
        "--trust-request-chat-template", "--enable-auto-tool-choice", "--tool-call-parser",
        "--reasoning-parser", "--max-logprobs", "--scheduling-policy", "--enable-prefix-caching",
        "--limit-mm-per-prompt", "--mm-processor-kwargs", "--tensor-parallel-size", "--enforce-eager",
        "--generation-config", "--seed", "--disable-log-requests", "--uvicorn-log-level",
        "--allowed-local-media-path", "--guided-decoding-backend", "--structured-outputs-config",
        "--speculative-config", "--lora-modules",
    }  # fmt: skip
    assert not sorted(common - named), f"{VLLM_GUIDE} no longer says what to do for {sorted(common - named)}"


def endpoint_fields() -> dict[str, tuple[set[str], set[str]]]:
    """endpoint -> (fields it reads or refuses, fields it refuses unless they ask for nothing)."""
    from epd.gateway import completions_protocol, responses_protocol
    from epd.gateway.request_fields import KNOWN_CHAT_FIELDS, UNSUPPORTED_CHAT_FIELDS

    return {
        "chat": (set(KNOWN_CHAT_FIELDS), set(UNSUPPORTED_CHAT_FIELDS)),
        "completions": (
            set(completions_protocol._COMPLETION_KNOWN),
            set(completions_protocol._COMPLETION_UNSUPPORTED),
        ),
        "responses": (
            set(responses_protocol._KNOWN),
            set(responses_protocol._UNSUPPORTED)
            | (set(UNSUPPORTED_CHAT_FIELDS) & set(responses_protocol.PASSED_TO_CHAT)),
        ),
    }


def test_the_vllm_guides_request_fields_are_what_each_endpoint_does():
    """A field the guide calls refused is refused by every endpoint its row names; any other is
    read there (known, and not refused); every field chat refuses is in the table as refused."""
    fields = endpoint_fields()
    wrong, refused_in_chat = [], set()
    for names, endpoints, status in markdown_table(read(VLLM_GUIDE), "field"):
        word = re.match(r"[\w']+", status)
        assert word and word.group() in ("same", "differs", "accepted", "refused", "epd's"), status
        refused = word.group() == "refused"
        for name in spans(names):
            for endpoint in re.findall(r"\w+", endpoints):
                known, unsupported = fields[endpoint]
                if refused and name not in unsupported:
                    wrong.append(f"{name} ({endpoint}): called refused, but {endpoint} does not refuse it")
                if not refused and (name not in known or name in unsupported):
                    wrong.append(
                        f"{name} ({endpoint}): called {word.group()!r}, but {endpoint} does not read it"
                    )
                if refused and endpoint == "chat":
                    refused_in_chat.add(name)
    missing = sorted(fields["chat"][1] - refused_in_chat)
    assert not missing, f"{VLLM_GUIDE}'s field table does not list these refused chat fields: {missing}"
    assert not wrong, "\n".join(wrong)


def test_the_vllm_guide_names_an_epd_metric_for_each_of_vllms():
    rows = markdown_table(read(VLLM_GUIDE), "vLLM")
    exposed = exposed_metrics()
    wrong = [row[0] for row in rows if not re.findall(r"\bepd_[a-z0-9_]+\b", row[1])]
    wrong += [
        name for row in rows for name in re.findall(r"\bepd_[a-z0-9_]+\b", row[1]) if name not in exposed
    ]
    assert not wrong, f"{VLLM_GUIDE}'s metrics table: no such epd metric for {wrong}"


def test_the_security_docs_fuzzing_names_every_stage_rpc():
    """docs/security.md's "Fuzzing" lists the stage RPCs the fuzz test calls directly: every RPC of
    the encoder, prefill and decode services, as the test's STAGE_CALLS has them (the list kept
    five after prefill's GetModelInfo, Tokenize, Detokenize and CompileStructuredOutputs were
    fuzzed too)."""
    _, services = proto_messages_and_services()
    stage_rpcs = services["EncoderService"] | services["PrefillService"] | services["DecodeService"]
    fuzzed = set(re.findall(r'Stub, "(\w+)"', read("tests/integration/test_fuzz_front_doors.py")))
    listed = re.search(
        r"each stage's own RPCs called directly: (.*?), with messages",
        " ".join(read("docs/security.md").split()),
    )
    assert listed, "docs/security.md no longer lists the fuzzed stage RPCs where this test reads them"
    assert fuzzed == stage_rpcs, f"the fuzz test's STAGE_CALLS: {sorted(fuzzed ^ stage_rpcs)}"
    assert set(quoted_names(listed.group(1))) == stage_rpcs, sorted(
        set(quoted_names(listed.group(1))) ^ stage_rpcs
    )


def test_the_gateways_memory_at_the_prompt_logprobs_bound_is_the_codes():
    """The gateway's memory for one answer at `MAX_PROMPT_LOGPROB_ENTRIES`, as its docstring gives it
    (measured: docs/benchmarks.md), is what every doc that gives it says (docs/security.md and
    docs/from-vllm.md kept 320 MiB, 640 bytes an entry, after the pieces were kept as protobuf)."""
    stated = re.search(
        r"about (\d+) bytes\s+an entry, so (\d+) MiB at this bound", read("epd/model_runtime/logprobs.py")
    )
    assert stated, "MAX_PROMPT_LOGPROB_ENTRIES' docstring no longer gives the memory where this test reads it"
    per_entry, total = stated.groups()
    prose = {doc: " ".join(read(doc).split()) for doc in ("README.md", "docs/security.md", VLLM_GUIDE)}
    at_bound = r"524,288 (?:entries )?\((?:what the gateway holds for one answer, |the gateway's memory for one answer, )?"
    found = {(doc, "MiB"): re.findall(at_bound + r"about (\d+) MiB", text) for doc, text in prose.items()}
    found["docs/architecture.md", "MiB"] = re.findall(
        r"so about (\d+) MiB at its peak", read("docs/architecture.md")
    )
    found["docs/security.md", "bytes an entry"] = re.findall(
        r"\(about (\d+) bytes an entry at the peak\)", prose["docs/security.md"]
    )
    assert all(found.values()), f"a doc no longer gives the figure where this test reads it: {found}"
    code = {"MiB": total, "bytes an entry": per_entry}
    wrong = {where: sizes for where, sizes in found.items() if set(sizes) != {code[where[1]]}}
    assert not wrong, f"the code says {per_entry} bytes an entry, {total} MiB: {wrong}"


def test_the_errors_section_names_every_status_the_one_mapping_gives():
    """docs/architecture.md's "Errors" says which domain errors become which gRPC status: every
    status `epd.transport.errors` maps one to is there (PERMISSION_DENIED, a media URL or path the
    server refuses, was missing)."""
    from epd.transport.errors import _CODES

    section = re.search(r"\n## Errors\n(.*?)\n## ", read("docs/architecture.md"), re.S)
    assert section, 'docs/architecture.md has no "Errors" section where this test reads it'
    named = set(re.findall(r"\b[A-Z][A-Z_]+\b", section.group(1)))
    missing = sorted({code.name for _, code in _CODES} - named)
    assert not missing, f"docs/architecture.md's Errors section does not name {missing}"


def test_the_readme_lists_every_gateway_flag_epd_serve_passes_on():
    """README.md's list of the gateway's flags `epd serve` takes too (those of `epd serve gateway`
    that no stage has) names each: it left out the API key's and the web demo's."""
    parsers = epd_parsers()
    stages = set().union(*(flags_of(parsers[f"epd serve {r}"]) for r in ("encoder", "prefill", "decode")))
    passed_on = (flags_of(parsers["epd serve"]) & flags_of(parsers["epd serve gateway"])) - stages
    text = " ".join(read("README.md").split())
    listed = re.search(r"`epd serve` \(the stack or `--colocate`, (.*?)`epd serve gateway`'s alone", text)
    assert listed, "README.md no longer lists the gateway flags `epd serve` takes where this test reads them"
    described = {
        "--http-port": "port 8000 by default",
        "--allowed-local-media-path": "the media flags below",
        "--allowed-media-domains": "the media flags below",
    }
    assert all(words in listed.group(1) for words in described.values()), listed.group(1)
    missing = sorted(passed_on - set(FLAG.findall(listed.group(1))) - set(described))
    assert not missing, f"README.md does not say `epd serve` takes {missing}"


def test_the_cross_site_post_refusal_names_every_route_it_guards():
    """docs/architecture.md says which POSTs a page of another site may not make: every route that
    reads a body (`BODY_ROUTES`), which the guard covers (it named chat and /demo/frames alone)."""
    from epd.gateway.web.routes import BODY_ROUTES

    text = " ".join(read("docs/architecture.md").split())
    stated = re.search(r"A POST to (.*?) that a browser says comes from a page of another site", text)
    assert stated, "docs/architecture.md no longer says which POSTs the browser guard refuses"
    named = set(re.findall(r"`(/[\w/]+)`", stated.group(1)))
    assert named == set(BODY_ROUTES), sorted(named ^ set(BODY_ROUTES))


@pytest.mark.parametrize("doc", ["README.md", "docs/security.md"])
def test_the_api_keys_guarded_paths_are_the_codes(doc):
    """The paths the API key guards, as a doc lists them, are `KEYED_PATH_PREFIXES`."""
    from epd.gateway.http_checks import KEYED_PATH_PREFIXES

    stated = re.search(r"under ((?:`/\w+`, )+`/\w+`)", " ".join(read(doc).split()))
    assert stated, f"{doc} no longer lists the paths the API key guards where this test reads them"
    named = set(re.findall(r"`(/\w+)`", stated.group(1)))
    assert named == set(KEYED_PATH_PREFIXES), sorted(named ^ set(KEYED_PATH_PREFIXES))
