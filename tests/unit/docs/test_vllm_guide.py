"""docs/from-vllm.md's tables, checked against the code: each epd flag is where the parser has it,
vLLM's common serve flags are covered, each request field is what each endpoint does with it, and
each of vLLM's metrics has an epd metric that /metrics exposes."""

from __future__ import annotations

import re

import pytest

from tests.unit.docs.doc_reading import (
    FLAG,
    VLLM_GUIDE,
    epd_parsers,
    exposed_metrics,
    flags_of,
    markdown_table,
    read,
    spans,
)


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
