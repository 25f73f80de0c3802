"""`epd ask --tools FILE --tool-choice ... --tool-call-parser ...` as a user runs it, embedded and
against a gateway (the SDK's `tools=` over gRPC), on the tiny Qwen2-VL with a chat template that
reads `tools` (`tests.tool_data.TOOL_TEMPLATE`): the tools are in the prompt (the answer is
generate()'s on the processor's own rendering with them), and the answer's calls are read as the
chat API reads them, each choice forced so that the calls are exact: "auto" by a choice grammar of
a call's text (read by hermes, or by qwen3_coder with its values typed by the tool's schema), a
named function and "required" by their own grammars; `--no-parallel-tool-calls` keeps the first of
two calls."""

from __future__ import annotations

import json

import pytest

from tests.reference import template_reference
from tests.stack import Stack, run_epd_forked
from tests.tool_data import (
    CALL_TEXT,
    FORECAST,
    QWEN3_CODER_CALL_TEXT,
    TIME,
    TOOLS,
    no_whitespace_bias,
    tool_template_model,
)

QUESTION = "weather in Rome?"
TWO_CALLS = CALL_TEXT + "\n" + CALL_TEXT.replace("get_weather", "get_time")


@pytest.fixture(scope="module")
def tool_model(tiny_models, tmp_path_factory):
    return tool_template_model(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("tools") / "qwen2_vl_tools")


def _calls(out: dict) -> list[tuple[str, str]]:
    assert all(
        call["id"].startswith("chatcmpl-tool-") and call["type"] == "function" for call in out["tool_calls"]
    )
    return [(call["function"]["name"], call["function"]["arguments"]) for call in out["tool_calls"]]


def test_ask_tools_prints_the_answers_calls_embedded_and_through_the_stack(tool_model, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    prompt_ids, want = template_reference(tool_model, messages, 8, tools=TOOLS)
    plain_ids, _ = template_reference(tool_model, messages, 1)
    assert len(prompt_ids) > len(plain_ids)  # the template renders the tools
    bias = [f"--logit-bias={token}=-100" for token in no_whitespace_bias(tool_model)]
    ask = ["ask", "--no-video", QUESTION, "--tools", str(tools), "--json"]
    choices = {
        "none": ["--tool-choice", "none", "--max-new-tokens", "8"],
        "auto": ["--tool-call-parser", "hermes", "--choice", CALL_TEXT, "--max-new-tokens", "128"],
        "named": ["--tool-choice", "get_weather", *bias, "--max-new-tokens", "48"],
        "required": ["--tool-choice", "required", *bias, "--max-new-tokens", "96"],
        # two calls written, the first alone kept (the chat API's parallel_tool_calls: false)
        "first": ["--tool-call-parser", "hermes", "--choice", TWO_CALLS, "--no-parallel-tool-calls",
                  "--max-new-tokens", "160"],
    }  # fmt: skip
    answers = {}
    with Stack(tool_model, tmp_path / "logs") as stack:
        for where in (["--model", str(tool_model)], ["--endpoint", stack.gateway]):
            for name, flags in choices.items():
                proc = run_epd_forked(*ask, *flags, *where)
                assert proc.returncode == 0, (where, name, proc.stderr)
                out = json.loads(proc.stdout)
                assert out["num_prompt_tokens"] == len(prompt_ids), (where, name)
                answers.setdefault(name, []).append(out)
        text = run_epd_forked(*ask[:-1], *choices["auto"], "--endpoint", stack.gateway)
        # qwen3_coder's form, its values typed by the schema of the request's tool (`days` an integer).
        forecast = tmp_path / "forecast.json"
        forecast.write_text(json.dumps([FORECAST, TIME]))
        coder = [
            "--tools",
            str(forecast),
            "--tool-call-parser",
            "qwen3_coder",
            "--choice",
            QWEN3_CODER_CALL_TEXT,
        ]
        for where in (["--model", str(tool_model)], ["--endpoint", stack.gateway]):
            proc = run_epd_forked(*ask[:2], QUESTION, *coder, "--max-new-tokens", "128", "--json", *where)
            assert proc.returncode == 0, (where, proc.stderr)
            out = json.loads(proc.stdout)
            assert (out["answer"], out["content"], out["finish_reason"]) == (
                QWEN3_CODER_CALL_TEXT,
                None,
                "tool_calls",
            )
            assert _calls(out) == [("get_forecast", '{"city": "Rome", "days": 3}')], where
    assert text.returncode == 0, text.stderr
    assert 'tool call: get_weather {"city": "Rome"}' in text.stdout.splitlines()
    assert "tokens (tool_calls)" in text.stderr

    for name, (embedded, remote) in answers.items():
        assert embedded["token_ids"] == remote["token_ids"], name  # one answer, two doors
        assert _calls(embedded) == _calls(remote) if name != "none" else "tool_calls" not in remote, name
    none, auto, named, required, first = (answers[name][0] for name in choices)
    # "none": the tools in the prompt, the text as generated, unparsed.
    assert none["token_ids"] == want and "tool_calls" not in none
    # "auto": the answer is the call's text, hermes reads it out; nothing else is left.
    assert auto["answer"] == CALL_TEXT
    assert (auto["content"], _calls(auto), auto["finish_reason"]) == (
        None,
        [("get_weather", '{"city": "Rome"}')],
        "tool_calls",
    )
    # A named function: the answer is its arguments, as generated (vLLM's); its own finish reason.
    assert json.loads(named["answer"])["city"] in ("Paris", "Rome")
    assert (named["content"], _calls(named), named["finish_reason"]) == (
        "",
        [("get_weather", named["answer"])],
        "stop",
    )
    # "required": vLLM's array of calls, each item a call with its parameters as json.dumps writes them.
    items = json.loads(required["answer"])
    assert _calls(required) == [(item["name"], json.dumps(item["parameters"])) for item in items]
    assert (required["content"], required["finish_reason"]) == ("", "tool_calls")
    # --no-parallel-tool-calls: the answer wrote two calls, the first alone is kept.
    assert first["answer"] == TWO_CALLS
    assert (first["content"], _calls(first), first["finish_reason"]) == (
        None,
        [("get_weather", '{"city": "Rome"}')],
        "tool_calls",
    )
