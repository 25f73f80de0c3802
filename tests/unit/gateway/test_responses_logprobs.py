"""A Responses API request's logprobs (vLLM's `include: ["message.output_text.logprobs"]` and
`top_logprobs`): what the body asks for, and where the tokens' logprobs go in the whole response
and its streamed events."""

from __future__ import annotations

import pytest

from epd.gateway.logprobs_protocol import chat_logprobs
from epd.gateway.responses_events import ResponseEvents, response_body
from epd.model_runtime.logprobs import TokenLogprob, TopLogprob
from epd.stages.contracts import TokenStep
from epd.stages.errors import InvalidRequest
from tests.unit.gateway.responses_bodies import TOOL, parse, summary, whole


def _step(token_id: int, text: str) -> TokenStep:
    """One token's step, with its logprob (-token_id) and one most likely token."""
    top = (TopLogprob(0, "?", -0.5),)
    return TokenStep([token_id], text, logprobs=[TokenLogprob(token_id, text, -float(token_id), top)])


def _logprob(step: TokenStep, delta: bool = False) -> dict:
    """OpenAI's entry for `step`'s token: the output_text's, or (`delta`) a delta event's, without
    bytes. Its one top_logprobs entry is the sampled token itself, not the more likely "?": vLLM
    lists the sampled token first and takes the first k (k = 1 here), as chat does."""
    (lp,) = step.logprobs or ()
    entry = {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode())}
    if delta:
        return {
            "token": lp.token,
            "logprob": lp.logprob,
            "top_logprobs": [{"token": lp.token, "logprob": lp.logprob}],
        }
    return {**entry, "top_logprobs": [entry]}


def test_logprobs_go_on_the_output_text_and_its_deltas():
    """include: ["message.output_text.logprobs"] with top_logprobs (vLLM's): the message's text
    carries its tokens' logprobs, each delta event its own; the reasoning's tokens (markers too)
    have none, as a reasoning item has no place for them, and are counted as reasoning tokens
    (markers left out, as vLLM) in the same pass."""
    request = parse(input="hi", include=["message.output_text.logprobs"], top_logprobs=1, stream=True)
    assert request.generation.logprobs == 1
    steps = [_step(1, "hm"), _step(2, "m"), _step(3, "</think>"), _step(4, "Su"), _step(5, "re")]
    shaper = ResponseEvents(request, "r1", thinking=True)
    events = [e for s in steps for e in shaper.add(s.text, s.token_ids, s.logprobs)]
    events += shaper.finish(summary("hmm</think>Sure"))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [d["logprobs"] for d in deltas] == [[_logprob(steps[3], True)], [_logprob(steps[4], True)]]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    response = events[-1]["response"]
    text = response["output"][1]["content"][0]
    assert text["logprobs"] == [_logprob(steps[3]), _logprob(steps[4])]
    assert done["logprobs"] == [_logprob(steps[3], True), _logprob(steps[4], True)]  # the event's form
    assert response["top_logprobs"] == 1
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    body = response_body(summary("hmm</think>Sure"), request, True, steps)  # the whole answer: the same
    assert body["output"][1]["content"] == response["output"][1]["content"]
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}


def _tokens_step(texts: list[str], text: str) -> TokenStep:
    """A step of several tokens (`texts`, each decoded alone, ids from 10 on) that made `text`."""
    ids = [10 + sum(map(len, texts[:i])) for i in range(len(texts))]
    return TokenStep(
        ids, text, logprobs=[TokenLogprob(i, t, -float(i)) for i, t in zip(ids, texts, strict=True)]
    )


def test_a_step_that_ends_the_block_gives_its_content_tokens_logprobs_to_the_message():
    """A step of several tokens that begins inside the thinking block and ends it: the tokens
    after `</think>`'s are the message's, their logprobs those chat gives for the same tokens
    (they were all dropped with the step's reasoning). A content token whose character is not
    whole yet gives its logprob to the delta that sends the character; content tokens that come
    before their text (decode held it back) give theirs to the delta that sends it."""
    request = parse(input="hi", include=["message.output_text.logprobs"], stream=True)
    steps = [
        _tokens_step(["hm", "</think>", "\ufffd"], "hm</think>"),  # half of "é": no content text yet
        _tokens_step(["\ufffd", "Su", "re"], "éSure"),
        _tokens_step([" a", "</think>"], " a</think>"),  # a second </think> is content
    ]
    want = chat_logprobs([lp for s in steps for lp in s.logprobs or ()])["content"]
    shaper = ResponseEvents(request, "r1", thinking=True)
    events = [e for s in steps for e in shaper.add(s.text, s.token_ids, s.logprobs)]
    events += shaper.finish(summary("hm</think>éSure a</think>"))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [d["delta"] for d in deltas] == ["éSure", " a</think>"]
    delta_logprobs = [[lp["token"] for lp in d["logprobs"]] for d in deltas]
    assert delta_logprobs == [["\ufffd", "\ufffd", "Su", "re"], [" a", "</think>"]]
    text = events[-1]["response"]["output"][1]["content"][0]
    assert text["logprobs"] == want[2:]  # chat's entries for the message's tokens
    assert [lp for d in deltas for lp in d["logprobs"]] == [
        {k: v for k, v in lp.items() if k != "bytes"} for lp in want[2:]
    ]
    body = response_body(summary("hm</think>éSure a</think>"), request, True, steps)  # whole: the same
    assert body["output"][1]["content"][0]["logprobs"] == want[2:]

    # A stop string that begins with "</think>" makes decode hold text back: the text lags the
    # tokens, so content tokens come while the text is still reasoning; they wait for it.
    lagging = [
        _tokens_step(["hm"], ""),
        _tokens_step(["</think>"], "hm"),
        _tokens_step(["Su"], ""),
        _tokens_step(["re"], "</think>Sure"),
    ]
    shaper = ResponseEvents(request, "r2", thinking=True)
    events = [e for s in lagging for e in shaper.add(s.text, s.token_ids, s.logprobs)]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(d["delta"], [lp["token"] for lp in d["logprobs"]]) for d in deltas] == [("Sure", ["Su", "re"])]


def test_a_stop_strings_tokens_keep_their_logprobs_on_the_message():
    """stop "END": decode holds " E" back (it may begin the stop string), then "ND" completes it and
    the held text is cut. Neither token made text the message got, yet vLLM's whole message (every
    output token's, `_create_response_logprobs` of the whole token_ids) and chat (vLLM's and epd's)
    keep their logprobs: so do the message's output_text, its done event and, on a last delta of
    no text, the stream."""
    request = parse(input="hi", include=["message.output_text.logprobs"], stop="END", stream=True)
    steps = [_step(1, "Hi"), _tokens_step([" E"], ""), _tokens_step(["ND"], "")]
    want = chat_logprobs([lp for s in steps for lp in s.logprobs or ()])["content"]
    body = response_body(summary("Hi"), request, None, steps)
    assert body["output"][0]["content"][0]["logprobs"] == want
    assert body["output"][0]["content"][0]["text"] == "Hi"

    shaper = ResponseEvents(request, "r1", thinking=None)
    events = [e for s in steps for e in shaper.add(s.text, s.token_ids, s.logprobs)]
    events += shaper.finish(summary("Hi"))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(d["delta"], len(d["logprobs"])) for d in deltas] == [("Hi", 1), ("", 2)]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == [lp for d in deltas for lp in d["logprobs"]]
    assert done["text"] == "Hi"
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == want

    # An answer whose every token the stop string cut has no message, vLLM's neither: nothing to carry them.
    body = response_body(summary(""), request, None, steps[1:])
    assert body["output"] == []


def test_held_back_text_takes_its_tokens_logprobs_to_the_delta_that_releases_it():
    """Under "auto" tools, "<" may begin a call: held back, its token's logprob waits and goes
    with the delta that sends it once it is content; a call's tokens have none."""
    request = parse(input="hi", include=["message.output_text.logprobs"], tools=[TOOL], tool_choice="auto")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    steps = [_step(1, "a "), _step(2, "<"), _step(3, "b"), _step(4, call)]
    shaper = ResponseEvents(request, "r1", thinking=None)
    deltas = [shaper.add(s.text, s.token_ids, s.logprobs) for s in steps]
    sent = [[e["logprobs"] for e in d if e["type"] == "response.output_text.delta"] for d in deltas]
    assert sent == [
        [[_logprob(steps[0], True)]],
        [],
        [[_logprob(steps[1], True), _logprob(steps[2], True)]],
        [],
    ]
    response = shaper.finish(summary("a <b" + call))[-1]["response"]
    message, function_call = response["output"]
    assert message["content"][0]["logprobs"] == [_logprob(s) for s in steps[:3]]
    assert function_call["type"] == "function_call" and "logprobs" not in function_call


def test_the_include_values_vllm_takes_are_accepted_and_give_nothing_more():
    """vLLM's request takes six `include` values; a client that always sends one (Codex:
    "reasoning.encrypted_content") was refused with a 400. The five but the logprobs ask for
    what epd has none of: the answer is the one without them."""
    others = [
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "reasoning.encrypted_content",
    ]
    request = parse(input="hi", include=others)
    assert request.generation == parse(input="hi").generation
    assert request.generation.logprobs is None
    with_logprobs = parse(input="hi", include=[*others, "message.output_text.logprobs"])
    assert with_logprobs.generation.logprobs == 0


def test_without_include_no_logprobs_are_asked_or_sent():
    """vLLM reads top_logprobs only with the logprobs `include`: without it, any integer asks for
    nothing (it was a 400 above 0); with it, one out of range is chat's 400."""
    for top in (0, 2, 50, -1):
        assert parse(input="hi", top_logprobs=top).generation.logprobs is None
    with pytest.raises(InvalidRequest, match="'top_logprobs' must be an integer from 0"):
        parse(input="hi", top_logprobs=-1, include=["message.output_text.logprobs"])
    request = parse(input="hi", top_logprobs=2)
    body = whole(summary("hello"), request, None)
    assert body["top_logprobs"] is None and "logprobs" not in body["output"][0]["content"][0]


def test_top_logprobs_is_read_as_vllms_int_with_or_without_the_include():
    """vLLM's request types top_logprobs `int`, which pydantic's lax mode reads from 2.0, "2" and
    true (1) too: taken here as there, ignored without the include; 2.5 or "two" is a 400 either way."""
    for top, k in ((2.0, 2), ("2", 2), (" 3 ", 3), (True, 1), ("1_0", 10)):
        assert parse(input="hi", top_logprobs=top).generation.logprobs is None
        assert (
            parse(input="hi", top_logprobs=top, include=["message.output_text.logprobs"]).generation.logprobs
            == k
        )
    for bad in (2.5, "2.5", "two", [2], {"k": 2}):
        for include in ([], ["message.output_text.logprobs"]):
            with pytest.raises(InvalidRequest, match="'top_logprobs' must be an integer"):
                parse(input="hi", top_logprobs=bad, include=include)
