"""A streamed chat answer's and legacy completion's chunks, shaped without HTTP
(`epd.gateway.chat_chunks.ChatChunks`, fed the events the pipeline emits): the usage each chunk
carries, when each of n choices' finish comes (on its last token's chunk) and which carries the
summary, a completion's echo joined to its first step's chunk, a step's deltas in one chunk, when token ids are listed and which
steps make no chunk. The SSE bytes a real HttpApi sends for these shapes are pinned
in test_chat_stream_bytes.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

from epd.gateway.ask_types import AskSummary, ChoiceSummary, PromptLogprobs
from epd.gateway.chat_answer import completion_body
from epd.gateway.chat_chunks import ChatChunks
from epd.gateway.chat_request import parse_chat_request
from epd.gateway.completions_protocol import parse_completion_request, text_completion_body
from epd.model_runtime.logprobs import TokenLogprob
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import StageEvent, TokenStep
from epd.stages.names import Stage
from epd.video.types import SamplingOptions

USER = {"role": "user", "content": "name a colour"}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _chat(thinking: bool | None = None, tool_call_parser: str = "hermes", **body) -> ChatChunks:
    """A chat stream's chunks; `thinking` not None: under a reasoning parser, thinking or not;
    `tool_call_parser`: the server's, reading "auto"'s calls."""
    chat = parse_chat_request(
        {"model": "epd", "messages": [USER], "stream": True, **body},
        "epd",
        SamplingOptions(),
        GenerationConfig(),
    )
    chat.parser_on = thinking is not None  # as the front door sets it under a reasoning parser
    chat.tool_choice = replace(chat.tool_choice, parser=tool_call_parser)  # as the front door
    return ChatChunks(chat, "req-1", thinking, created=7)


def _completion(**body) -> ChatChunks:
    chat = parse_completion_request(
        {"model": "epd", "prompt": "name a colour", "stream": True, **body},
        "epd",
        SamplingOptions(),
        GenerationConfig(),
    )
    return ChatChunks(chat, "req-1", None, created=7)


def _summary(answer: str, token_ids: list[int], choices: list[ChoiceSummary] | None = None) -> AskSummary:
    summary = AskSummary("req-1", answer, token_ids, "stop", 0, 0, 30, {}, 0, False, "", [])
    if choices is not None:
        summary.choices = choices
    return summary


def test_continuous_usage_is_the_usage_when_each_chunk_is_made():
    chunks = _chat(stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks.note(StageEvent(Stage.PREFILL, "finished", 1.0, {"num_prompt_tokens": "30"}))
    made = chunks.opening(0) + chunks.add(TokenStep([5], "a")) + chunks.add(TokenStep([6, 7], "bc", "stop"))
    made += chunks.finish(_summary("abc", [5, 6, 7]))
    assert [c["usage"]["completion_tokens"] for c in made] == [0, 1, 3, 3]  # role, a, bc (its end), usage
    assert [c["usage"]["total_tokens"] for c in made] == [30, 31, 33, 33]
    assert made[-1]["choices"] == [] and made[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert chunks.num_tokens == 3


def test_include_usage_alone_puts_usage_on_the_last_chunk_alone_as_vllms():
    """vLLM sets a chunk's `usage` only for continuous_usage_stats and writes its chunks without
    the fields left unset (`exclude_unset`): with include_usage alone its chat and completion
    chunks have no `usage` field (epd's said null) but the last, the usage chunk."""
    for plain in (
        _chat(stream_options={"include_usage": True}),
        _completion(stream_options={"include_usage": True}),
    ):
        made = plain.opening(0) + plain.add(TokenStep([5], "a", "stop")) + plain.finish(_summary("a", [5]))
        assert all("usage" not in c for c in made[:-1]) and made[-1]["usage"]["completion_tokens"] == 1
        assert made[-1]["choices"] == []
    bare = _chat()
    made = bare.opening(0) + bare.add(TokenStep([5], "a", "stop")) + bare.finish(_summary("a", [5]))
    assert all("usage" not in c for c in made) and len(made) == 2


def test_a_chat_chunk_has_stop_reason_only_with_its_finish_reason_as_vllms():
    """vLLM's chat chunks set `stop_reason` on the finish chunk alone (the role's, the echo's and a
    token step's leave it unset, so out); it comes after `finish_reason`, its place in vLLM's
    choice. A completion's chunks set every field: `stop_reason` null until the finish."""
    chunks = _chat(n=2, return_token_ids=True)
    made = chunks.opening(0) + chunks.add(TokenStep([5], "a", index=0))
    made += chunks.add(TokenStep([6], "b", "stop", stop_reason="###", index=1))
    made += chunks.add(TokenStep([7], "c", "length", index=0))
    made += chunks.finish(
        _summary(
            "ac",
            [5, 7],
            [ChoiceSummary(0, "ac", [5, 7], "length"), ChoiceSummary(1, "b", [6], "stop", "###")],
        )
    )
    choices = [c["choices"][0] for c in made]
    assert [list(c) for c in choices] == [
        ["index", "delta", "logprobs", "finish_reason"],  # the role's
        ["index", "delta", "logprobs", "finish_reason", "token_ids"],
        *[["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]] * 2,
    ]
    assert [(c["finish_reason"], c.get("stop_reason")) for c in choices] == [
        (None, None),
        (None, None),
        ("stop", "###"),
        ("length", None),
    ]
    bare = _chat().finish(_summary("", []))[0]["choices"][0]  # a finish of no step: its own chunk
    assert list(bare) == ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]
    completion = _completion()
    made = completion.add(TokenStep([5], "a")) + completion.add(TokenStep([6], "b", "stop", stop_reason=6))
    made += completion.finish(_summary("ab", [5, 6], [ChoiceSummary(0, "ab", [5, 6], "stop", 6)]))
    assert [c["choices"][0]["stop_reason"] for c in made] == [None, 6]
    assert all(list(c["choices"][0])[3:5] == ["finish_reason", "stop_reason"] for c in made)


def test_a_choice_finishing_first_ends_at_once_and_the_last_carries_the_summary():
    chunks = _chat(n=2)
    first = chunks.add(TokenStep([5], "red", "length", index=1))
    # its last token's chunk carries its finish reason, as vLLM's
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in first] == [(1, "length")]
    assert first[0]["choices"][0]["delta"] == {"content": "red"} and "epd" not in first[-1]
    assert chunks.add(TokenStep([6], "blue", "stop", index=0)) == []  # held for the summary
    summary = _summary(
        "blue", [6], [ChoiceSummary(0, "blue", [6], "stop"), ChoiceSummary(1, "red", [5], "length")]
    )
    end = chunks.finish(summary)
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in end] == [(0, "stop")]
    assert end[0]["choices"][0]["delta"] == {"content": "blue"} and end[0]["epd"]["request_id"] == "req-1"


def test_a_completions_echo_joins_its_first_steps_chunk_as_vllms():
    """vLLM's completion stream puts the echoed prompt in front of each choice's first step, in
    one chunk (it was a chunk of its own): the prompt's text then the step's, the prompt tokens'
    logprobs then the step's, offsets from 0 by each token's text; the step's own token ids. The
    choice's next offsets go on from that chunk's text's length (vLLM's `previous_text_lens`), not
    from its tokens' (here a BOS token's text, "<s>", is in the prompt's tokens, not its text)."""
    prompt = [
        TokenLogprob(0, "<s>", float("nan")),
        TokenLogprob(1, "name", -0.5),
        TokenLogprob(2, " a", -1.0),
        TokenLogprob(3, " colour", -2.0),
    ]
    chunks = _completion(echo=True, logprobs=1, n=2, return_token_ids=True)
    assert chunks.opening(0) == chunks.echo(0) == [] and not chunks.echo_is_costly  # no prompt logprobs yet
    chunks.note(PromptLogprobs(prompt))
    assert chunks.echo_is_costly
    (first,) = chunks.add(TokenStep([5], " red", logprobs=[TokenLogprob(5, " red", -0.5)], index=1))
    choice = first["choices"][0]
    assert (choice["index"], choice["text"], choice["token_ids"]) == (1, "name a colour red", [5])
    assert choice["logprobs"]["tokens"] == ["<s>", "name", " a", " colour", " red"]
    assert choice["logprobs"]["token_logprobs"] == [None, -0.5, -1.0, -2.0, -0.5]
    assert choice["logprobs"]["text_offset"] == [0, 3, 7, 9, 16]
    assert chunks.echo_is_costly  # choice 0 has its echo to carry still
    (other,) = chunks.add(TokenStep([6], " blue", logprobs=[TokenLogprob(6, " blue", -0.25)], index=0))
    assert other["choices"][0]["text"] == "name a colour blue" and not chunks.echo_is_costly
    (later,) = chunks.add(TokenStep([7], "!", logprobs=[TokenLogprob(7, "!", -0.1)], index=1))
    assert later["choices"][0]["text"] == "!" and later["choices"][0]["logprobs"]["text_offset"] == [17]
    plain = _completion(echo=True)
    (joined,) = plain.add(TokenStep([5], " red"))
    assert joined["choices"][0]["text"] == "name a colour red" and joined["choices"][0]["logprobs"] is None
    assert plain.add(TokenStep([6], "!"))[0]["choices"][0]["text"] == "!"
    assert _completion().add(TokenStep([5], " red"))[0]["choices"][0]["text"] == " red"


def test_a_chat_echo_stays_a_chunk_of_its_own_as_vllms():
    """vLLM's chat stream sends the echoed last message in a chunk of its own after the role's,
    without logprobs, unlike its completions."""
    chat = parse_chat_request(
        {
            "model": "epd",
            "messages": [USER, {"role": "assistant", "content": "The colour is"}],
            "stream": True,
            "echo": True,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        "epd",
        SamplingOptions(),
        GenerationConfig(),
    )
    chunks = ChatChunks(chat, "req-1", None, created=7)
    (echo,) = chunks.echo(0)
    assert (
        echo["choices"][0]["delta"] == {"content": "The colour is"} and echo["choices"][0]["logprobs"] is None
    )
    assert chunks.add(TokenStep([5], " red"))[0]["choices"][0]["delta"] == {"content": " red"}


def test_a_named_tools_arguments_stream_as_tool_call_deltas():
    """vLLM's named tool choice: the first step's chunk is the call's index, id, type, name and
    the step's arguments in one delta (they were two chunks), then each step's arguments."""
    chunks = _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    made = chunks.add(TokenStep([5], '{"city": ')) + chunks.add(TokenStep([6], '"Paris"}', "stop"))
    made += chunks.finish(_summary('{"city": "Paris"}', [5, 6]))
    deltas = [c["choices"][0]["delta"] for c in made]
    assert len(deltas) == 2 and [len(d["tool_calls"]) for d in deltas] == [1, 1]
    first = deltas[0]["tool_calls"][0]
    assert (first["index"], first["type"], first["id"].startswith("chatcmpl-tool-")) == (0, "function", True)
    assert first["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert deltas[1]["tool_calls"] == [{"index": 0, "function": {"arguments": '"Paris"}'}}]
    assert [c["choices"][0]["finish_reason"] for c in made][-1] == "stop"  # named: vLLM's "stop"


def test_a_steps_content_and_calls_go_in_one_chunk_as_vllms_one_delta_a_step():
    """vLLM's tool parsers give one DeltaMessage a step, so a step that ends the content, opens a
    call and writes its arguments, or writes two calls, is one chunk: its content, and one
    `tool_calls` entry per call, each call's header and arguments joined (they were a chunk
    each). Joined, the deltas are the whole answer's calls."""
    chunks = _chat(tools=[TOOL], return_token_ids=True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    (one,) = chunks.add(TokenStep([5, 6], "Sure. " + call % "Paris"))
    delta = one["choices"][0]["delta"]
    assert delta["content"] == "Sure. " and one["choices"][0]["token_ids"] == [5, 6]
    ((paris,),) = [delta["tool_calls"]]
    assert (paris["index"], paris["type"], paris["function"]["name"]) == (0, "function", "get_weather")
    assert json.loads(paris["function"]["arguments"]) == {"city": "Paris"}
    made = chunks.add(TokenStep([7], "\n" + call % "Rome" + "\n" + call % "Oslo", "stop"))
    made += chunks.finish(_summary("", [5, 6, 7]))
    assert len(made) == 1 and made[0]["choices"][0]["finish_reason"] == "tool_calls"
    calls = made[0]["choices"][0]["delta"]["tool_calls"]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(1, "get_weather"), (2, "get_weather")]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Rome"}, {"city": "Oslo"}]
    assert len({c["id"] for c in [paris, *calls]}) == 3


def test_a_hermes_calls_header_chunk_always_carries_its_arguments_start():
    """vLLM's hermes header has no `arguments` key (docs/from-vllm.md, `stream`); epd's header waits
    for `"arguments": {`, so wherever the steps cut the call, the chunk holding its id and name
    carries that `{` (`arguments` never "" on the wire)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for cut in [*range(1, len(call)), None]:  # two steps at each place, then a character a step
        steps = list(call) if cut is None else [call[:cut], call[cut:]]
        chunks = _chat(tools=[TOOL])
        made = [c for i, text in enumerate(steps) for c in chunks.add(TokenStep([i], text))]
        made += chunks.finish(_summary(call, list(range(len(steps)))))
        headers = [e for c in made for e in c["choices"][0]["delta"].get("tool_calls", []) if "id" in e]
        assert len(headers) == 1 and headers[0]["function"]["arguments"].startswith("{"), (cut, headers)


def test_a_final_steps_held_back_tail_joins_its_chunk():
    """A choice's final step and the text its parsers gave back at the end (here a `<tool_call>`
    block cut by max_tokens before its name: content) are one chunk with the finish reason, as
    vLLM's last step is one chunk (they were two). Hermes' deltas of text carry no `tool_calls`:
    vLLM's hermes sets it to [], which its DeltaMessage leaves out (vLLM PR #44105)."""
    chunks = _chat(tools=[TOOL])
    made = chunks.add(TokenStep([5], "Let me")) + chunks.add(TokenStep([6], " check <tool_", "length"))
    text = "Let me check <tool_"
    made += chunks.finish(_summary(text, [5, 6], [ChoiceSummary(0, text, [5, 6], "length")]))
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in made] == [
        ({"content": "Let me"}, None),
        ({"content": " check <tool_"}, "length"),
    ]


def test_the_end_of_sequence_tokens_step_is_the_finish_chunk_not_a_chunk_before_it():
    """vLLM puts the finish reason on the chunk of the choice's last token: the end-of-sequence
    step (no text) is that chunk, not an empty-content chunk followed by a finish chunk."""
    chunks = _chat(return_token_ids=True)
    made = chunks.add(TokenStep([5], "a")) + chunks.add(TokenStep([2], "", "stop"))
    made += chunks.finish(_summary("a", [5, 2]))
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in made] == [
        ({"content": "a"}, None),
        ({"content": ""}, "stop"),  # vLLM's delta without a parser
    ]
    assert [c["choices"][0]["token_ids"] for c in made] == [[5], [2]] and "epd" in made[-1]


def test_token_ids_only_with_return_token_ids_and_never_with_the_reasoning_left_out():
    """vLLM's `return_token_ids`: the chunks list their tokens' ids only when asked; a thinking
    answer whose reasoning is left out shows none (they would show it), as vLLM hides them."""

    def ids(chunks: ChatChunks) -> list:
        made = chunks.add(TokenStep([5], "a")) + chunks.add(TokenStep([6], "b", "stop"))
        made += chunks.finish(_summary("ab", [5, 6]))
        return [c["choices"][0].get("token_ids") for c in made]

    assert ids(_chat()) == [None, None]
    assert ids(_chat(return_token_ids=True)) == [[5], [6]]
    assert ids(_completion(return_token_ids=True)) == [[5], [6]]
    assert ids(_completion()) == [None, None]
    assert ids(_chat(False, return_token_ids=True, include_reasoning=False)) == [None, None]


def test_no_logprobs_with_the_reasoning_left_out_whole_or_streamed():
    """`include_reasoning` false under a reasoning parser: vLLM drops every token's logprobs (the
    content's too, its `hide_stream_metadata` / `suppress_metadata`), whose token text would show
    the reasoning; a step with nothing else to say then makes no chunk."""
    lps = [TokenLogprob(5, "plan", -0.5), TokenLogprob(6, "</think>", -0.1), TokenLogprob(7, "red", -0.25)]
    ends = ["", "", "stop"]
    steps = [
        TokenStep([lp.token_id], lp.token, end, logprobs=[lp]) for lp, end in zip(lps, ends, strict=True)
    ]
    summary = _summary(
        "plan</think>red", [5, 6, 7], [ChoiceSummary(0, "plan</think>red", [5, 6, 7], "stop", None, lps)]
    )

    def streamed(include_reasoning: bool) -> list:
        chunks = _chat(True, logprobs=True, include_reasoning=include_reasoning)
        made = [c for step in steps for c in chunks.add(step)] + chunks.finish(summary)
        return [(c["choices"][0]["delta"], c["choices"][0]["logprobs"]) for c in made]

    def whole(include_reasoning: bool) -> dict | None:
        body = completion_body(
            summary, "epd", thinking=True, include_reasoning=include_reasoning, parser_on=True, steps=steps
        )
        return body["choices"][0]["logprobs"]

    assert [lp is not None for _, lp in streamed(True)] == [True, True, True]
    # the marker's step says nothing; the content's has vLLM's null reasoning
    assert streamed(False) == [({"content": "red", "reasoning": None, "reasoning_content": None}, None)]
    assert [e["token"] for e in whole(True)["content"]] == ["plan", "</think>", "red"]
    assert whole(False) is None


def test_the_reasoning_left_out_is_null_on_each_delta_a_parser_keeps_and_on_the_message():
    """`include_reasoning` false: vLLM's parser sets the reasoning of each delta it keeps (one with
    content or calls) to None, which `exclude_unset` writes as `"reasoning": null` after `content`
    (epd's alias `reasoning_content` with it); a delta of reasoning alone it drops; the whole
    message's is null (vLLM's `ChatMessage(reasoning=None)`). Kept, there is no null."""
    null = {"reasoning": None, "reasoning_content": None}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    texts = ["plan", "</think>Sure.", call]

    def deltas(include_reasoning: bool, **body) -> list[dict]:
        chunks = _chat(True, include_reasoning=include_reasoning, **body)
        made = [c for i, text in enumerate(texts) for c in chunks.add(TokenStep([i], text))]
        made += chunks.finish(_summary("".join(texts), [0, 1, 2]))
        return [c["choices"][0]["delta"] for c in made]

    plain = deltas(False)
    assert plain[0] == {"content": "Sure.", **null} and plain[1] == {"content": call, **null}
    hermes = deltas(False, tools=[TOOL])  # hermes: content null beside the call, as vLLM's
    assert hermes[0] == {"content": "Sure.", **null} and list(hermes[1]) == ["content", *null, "tool_calls"]
    assert hermes[1]["content"] is None and hermes[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    kept = deltas(True, tools=[TOOL])
    assert kept[0] == {"reasoning": "plan", "reasoning_content": "plan"}
    assert all("reasoning" not in d for d in kept[1:])
    steps = [TokenStep([i], text) for i, text in enumerate(texts)]
    body = completion_body(
        _summary("".join(texts), [0, 1, 2]),
        "epd",
        thinking=True,
        include_reasoning=False,
        parser_on=True,
        steps=steps,
    )
    message = body["choices"][0]["message"]
    assert "reasoning" in message and (message["reasoning"], message["reasoning_content"]) == (None, None)


def test_a_qwen3_coder_delta_holds_only_what_it_says_a_hermes_delta_its_content_too():
    """vLLM's qwen3_coder (the parser engine's `DeltaMessage(**kwargs)`) sets only the fields a
    step has: text alone, or calls alone. Its hermes sets `content` on each delta, null beside
    calls, and `tool_calls` too, which vLLM's DeltaMessage leaves out when empty (PR #44105): no
    `"tool_calls": []` beside text from either."""
    qwen = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for parser, call in (("qwen3_coder", qwen), ("hermes", hermes)):
        chunks = _chat(tools=[TOOL], tool_call_parser=parser)
        made = chunks.add(TokenStep([5], "Let me check.")) + chunks.add(TokenStep([6], call, "stop"))
        made += chunks.finish(_summary("Let me check." + call, [5, 6]))
        text, called = [c["choices"][0]["delta"] for c in made]
        assert text == {"content": "Let me check."}, parser
        assert list(called) == (["tool_calls"] if parser == "qwen3_coder" else ["content", "tool_calls"]), (
            parser
        )
        assert json.loads(called["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_a_step_a_parser_holds_back_makes_no_chunk_unless_it_carries_ids_or_logprobs():
    """A step whose text the reasoning parser holds back (here a marker's start) has nothing to
    say: vLLM sends no chunk for it, unless the chunk carries token ids asked for or logprobs."""

    def made(**body) -> list:
        chunks = _chat(True, **body)
        lp = [TokenLogprob(6, "</", -0.5)] if body.get("logprobs") else None
        return chunks.add(TokenStep([5], "hm")) + chunks.add(TokenStep([6], "</", logprobs=lp))

    assert [c["choices"][0]["delta"] for c in made()] == [{"reasoning": "hm", "reasoning_content": "hm"}]
    assert [c["choices"][0]["token_ids"] for c in made(return_token_ids=True)] == [[5], [6]]
    assert len(made(logprobs=True)) == 2


def test_a_held_back_final_steps_finish_rides_on_its_parsers_tail_not_an_empty_chunk():
    """The final step's text all held back (a marker's possible start) makes no empty chunk of
    its own: the tail its parser gives back at the end carries the finish reason."""
    chunks = _chat(True)
    made = chunks.add(TokenStep([5], "hm")) + chunks.add(TokenStep([6], "</thi", "length"))
    made += chunks.finish(_summary("hm</thi", [5, 6], [ChoiceSummary(0, "hm</thi", [5, 6], "length")]))
    assert [(c["choices"][0]["delta"].get("reasoning"), c["choices"][0]["finish_reason"]) for c in made] == [
        ("hm", None),
        ("</thi", "length"),
    ]


def test_an_echo_alone_is_one_chunk_with_its_finish_and_generated_tokens_id():
    """A completion's echo with max_tokens 0 generates one token (vLLM's): the stream is one chunk
    a choice, the prompt alone with its logprobs and the finish reason, listing the generated
    token's id as the whole answer's `token_ids` does (it was an echo chunk and an empty one)."""
    chunks = _completion(echo=True, max_tokens=0, logprobs=0, return_token_ids=True)
    chunks.note(PromptLogprobs([TokenLogprob(1, "name", float("nan")), TokenLogprob(2, " a colour", -1.0)]))
    assert chunks.add(TokenStep([5], " red", "length", logprobs=[TokenLogprob(5, " red", -0.5)])) == []
    assert chunks.echo_is_costly  # held back for the summary, the prompt's logprobs with it
    (made,) = chunks.finish(_summary(" red", [5], [ChoiceSummary(0, " red", [5], "length")]))
    assert not chunks.echo_is_costly
    choice = made["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["token_ids"]) == ("name a colour", "length", [5])
    assert choice["logprobs"]["tokens"] == ["name", " a colour"] and "epd" in made
    whole = text_completion_body(_summary(" red", [5]), chunks.chat)
    assert whole["choices"][0]["token_ids"] == [5] and whole["choices"][0]["text"] == "name a colour"


def test_a_failure_before_the_summary_still_sends_the_held_back_last_tokens():
    """The last choice's final step waits for the summary (its chunk carries it); when the answer
    fails before the summary, the writer sends that step's text before the error event."""
    chunks = _chat()
    assert chunks.add(TokenStep([5], "a", "stop")) == []
    (cut,) = chunks.cut()
    assert cut["choices"][0]["delta"] == {"content": "a"} and cut["choices"][0]["finish_reason"] is None
    assert chunks.cut() == []


def test_the_chunks_module_needs_no_http_server():
    code = "import sys, epd.gateway.chat_chunks; print('aiohttp' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False"
