"""OpenAI's legacy completions (`POST /v1/completions`) and vLLM's `stop_reason`.

A raw prompt runs with no chat template, tokenised as `tokenizer(prompt)` tokenises it: its tokens
equal `model.generate(tokenizer(prompt).input_ids, do_sample=False)` in every family, through the
HTTP API over the embedded pipeline (the three stages in one process) and over the real stack,
plain and streamed (SSE), and through the gRPC API and the SDK (`prompt=`). Every choice says
which stop ended it (`stop_reason`: the stop string, the stop token id, or null), on chat too."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from epd.client import EpdClient, EpdError
from epd.gateway.ask_types import AskRequest
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.errors import InvalidRequest
from epd.stages.messages import Message
from epd.stages.raw_prompt import RawPrompt
from tests import reference
from tests.embedded import request_summary
from tests.families import FAMILIES, family_checkpoints
from tests.integration.gateway_http import post_embedded

PROMPT = "Once upon a time, in a land far away,"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models, tmp_path_factory.mktemp("completions_models"))


def raw_reference(model_dir) -> tuple[list[int], list[int]]:
    """`tests.reference.raw_reference` of PROMPT, MAX_TOKENS new tokens."""
    return reference.raw_reference(model_dir, PROMPT, MAX_TOKENS)


# -- the HTTP API over the embedded pipeline -----------------------------------------------------


def streamed(events: list[dict], field: str = "text") -> tuple[str, list[int], dict]:
    """A stream's (text, token ids, final choice): the choice that carries the finish reason."""
    choices = [e["choices"][0] for e in events if e["choices"]]
    text = "".join(c[field] if field == "text" else c["delta"].get("content", "") for c in choices)
    final = next(c for c in choices if c["finish_reason"])
    return text, [t for c in choices for t in c.get("token_ids") or []], final


@pytest.mark.parametrize("family", FAMILIES)
def test_a_raw_prompt_equals_generate_in_every_family_plain_and_streamed(checkpoints, family):
    path = checkpoints[family]
    ids, want = raw_reference(path)
    assert len(set(want)) > 2, "the tiny model repeats one token; the comparison would prove little"
    body = {"model": "epd", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "return_token_ids": True}
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        (status, plain), (stream_status, events) = post_embedded(
            pipeline,
            ("/v1/completions", body),
            ("/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}),
        )
        # The prompt's token ids, as a client that tokenised it sends them: the same answer.
        by_ids = asyncio.run(
            request_summary(
                pipeline,
                AskRequest(
                    [],
                    generation=GenerationConfig(max_new_tokens=MAX_TOKENS),
                    raw_prompt=RawPrompt(token_ids=tuple(ids)),
                ),
            )
        )
    assert status == 200 and stream_status == 200
    choice = plain["choices"][0]
    assert plain["object"] == "text_completion" and plain["id"].startswith("cmpl-")
    assert choice["token_ids"] == want, family
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert plain["usage"]["prompt_tokens"] == len(ids) and plain["usage"]["completion_tokens"] == MAX_TOKENS
    # not run: 0 ms
    assert plain["epd"]["num_visual_tokens"] == 0 and plain["epd"]["timings_ms"]["encode"] == 0.0
    text, token_ids, final = streamed(events)
    assert all(e["object"] == "text_completion" for e in events)
    assert token_ids == want and text == choice["text"]
    assert final["finish_reason"] == "length" and final["stop_reason"] is None
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert by_ids.token_ids == want and by_ids.num_prompt_tokens == len(ids)


def test_stop_reason_names_the_stop_string_or_token_on_chat_and_completions(checkpoints):
    """On the embedded pipeline's HTTP API, plain and streamed (the stack's below)."""
    path = checkpoints["qwen2_vl"]
    ids, want = raw_reference(path)
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        ((_, plain),) = post_embedded(
            pipeline, ("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS})
        )
        stop_text = plain["choices"][0]["text"][3:6]
        stop_token = want[4]
        completions = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "return_token_ids": True}
        chat = {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": MAX_TOKENS,
            "return_token_ids": True,
        }
        ((_, chat_plain),) = post_embedded(pipeline, ("/v1/chat/completions", chat))
        chat_stop = chat_plain["choices"][0]["token_ids"][2]
        answers = post_embedded(
            pipeline,
            ("/v1/completions", {**completions, "stop": ["never here", stop_text]}),
            ("/v1/completions", {**completions, "stop": [stop_text], "stream": True}),
            ("/v1/completions", {**completions, "stop_token_ids": [stop_token]}),
            ("/v1/completions", {**completions, "stop_token_ids": [stop_token], "stream": True}),
            ("/v1/chat/completions", {**chat, "stop_token_ids": [chat_stop]}),
            ("/v1/chat/completions", {**chat, "stop_token_ids": [chat_stop], "stream": True}),
            ("/v1/chat/completions", chat | {"stream": True}),
        )
    by_string, by_string_sse, by_token, by_token_sse, chat_token, chat_token_sse, chat_length_sse = (
        a for _, a in answers
    )
    assert (
        by_string["choices"][0]["stop_reason"] == stop_text
        and by_string["choices"][0]["finish_reason"] == "stop"
    )
    assert by_string["epd"]["stop_reason"] == stop_text
    assert streamed(by_string_sse)[2]["stop_reason"] == stop_text
    assert by_token["choices"][0]["stop_reason"] == stop_token
    assert by_token["choices"][0]["token_ids"] == want[: want.index(stop_token) + 1]
    assert streamed(by_token_sse)[2]["stop_reason"] == stop_token
    assert (
        chat_token["choices"][0]["stop_reason"] == chat_stop
        and chat_token["choices"][0]["finish_reason"] == "stop"
    )
    assert streamed(chat_token_sse, "delta")[2]["stop_reason"] == chat_stop
    assert chat_plain["choices"][0]["stop_reason"] is None
    assert streamed(chat_length_sse, "delta")[2]["stop_reason"] is None


def test_an_answer_the_models_other_end_of_sequence_token_ends_has_its_id_for_stop_reason(checkpoints):
    """GLM-4.1V's generation config ends an answer at <|endoftext|> (its tokenizer's end of
    sequence), <|user|> or <|observation|>. vLLM adds the config's others to the request's
    stop_token_ids: an answer <|user|> ends has its id for stop_reason (it was null, as for the
    tokenizer's own, which check_stop tests first), and ignore_eos lets both through."""
    path = checkpoints["glm4v"]
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    eos, user = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|user|>")
    assert tokenizer.convert_ids_to_tokens(eos) == "<|endoftext|>" and user != eos
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "return_token_ids": True}
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        answers = post_embedded(
            pipeline,
            ("/v1/chat/completions", {**chat, "allowed_token_ids": [user]}),
            ("/v1/chat/completions", {**chat, "allowed_token_ids": [user], "stream": True}),
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "allowed_token_ids": [user]}),
            ("/v1/chat/completions", {**chat, "allowed_token_ids": [eos]}),
            ("/v1/chat/completions", {**chat, "allowed_token_ids": [user], "ignore_eos": True}),
        )
    by_user, by_user_sse, completion, by_eos, ignored = (a for _, a in answers)
    for choice in (by_user["choices"][0], streamed(by_user_sse, "delta")[2], completion["choices"][0]):
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", user)
    assert by_user["choices"][0]["token_ids"] == [user] and by_user["epd"]["stop_reason"] == user
    assert (by_eos["choices"][0]["finish_reason"], by_eos["choices"][0]["stop_reason"]) == ("stop", None)
    assert ignored["choices"][0]["token_ids"] == [user] * 3
    assert (ignored["choices"][0]["finish_reason"], ignored["choices"][0]["stop_reason"]) == ("length", None)


def test_echo_and_what_prefill_refuses(checkpoints):
    path = checkpoints["qwen2_vl"]
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        body = {"prompt": PROMPT, "max_tokens": 4}
        answers = post_embedded(
            pipeline,
            ("/v1/completions", body),
            ("/v1/completions", {**body, "echo": True}),
            ("/v1/completions", {**body, "echo": True, "stream": True}),
            ("/v1/completions", {**body, "prompt": "look: <|video_pad|>"}),
            ("/v1/completions", {**body, "prompt": [1, 2, 10**6]}),
            ("/v1/completions", {**body, "prompt": [1, 2, 10**6], "echo": True}),  # before its Detokenize
        )
        (
            (_, plain),
            (_, echoed),
            (_, echoed_sse),
            (placeholder, refused),
            (too_big, vocab),
            (echo_too_big, echo_vocab),
        ) = answers
        # Prefill's own rules, for a caller other than the gateway (its PrefillService).
        engine = pipeline.prefill.engine
        with pytest.raises(InvalidRequest, match="send a conversation .messages. or a raw prompt, not both"):
            engine.render([Message.user("hi")], None, GenerationConfig(), raw_prompt=RawPrompt(PROMPT))
        with pytest.raises(InvalidRequest, match="the prompt is text or token ids, not both"):
            engine.render([], None, GenerationConfig(), raw_prompt=RawPrompt(PROMPT, (1, 2)))
    assert echoed["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    assert streamed(echoed_sse)[0] == PROMPT + plain["choices"][0]["text"]
    assert (
        placeholder == 400
        and "the prompt holds the model's visual placeholder token" in refused["error"]["message"]
    )
    assert too_big == 400 and "are not token ids of this model" in vocab["error"]["message"]
    assert (
        echo_too_big == 400
        and "the prompt's token ids [1000000] are not token ids of this model"
        in (echo_vocab["error"]["message"])
    )


def test_a_raw_prompt_keeps_prefix_cache_entries_of_its_own(checkpoints):
    """A raw prompt reuses the KV of an earlier raw prompt it extends, and never a chat prompt's,
    even one whose rendered text it spells exactly (its key: `(model, "raw prompt", kv_dtype, salt)`)."""
    path = checkpoints["qwen2_vl"]
    _, processor = whole_model(path)
    conversation = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    rendered = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)

    def ask(pipeline, raw: RawPrompt | None = None):
        messages = [] if raw else [Message.user(PROMPT)]
        request = AskRequest(messages, generation=GenerationConfig(max_new_tokens=4), raw_prompt=raw)
        return asyncio.run(request_summary(pipeline, request))

    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        prefix_cache = pipeline.prefill.engine.prefix_cache
        chat = ask(pipeline)
        spelled = ask(pipeline, RawPrompt(rendered))
        assert spelled.num_prompt_tokens == chat.num_prompt_tokens  # the same token ids...
        # ...not reused
        assert spelled.num_reused_prompt_tokens == 0 and prefix_cache.stats().num_entries == 2
        longer = ask(pipeline, RawPrompt(rendered + " and then"))
        assert 0 < longer.num_reused_prompt_tokens <= spelled.num_prompt_tokens


# -- the real stack: HTTP (openai client), gRPC and the SDK --------------------------------------


def test_completions_through_the_stack_plain_streamed_and_over_grpc(shared_stack, tiny_models):
    ids, want = raw_reference(tiny_models["qwen2_vl"])
    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{shared_stack.http_port}/v1", api_key="none", max_retries=0
    )
    ids_asked = {"return_token_ids": True}
    plain = http.completions.create(model="epd", prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body=ids_asked)
    choice = plain.choices[0]
    assert choice.model_extra["token_ids"] == want and choice.finish_reason == "length"
    assert choice.model_extra["stop_reason"] is None
    assert plain.usage is not None and plain.usage.prompt_tokens == len(ids)
    chunks = list(
        http.completions.create(
            model="epd",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=ids_asked,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []] == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
    by_ids = http.completions.create(model="epd", prompt=ids, max_tokens=MAX_TOKENS, extra_body=ids_asked)
    assert by_ids.choices[0].model_extra["token_ids"] == want

    stop_text = choice.text[3:6]
    stopped = http.completions.create(model="epd", prompt=PROMPT, max_tokens=MAX_TOKENS, stop=[stop_text])
    assert stopped.choices[0].model_extra["stop_reason"] == stop_text
    assert stopped.choices[0].text == choice.text[: choice.text.index(stop_text)]
    final = [
        c
        for c in http.completions.create(
            model="epd",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_body={"stop_token_ids": [want[4]]},
        )
        if c.choices and c.choices[0].finish_reason
    ]
    assert final[0].choices[0].model_extra["stop_reason"] == want[4]
    reply = http.chat.completions.create(
        model="epd",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        extra_body=ids_asked,
    )
    chat_stop = reply.choices[0].model_extra["token_ids"][2]
    chat = [
        c
        for c in http.chat.completions.create(
            model="epd",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_body={"stop_token_ids": [chat_stop]},
        )
        if c.choices and c.choices[0].finish_reason
    ]
    assert chat[0].choices[0].model_extra["stop_reason"] == chat_stop
    with pytest.raises(openai.BadRequestError, match="holds 2 prompts; epd answers one prompt per request"):
        http.completions.create(model="epd", prompt=["a", "b"], max_tokens=2)

    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        result = client.ask(None, prompt=PROMPT, max_new_tokens=MAX_TOKENS)
        assert (
            result.token_ids == want and result.num_prompt_tokens == len(ids) and result.stop_reason is None
        )
        assert client.ask(None, prompt=ids, max_new_tokens=MAX_TOKENS).token_ids == want
        assert (
            client.ask(None, prompt=PROMPT, max_new_tokens=MAX_TOKENS, stop=stop_text).stop_reason
            == stop_text
        )
        token = client.ask(None, prompt=PROMPT, max_new_tokens=MAX_TOKENS, stop_token_ids=[want[4]])
        assert token.stop_reason == want[4] and token.to_dict()["stop_reason"] == want[4]
        with pytest.raises(EpdError, match="a raw prompt .completions. takes no media") as info:
            client.ask(b"\x00" * 64, prompt=PROMPT)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_raw_http_completions_body_answers(shared_stack):
    """The smallest body a client sends: 200 with a text_completion."""
    body = json.dumps({"model": "epd", "prompt": "ping", "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{shared_stack.http_port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    assert answer["object"] == "text_completion" and answer["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )
    assert answer["usage"]["completion_tokens"] >= 1
    bad = urllib.request.Request(f"http://127.0.0.1:{shared_stack.http_port}/v1/completions", data=b"{}",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(bad, timeout=60)
    assert info.value.code == 400
