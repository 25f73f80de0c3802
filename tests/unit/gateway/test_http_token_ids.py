"""The token ids and logprobs an HTTP answer shows (in-process server, real sockets, scripted
pipelines): the answer's and the prompt's ids only when asked (`return_token_ids`), where vLLM
places them, streamed or not; and `include_reasoning: false` hiding the tokens' logprobs and ids
under either of vLLM's parsers."""

from __future__ import annotations

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.pipeline import Pipeline
from tests.unit.gateway.scripted_http import (
    PROMPT_IDS,
    _post_chat,
    _ScriptedPipeline,
    _stream_chunks,
    _summary,
)


def test_the_answers_token_ids_are_on_its_choices_only_when_asked_streamed_or_not():
    """vLLM's `return_token_ids`: each choice lists its tokens' ids, whole or streamed (each chunk
    its step's); without it they are null, as vLLM writes them (every streamed chunk had them;
    then the field was left out), the ids only in `epd.token_ids`."""
    import json

    content = [
        {"type": "text", "text": "q"},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    ]
    body = {"messages": [{"role": "user", "content": content}], "return_token_ids": True}
    answer = json.loads(_post_chat(_ScriptedPipeline(), body))
    assert answer["choices"][0]["token_ids"] == [5, 6, 7] == answer["epd"]["token_ids"]
    streamed = _stream_chunks({}, return_token_ids=True)
    assert [t for c in streamed for t in c["choices"][0].get("token_ids") or []] == [5, 6, 7]
    plain = json.loads(_post_chat(_ScriptedPipeline(), {**body, "return_token_ids": False}))
    assert plain["choices"][0]["token_ids"] is None and plain["epd"]["token_ids"] == [5, 6, 7]
    chunks = _stream_chunks({})
    # vLLM's: the role chunk has no token_ids field, every chunk of tokens a null one
    assert "token_ids" not in chunks[0]["choices"][0]
    assert [c["choices"][0]["token_ids"] for c in chunks[1:]] == [None, None, None]


def test_the_prompts_token_ids_are_in_the_answer_only_when_asked_as_vllm_places_them():
    """vLLM's `return_token_ids` gives the prompt's ids too (`prompt_token_ids`), which prefill
    sends the gateway (it has no tokenizer) only when asked: chat's at the answer's top, whole or
    in its role chunk alone; a completion's in its choice, whole or in the choice's first chunk
    (its later chunks' null). Not asked: null where vLLM writes the field."""
    import json

    chat = {"messages": [{"role": "user", "content": "q"}]}
    answer = json.loads(_post_chat(_ScriptedPipeline(), {**chat, "return_token_ids": True}))
    assert answer["prompt_token_ids"] == PROMPT_IDS and "prompt_token_ids" not in answer["choices"][0]
    assert json.loads(_post_chat(_ScriptedPipeline(), chat))["prompt_token_ids"] is None
    chunks = _stream_chunks({}, return_token_ids=True)
    assert (
        chunks[0]["prompt_token_ids"] == PROMPT_IDS
        and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    )
    assert not [c for c in chunks[1:] if "prompt_token_ids" in c]
    chunks = _stream_chunks({})
    assert chunks[0]["prompt_token_ids"] is None and not [c for c in chunks[1:] if "prompt_token_ids" in c]

    completion = {"prompt": "q", "return_token_ids": True}
    text = _post_chat(_ScriptedPipeline(), completion, path="/v1/completions")
    choice = json.loads(text)["choices"][0]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (PROMPT_IDS, [5, 6, 7])
    plain = json.loads(
        _post_chat(_ScriptedPipeline(), {**completion, "return_token_ids": False}, path="/v1/completions")
    )
    assert (plain["choices"][0]["prompt_token_ids"], plain["choices"][0]["token_ids"]) == (None, None)
    for asked in (True, False):
        text = _post_chat(
            _ScriptedPipeline(),
            {**completion, "stream": True, "return_token_ids": asked},
            path="/v1/completions",
        )
        chunks = [
            json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e and e != "data: [DONE]"
        ]
        ids = [c["choices"][0]["prompt_token_ids"] for c in chunks]
        assert ids == [PROMPT_IDS if asked else None] + [None] * (len(chunks) - 1), ids
        assert [c["choices"][0]["token_ids"] for c in chunks] == ([[5], [6, 7], []] if asked else [None] * 3)


class _LogprobsPipeline(Pipeline):
    """Two tokens with their logprobs (the request asked), one step each, then the summary."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.gateway.ask_types import ChoiceSummary
        from epd.model_runtime.logprobs import TokenLogprob
        from epd.stages.contracts import TokenStep

        lps = [TokenLogprob(5, "a", -0.5), TokenLogprob(6, "b", -0.25)]
        yield TokenStep([5], "a", logprobs=lps[:1])
        yield TokenStep([6], "b", "stop", logprobs=lps[1:])
        summary = _summary([5, 6], "ab", 30)
        summary.finish_reason = "stop"
        summary.choices = [ChoiceSummary(0, "ab", [5, 6], "stop", None, lps)]
        yield summary


def test_include_reasoning_false_hides_the_tokens_logprobs_and_ids_under_either_of_vllms_parsers():
    """vLLM hides every generated token's logprobs and `token_ids` when `include_reasoning` is false
    and its chat serving has a parser (`hide_stream_metadata` / `suppress_metadata`: `parser is not
    None`), which `ParserManager.get_parser` makes for `--reasoning-parser` or for
    `--enable-auto-tool-choice` with `--tool-call-parser`, a tool parser alone too; not for a
    `--tool-call-parser` without `--enable-auto-tool-choice` (no parser), nor with no flag. epd hid
    them only under a reasoning parser. Whole and streamed alike."""
    import json

    body = {"messages": [{"role": "user", "content": "q"}], "include_reasoning": False}
    body |= {"logprobs": True, "return_token_ids": True}
    configs = {
        "no parser": (HttpApiConfig(port=0), False),
        "a tool parser without auto": (HttpApiConfig(port=0, tool_call_parser="hermes"), False),
        "a tool parser": (
            HttpApiConfig(port=0, enable_auto_tool_choice=True, tool_call_parser="hermes"),
            True,
        ),
        "a reasoning parser": (HttpApiConfig(port=0, reasoning_parser="qwen3"), True),
    }
    for name, (http, hidden) in configs.items():
        config = GatewayConfig(http=http)
        choice = json.loads(_post_chat(_LogprobsPipeline(), body, config))["choices"][0]
        whole = (choice["logprobs"], choice.get("token_ids"))
        assert (whole == (None, None)) == hidden, (name, whole)
        text = _post_chat(_LogprobsPipeline(), {**body, "stream": True}, config)
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        choices = [c for chunk in chunks for c in chunk["choices"]]
        streamed = [(c["logprobs"], c.get("token_ids")) for c in choices]
        shown = [s for s in streamed if s != (None, None)]
        assert (shown == []) == hidden, (name, streamed)
        if not hidden:
            assert [ids for _, ids in shown] == [[5], [6]], (name, streamed)
