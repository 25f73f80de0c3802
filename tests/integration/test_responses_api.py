"""OpenAI's Responses API (`POST /v1/responses`) through the real stack, driven by the `openai`
client's `responses.create` as a user drives it: a video question's answer is chat completions'
token for token (greedy), its streamed events joined are the whole response, a named function
comes back as a function_call item with the arguments chat's call has, text.format json_schema
is chat's response_format, and `store: true` is a 400 saying epd keeps no responses."""

from __future__ import annotations

import base64
import json
import urllib.request
import uuid

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.integration.structured_cases import SCHEMA
from tests.local_http import post_json, sse_chunks
from tests.tool_data import WEATHER, no_whitespace_bias

QUESTION = "what colour is the moving square?"
MAX_TOKENS = 8
MEDIA = {"media": {"num_frames": 4}}
TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat form of chat's


@pytest.fixture(scope="module")
def client(shared_stack):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{shared_stack.http_port}/v1", api_key="none", max_retries=0
    )


@pytest.fixture(scope="module")
def video_url(media_files):
    return "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()


def _same_logprobs(got: list[dict], want: list[dict]) -> bool:
    """The same tokens, top tokens and bytes, with logprobs equal to 1e-4: the second request's
    prompt may come from the prefix cache the first one filled, its prefill then runs over the
    suffix alone, and float32 sums in another order differ in the last digits (seen: 1e-6)."""

    def parts(lps: list[dict]) -> tuple[list, list[float]]:
        shapes, values = [], []
        for lp in lps:
            shapes.append(
                {**lp, "logprob": None, "top_logprobs": [{**t, "logprob": None} for t in lp["top_logprobs"]]}
            )
            values += [lp["logprob"], *(t["logprob"] for t in lp["top_logprobs"])]
        return shapes, values

    (got_shapes, got_values), (want_shapes, want_values) = parts(got), parts(want)
    return got_shapes == want_shapes and got_values == pytest.approx(want_values, abs=1e-4)


def _parts(video_url: str) -> list[dict]:
    return [{"type": "text", "text": QUESTION}, {"type": "video_url", "video_url": {"url": video_url}}]


def test_a_video_question_is_chats_answer_plain_and_streamed(client, video_url):
    chat = client.chat.completions.create(
        model="epd",
        messages=[{"role": "user", "content": _parts(video_url)}],
        max_tokens=MAX_TOKENS,
        extra_body=MEDIA,
    )
    response = client.responses.create(
        model="epd",
        input=[{"role": "user", "content": _parts(video_url)}],
        max_output_tokens=MAX_TOKENS,
        extra_body=MEDIA,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model_extra["epd"]["token_ids"] == chat.model_extra["epd"]["token_ids"]
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert chat.choices[0].finish_reason == "length"  # the tiny model runs to max_tokens
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == MAX_TOKENS

    events = list(
        client.responses.create(
            model="epd",
            input=[{"role": "user", "content": _parts(video_url)}],
            max_output_tokens=MAX_TOKENS,
            stream=True,
            extra_body=MEDIA,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text
    final = events[-1].response
    assert final.output_text == response.output_text and final.usage.output_tokens == MAX_TOKENS
    assert final.model_extra["epd"]["token_ids"] == response.model_extra["epd"]["token_ids"]


def test_logprobs_are_chats_on_the_text_and_its_deltas(client, video_url):
    """include: ["message.output_text.logprobs"] with top_logprobs, vLLM's: the output_text's
    logprobs are chat's for the same greedy request, and the streamed deltas' joined are the same
    (without "bytes", as OpenAI's delta events)."""
    chat = client.chat.completions.create(
        model="epd",
        messages=[{"role": "user", "content": _parts(video_url)}],
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=2,
        extra_body=MEDIA,
    )
    want = [lp.model_dump() for lp in chat.choices[0].logprobs.content]
    assert len(want) == MAX_TOKENS and all(len(lp["top_logprobs"]) == 2 for lp in want)
    ask = {
        "model": "epd",
        "input": [{"role": "user", "content": _parts(video_url)}],
        "max_output_tokens": MAX_TOKENS,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "extra_body": MEDIA,
    }
    response = client.responses.create(**ask)
    assert response.model_extra["epd"]["token_ids"] == chat.model_extra["epd"]["token_ids"]
    (text,) = response.output[0].content
    assert _same_logprobs([lp.model_dump() for lp in text.logprobs], want) and response.top_logprobs == 2

    events = list(client.responses.create(**ask, stream=True))
    deltas = [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]

    def without_bytes(lp: dict) -> dict:
        top = [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]]
        return {"token": lp["token"], "logprob": lp["logprob"], "top_logprobs": top}

    assert _same_logprobs(deltas, [without_bytes(lp) for lp in want])
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in done.logprobs] == deltas


def test_a_stop_strings_tokens_keep_their_logprobs_as_chats(client, video_url):
    """A stop string whose tokens' text is cut from the answer: chat's logprobs keep those tokens'
    (vLLM's chat and its whole Responses message too, every output token's), and so does the
    Responses message, whole and streamed (its last delta, of no text, carries them)."""

    def chat_answer(stop: str | None = None):
        return client.chat.completions.create(
            model="epd",
            messages=[{"role": "user", "content": _parts(video_url)}],
            max_tokens=MAX_TOKENS,
            logprobs=True,
            stop=stop,
            extra_body=MEDIA,
        )

    plain = chat_answer()
    tokens = [lp.token for lp in plain.choices[0].logprobs.content]
    answer = "".join(tokens)
    # A later token of one character whose text first appears where it stands: the stop string it
    # completes, in a step of its own whose text is cut (decode holds back no text for a stop
    # string of one character; it and the token before are whole characters: a token that ends a
    # character sends the text of the one before it with its own).
    i = next(
        i
        for i in range(2, len(tokens))
        if len(tokens[i]) == 1
        and tokens[i].strip()
        and "\ufffd" not in tokens[i - 1] + tokens[i]
        and answer.find(tokens[i]) == len("".join(tokens[:i]))
    )
    stop = tokens[i]
    chat = chat_answer(stop)
    want = [lp.model_dump() for lp in chat.choices[0].logprobs.content]
    assert chat.choices[0].message.content == "".join(tokens[:i]) and len(want) == i + 1
    ask = {
        "model": "epd",
        "input": [{"role": "user", "content": _parts(video_url)}],
        "max_output_tokens": MAX_TOKENS,
        "include": ["message.output_text.logprobs"],
        "extra_body": {**MEDIA, "stop": stop},
    }

    def assert_chats(logprobs: list) -> None:
        """Chat's tokens, and their numbers but for float noise: two runs of a request may differ
        in the last bits (one reusing the other's prompt KV)."""
        got = [lp.model_dump() for lp in logprobs]
        assert [lp["token"] for lp in got] == [lp["token"] for lp in want]
        assert [lp["logprob"] for lp in got] == pytest.approx([lp["logprob"] for lp in want], abs=1e-4)

    response = client.responses.create(**ask)
    (text,) = response.output[0].content
    assert text.text == chat.choices[0].message.content
    assert_chats(text.logprobs)

    events = list(client.responses.create(**ask, stream=True))
    assert_chats([lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs])
    assert_chats(events[-1].response.output[0].content[0].logprobs)


def test_a_named_function_is_a_function_call_item(client, shared_stack, tiny_models):
    compact = no_whitespace_bias(tiny_models["qwen2_vl"])
    chat = client.chat.completions.create(
        model="epd",
        messages=[{"role": "user", "content": "weather in Rome?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        extra_body={"logit_bias": compact},
    )
    (chat_call,) = chat.choices[0].message.tool_calls
    ask = {
        "model": "epd",
        "input": "weather in Rome?",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 48,
        "extra_body": {"logit_bias": compact},
    }
    response = client.responses.create(**ask)
    (call,) = response.output
    assert (call.type, call.name, call.arguments) == (
        "function_call",
        "get_weather",
        chat_call.function.arguments,
    )
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")  # OpenAI's forms
    events = list(client.responses.create(**ask, stream=True))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert (done.type, done.name, done.arguments) == ("function_call", "get_weather", call.arguments)


def test_text_format_json_schema_is_chats_response_format(client, video_url):
    fmt = {"type": "json_schema", "name": "objects", "schema": SCHEMA, "strict": True}
    chat = client.chat.completions.create(
        model="epd",
        messages=[{"role": "user", "content": _parts(video_url)}],
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}},
        extra_body=MEDIA,
    )
    response = client.responses.create(
        model="epd",
        input=[{"role": "user", "content": _parts(video_url)}],
        max_output_tokens=64,
        text={"format": fmt},
        extra_body=MEDIA,
    )
    assert response.model_extra["epd"]["token_ids"] == chat.model_extra["epd"]["token_ids"]
    assert response.output_text == chat.choices[0].message.content
    assert response.text.format.type == "json_schema"
    plain = client.responses.create(
        model="epd",
        input=[{"role": "user", "content": _parts(video_url)}],
        max_output_tokens=64,
        extra_body=MEDIA,
    )
    assert plain.model_extra["epd"]["token_ids"] != response.model_extra["epd"]["token_ids"]  # constrained
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)


def test_refusals_are_chats_statuses(client, shared_stack):
    with pytest.raises(openai.BadRequestError, match="epd keeps no responses") as info:
        client.responses.create(model="epd", input="hi", store=True)
    assert info.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="'previous_response_id' is not supported"):
        client.responses.create(model="epd", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="hi")
    # The smallest raw body answers, and the route has its own label in the metrics.
    request = urllib.request.Request(
        f"http://127.0.0.1:{shared_stack.http_port}/v1/responses",
        data=json.dumps({"model": "epd", "input": "ping", "max_output_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert json.loads(reply.read())["object"] == "response"
    with urllib.request.urlopen(f"http://127.0.0.1:{shared_stack.http_port}/metrics", timeout=30) as reply:
        metrics = reply.read().decode()
    assert 'route="/v1/responses"' in metrics and 'code="400"' in metrics


def test_usage_says_the_prompt_tokens_written_to_and_read_from_prefills_prefix_cache(shared_stack):
    """OpenAI's client models require `input_tokens_details.cache_write_tokens` ("the number of
    input tokens that were written to the cache"), which epd did not write (vLLM writes
    `cached_tokens` alone). A first prompt writes all its tokens into prefill's prefix cache and
    reads none; the same prompt again, streamed, writes none and reads all but its last (at least
    one token is computed, for the first token's logits: vLLM backs off the same way). Its own
    tenant (`cache_salt`), so that nothing cached before by the shared stack is found."""
    body = {"model": "epd", "input": QUESTION, "max_output_tokens": 2, "cache_salt": f"writes-{uuid.uuid4()}"}
    status, first = post_json(shared_stack.http_port, "/v1/responses", body)
    assert status == 200, first
    Response.model_validate(first, strict=True)
    num_prompt_tokens = first["usage"]["input_tokens"]
    assert first["usage"]["input_tokens_details"] == {
        "cached_tokens": 0,
        "cache_write_tokens": num_prompt_tokens,
    }

    # The stream's last event (response.completed, or response.incomplete at max_output_tokens as
    # here: the tiny model runs on) carries the same usage.
    events = sse_chunks(shared_stack.http_port, "/v1/responses", body)
    last = TypeAdapter(ResponseStreamEvent).validate_python(events[-1], strict=True)
    assert last.type in ("response.completed", "response.incomplete"), last.type
    usage = last.response.usage
    assert usage is not None and usage.input_tokens == num_prompt_tokens
    assert usage.input_tokens_details.model_dump(exclude_none=True) == {
        "cached_tokens": num_prompt_tokens - 1,
        "cache_write_tokens": 0,
    }
