"""Every name the docs cite exists: repository paths, file names, code names, the `EPD_*`
environment variables (something reads them), and the RPCs and proto fields of the wire format;
a file of another project is not taken for epd's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.docs.doc_reading import (
    DEPLOY_DOCS,
    ROOT,
    USER_DOCS,
    VLLM_GUIDE,
    all_docs,
    proto_messages_and_services,
    read,
    repository_files,
)

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


CITED_PATH = re.compile(
    r"(?<![\w/.:-])(?P<path>(?:[\w-]+/)+(?:[\w.-]*\{[\w.,-]+\}|[\w.-]*[\w/]))(?:::(?P<test>\w+))?"
)
"""A path with its folders (`epd/gateway/server.py`, `deploy/k8s/`, `quality.{csv,png}` for two
files), and a test named after it (`tests/integration/test_x.py::test_y`); an absolute path
(`/tmp/...`, `/dev/shm`) or a URL's is none."""

CITED_TEST = re.compile(r"(?<![\w/.-])(?P<name>\w+\.py)::(?P<test>\w+)")
"""A test named after its file alone (`test_n_choices.py::test_each_choice_...`)."""

FILE_SUFFIXES = tuple(".py .proto .md .yml .yaml .json .sh .toml .txt .c .csv .png".split())
"""A cited path ending so is a file path even when its first folder is none of the checkout's (a
folder moved or deleted, a path written from below the root)."""


def expanded(path: str) -> list[str]:
    """`quality.{csv,png}` -> `quality.csv`, `quality.png`."""
    m = re.search(r"\{([^}]*)\}", path)
    return [path[: m.start()] + alt + path[m.end() :] for alt in m.group(1).split(",")] if m else [path]


def defines_test(path: Path, test: str) -> bool:
    return path.is_file() and re.search(rf"^\s*(?:async )?def {test}\(", path.read_text(), re.M) is not None


def missing_paths(text: str, doc: str) -> list[str]:
    """The repository paths (and tests) `text`, the doc `doc`'s, cites that the checkout does not
    have: from the repository's root, or from the doc's own folder (deploy/README.md's `k8s/...`).
    A word with a slash is taken for a path when its first folder is one of the checkout's or it
    ends like a file (`FILE_SUFFIXES`); another project's file (`OTHER_PROJECTS_FILES`) and the
    words of NOT_PATHS are not epd's."""
    files = repository_files()
    here = Path(doc).parent
    top = {p for p in files if "/" not in p} | {Path(p).name for p in files if Path(p).parent == here}
    missing = set()
    for m in CITED_PATH.finditer(text):
        cited, test = m.group("path"), m.group("test")
        if cited in NOT_PATHS or cited.startswith(OTHER_PROJECTS_FILES):
            continue
        if cited.split("/")[0] not in top and not cited.endswith(FILE_SUFFIXES) and "{" not in cited:
            continue  # prose with a slash ("read/write", a MIME type, a model's hub id)
        for path in expanded(cited):
            found = [c for c in (ROOT / path, ROOT / here / path) if c.exists() or path.rstrip("/") in files]
            if not found:
                missing.add(path)
            elif test and not any(defines_test(c, test) for c in found):
                missing.add(f"{path}::{test}")
    by_name: dict[str, list[Path]] = {}
    for p in files:
        by_name.setdefault(Path(p).name, []).append(ROOT / p)
    for m in CITED_TEST.finditer(text):
        if not any(defines_test(c, m.group("test")) for c in by_name.get(m.group("name"), [])):
            missing.add(f"{m.group('name')}::{m.group('test')}")
    return sorted(missing)


@pytest.mark.parametrize("doc", all_docs())
def test_every_repository_path_the_docs_cite_exists(doc):
    """Every *.md of the repository, docs/benchmarks.md's record included: the files it names are
    the ones its readers open (its commands, the test a measurement came from)."""
    missing = missing_paths(read(doc), doc)
    assert not missing, f"{doc} cites paths that do not exist: {missing}"


def test_a_missing_path_is_found():
    """What the test above catches, and what it leaves alone."""
    text = (
        "`epd/gateway/server.py` and epd/gateway/no_such_file.py; `gateway/moved.py` (written from"
        " below the root); gone_folder/bench_x.py; `tests/integration/test_n_choices.py::no_such_test`;"
        " test_n_choices.py::test_each_choice_has_its_own_logprobs_those_of_its_single_request and"
        " test_n_choices.py::test_gone; models/epd-tiny-videoqa/quality.{csv,gif}; deploy/k8s/ and"
        " deploy/no_such_folder/; vLLM's vllm/engine/arg_utils.py, /tmp/epd/x.py,"
        " https://example.com/a/b.py, video/mp4, read/write, `Qwen/Qwen2-VL-2B-Instruct`"
    )
    assert missing_paths(text, "docs/x.md") == [
        "deploy/no_such_folder/",
        "epd/gateway/no_such_file.py",
        "gateway/moved.py",
        "gone_folder/bench_x.py",
        "models/epd-tiny-videoqa/quality.gif",
        "test_n_choices.py::test_gone",
        "tests/integration/test_n_choices.py::no_such_test",
    ]


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
