"""`--reasoning-parser qwen3` through the real stack (four processes on loopback) serving the tiny
Qwen3.5, whose template opens a thinking block in the prompt: a chat answer that holds `</think>`
(forced by `allowed_token_ids`, a `</think>` among two ordinary tokens) comes back with the text
before it in `reasoning` / `reasoning_content` and the text after in `content`, each equal to the
tokenizer's decode of its own tokens, plain and streamed; `include_reasoning: false` leaves the
reasoning out, `enable_thinking: false` and a cut inside the block part it as vLLM does, usage counts
every token and, as vLLM's, the reasoning's in `completion_tokens_details` by token id (prefill
reports the markers' ids: a stop string that makes decode send `</think>`'s text late counts the
same, over the stack and the embedded pipeline alike), and legacy completions
and a stack without the flag answer the text whole. Over the tiny
Qwen2-VL, whose tokenizer has no think markers, the flag gets every chat request refused with a 500
naming the flag and the model (vLLM refuses to start such a parser), where it made every answer all
reasoning with a null content. A structured output waits for the end of the reasoning. The
Responses API (`/v1/responses`) parts the same answer into a reasoning item and a message item."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from transformers import AutoTokenizer

from epd.gateway.chat_answer import UNSET_MESSAGE_FIELDS
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
from tests.integration.gateway_http import _model_card, post_embedded
from tests.local_http import post_json, sse_chunks
from tests.stack import Stack, gateway_over

MAX_TOKENS = 12
TEXT_ONLY = [{"role": "user", "content": "name a colour"}]


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("reasoning") / "qwen3_5", TinyVLMSpec(family="qwen3_5"))


def _body(**fields) -> dict:
    return {"model": "epd", "messages": TEXT_ONLY, "max_tokens": MAX_TOKENS, **fields}


def _chat(port: int, body: dict) -> dict:
    status, reply = post_json(port, "/v1/chat/completions", body)
    assert status == 200, reply
    return reply


def _stream(port: int, body: dict) -> list[dict]:
    return sse_chunks(port, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})


def _joined(chunks: list[dict], name: str, index: int = 0) -> str | None:
    """One field of choice `index`'s deltas joined (its role chunk's empty content aside); None: no
    delta had it but null (`include_reasoning` false writes `"reasoning": null`, as vLLM's)."""
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
    parts = [delta[name] for delta in deltas[1:] if delta.get(name) is not None]
    return "".join(parts) if parts else None


def _thinking_answer(chat: Callable[[dict], dict], end_id: int) -> tuple[list[int], list[int]]:
    """(allowed ids, the answer's ids) of the first pair of ordinary tokens whose greedy answer
    (`chat`'s, a body to its reply), with `</think>` allowed beside them, holds it after a token of
    reasoning and before one of content (the tiny model is random: which pair does is found, not
    assumed)."""
    for first in range(40, 300, 7):
        allowed = [first, first + 1, end_id]
        ids = chat(_body(allowed_token_ids=allowed))["epd"]["token_ids"]
        if end_id in ids and 0 < ids.index(end_id) < len(ids) - 1:
            return allowed, ids
    raise AssertionError("no pair of tokens made an answer with </think> inside it")


def test_the_stack_parts_a_thinking_answer_into_reasoning_and_content(qwen3_5, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_5))
    end_id = tokenizer.convert_tokens_to_ids("</think>")

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    # One set of stages, two gateways: with the parser, then without it (the flag is the gateway's).
    with Stack(qwen3_5, tmp_path / "stages") as stages:
        _parted_then_whole(stages, tmp_path, decode, end_id)


def _parted_then_whole(stages, tmp_path, decode, end_id: int) -> None:
    with gateway_over(stages, tmp_path / "logs", ["--reasoning-parser", "qwen3"], http=True) as stack:
        port = stack.http_port
        allowed, ids = _thinking_answer(lambda body: _chat(port, body), end_id)
        end = ids.index(end_id)
        reasoning, content = decode(ids[:end]), decode(ids[end + 1 :])
        assert reasoning and content

        reply = _chat(port, _body(allowed_token_ids=allowed))
        message = reply["choices"][0]["message"]
        assert (message["reasoning"], message["reasoning_content"], message["content"]) == (
            reasoning,
            reasoning,
            content,
        )
        assert reply["usage"]["completion_tokens"] == len(ids)  # the reasoning's tokens count too
        # vLLM's chat usage with a reasoning parser: those before </think>'s (the marker left out).
        assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": end}

        chunks = _stream(port, _body(allowed_token_ids=allowed, return_token_ids=True))
        assert (_joined(chunks, "reasoning"), _joined(chunks, "reasoning_content")) == (reasoning, reasoning)
        assert _joined(chunks, "content") == content
        assert [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []] == ids
        assert chunks[-1]["usage"]["completion_tokens"] == len(ids)
        assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": end}
        # No delta has content before the one with </think>'s token, nor reasoning after it.
        deltas = [
            (c["choices"][0]["delta"], c["choices"][0].get("token_ids") or [])
            for c in chunks[1:]
            if c["choices"]
        ]
        ended = next(i for i, (_, t) in enumerate(deltas) if end_id in t)
        assert not any("content" in d for d, _ in deltas[:ended])
        assert not any("reasoning" in d for d, _ in deltas[ended + 1 :])

        # The Responses API: a reasoning item, then the message; streamed as vLLM's reasoning events.
        responses = {"model": "epd", "input": "name a colour", "max_output_tokens": MAX_TOKENS,
                     "allowed_token_ids": allowed}  # fmt: skip
        status, response = post_json(port, "/v1/responses", responses)
        assert status == 200, response
        assert [(i["type"], i["content"][0]["text"]) for i in response["output"]] == [
            ("reasoning", reasoning),
            ("message", content),
        ]
        events = sse_chunks(port, "/v1/responses", responses)
        assert (
            "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == reasoning
        )
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == content
        assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]
        # The reasoning's tokens, those before </think>'s (vLLM's count leaves the markers out),
        # whole and streamed.
        for usage in (response["usage"], events[-1]["response"]["usage"]):
            assert (usage["output_tokens"], usage["output_tokens_details"]) == (
                len(ids),
                {"reasoning_tokens": end},
            )

        # Logprobs: the message's text carries its own tokens', chat's for the same tokens (those
        # after </think>'s). A stop string that begins with "</think>" (never met) makes decode hold
        # the marker's text back and send it with the next token's: a step that begins inside the
        # block and ends it, whose content token's logprob was dropped with the reasoning's.
        chat_logprobs = _chat(port, _body(allowed_token_ids=allowed, logprobs=True))["choices"][0]["logprobs"]
        want = [{k: v for k, v in lp.items() if k != "bytes"} for lp in chat_logprobs["content"][end + 1 :]]
        for stop in ([], ["</think>@@"]):
            asked = {**responses, "include": ["message.output_text.logprobs"], "stop": stop}
            events = sse_chunks(port, "/v1/responses", asked)
            assert events[-1]["response"]["epd"]["token_ids"] == ids, stop
            deltas = [e for e in events if e["type"] == "response.output_text.delta"]
            assert "".join(e["delta"] for e in deltas) == content, stop
            assert [lp for e in deltas for lp in e["logprobs"]] == want, stop

        # The same stop string: decode sends "</think>" late, with the content token after it, so
        # where the text falls would count the marker's token and more; vLLM counts by token id,
        # the tokens before </think>'s, and so does the gateway with prefill's ids of the markers.
        held = _body(allowed_token_ids=allowed, stop=["</think>@@"])
        reply = _chat(port, held)
        assert (reply["epd"]["token_ids"], reply["usage"]["completion_tokens_details"]) == (
            ids,
            {"reasoning_tokens": end},
        )
        assert _stream(port, held)[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": end}
        held_response = {**responses, "stop": ["</think>@@"]}
        status, response = post_json(port, "/v1/responses", held_response)
        assert status == 200, response
        streamed = sse_chunks(port, "/v1/responses", held_response)[-1]["response"]
        for usage in (response["usage"], streamed["usage"]):
            assert usage["output_tokens_details"] == {"reasoning_tokens": end}

        # n choices: each parted on its own (greedy: the same answer twice), their reasoning
        # tokens summed (vLLM's), whole and streamed.
        chunks = _stream(port, _body(allowed_token_ids=allowed, n=2))
        for index in (0, 1):
            assert (_joined(chunks, "reasoning", index), _joined(chunks, "content", index)) == (
                reasoning,
                content,
            )
        assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * end}
        both = _chat(port, _body(allowed_token_ids=allowed, n=2))
        assert both["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * end}

        # include_reasoning false: the content alone, and no token's logprobs (vLLM hides them all:
        # their token text would show the reasoning), whole or streamed.
        left_out = _body(allowed_token_ids=allowed, include_reasoning=False, logprobs=True)
        hidden = _chat(port, left_out)["choices"][0]
        assert (hidden["message"]["reasoning"], hidden["message"]["content"], hidden["logprobs"]) == (
            None,
            content,
            None,
        )
        chunks = _stream(port, left_out)
        assert (_joined(chunks, "reasoning"), _joined(chunks, "content")) == (None, content)
        # vLLM's parser sets each kept delta's reasoning to None: null beside every content delta
        said = [c["choices"][0]["delta"] for c in chunks[1:] if c["choices"] and c["choices"][0]["delta"]]
        assert said and all("reasoning" in d and d["reasoning"] is None for d in said), said
        assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])  # content's too

        # Cut by max_tokens inside the block: all reasoning, content null.
        cut = _chat(port, _body(allowed_token_ids=allowed, max_tokens=end))["choices"][0]
        assert (cut["finish_reason"], cut["message"]["reasoning"], cut["message"]["content"]) == (
            "length",
            reasoning,
            None,
        )

        # enable_thinking false: the prompt closed the block, so the answer is all content.
        off = _body(allowed_token_ids=allowed, chat_template_kwargs={"enable_thinking": False})
        reply = _chat(port, off)
        message = reply["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (None, decode(reply["epd"]["token_ids"]))
        assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        chunks = _stream(port, off)
        assert (_joined(chunks, "reasoning"), _joined(chunks, "content")) == (None, message["content"])

        # A structured output's grammar waits for the model's </think> (vLLM's default): until then
        # the answer is the unconstrained one (tests/integration/test_structured_reasoning.py
        # follows it past the marker).
        free = _chat(port, _body())["epd"]["token_ids"]
        constrained = _chat(port, _body(structured_outputs={"choice": ["red", "blue"]}))["epd"]["token_ids"]
        thought = free.index(end_id) + 1 if end_id in free else len(free)
        assert constrained[:thought] == free[:thought]

        # Legacy completions are not parted (vLLM parts chat answers alone).
        status, completion = post_json(
            port,
            "/v1/completions",
            {
                "model": "epd",
                "prompt": "<think>\n",
                "max_tokens": 8,
                "allowed_token_ids": allowed,
            },  # fmt: skip
        )
        assert status == 200 and completion["choices"][0]["text"] == decode(completion["epd"]["token_ids"])

    with gateway_over(stages, tmp_path / "logs_off", ["--http-port", str(port)], http=True) as stack:
        port = stack.http_port
        reply = _chat(port, _body(allowed_token_ids=allowed))
        assert reply["epd"]["token_ids"] == ids
        assert reply["choices"][0]["message"] == {  # whole, vLLM's reasoning null
            "role": "assistant", "content": decode(ids), **UNSET_MESSAGE_FIELDS, "reasoning": None, "reasoning_content": None
        }  # fmt: skip
        assert "completion_tokens_details" not in reply["usage"]  # vLLM's: only with a parser
        chunks = _stream(port, _body(allowed_token_ids=allowed))
        assert _joined(chunks, "content") == decode(ids) and _joined(chunks, "reasoning") is None


def test_the_stack_refuses_chat_requests_when_the_models_tokenizer_has_no_think_markers(
    shared_stack, tmp_path
):
    logs = tmp_path / "logs"
    with gateway_over(shared_stack, logs, ["--reasoning-parser", "qwen3"], http=True) as stack:
        port = stack.http_port
        assert _model_card(port)["max_model_len"] is not None  # prefill's model info has arrived
        for body in (_body(), {**_body(), "stream": True}, _body()):
            status, reply = post_json(port, "/v1/chat/completions", body)
            assert status == 500, reply
            assert reply["error"]["type"] == "server_error"
            message = reply["error"]["message"]
            assert (
                "--reasoning-parser qwen3" in message and "(qwen2_vl) lacks <think> and </think>" in message
            )
        # Legacy completions are not parted: they go on working.
        status, reply = post_json(port, "/v1/completions", {"model": "epd", "prompt": "hi", "max_tokens": 2})
        assert status == 200, reply
    gateway_log = (logs / "gateway.log").read_text()
    assert gateway_log.count("refusing chat requests: --reasoning-parser qwen3") == 1  # once, not per request


def test_the_embedded_pipeline_counts_the_reasoning_tokens_by_id_as_the_stack(qwen3_5):
    """`epd serve --colocate`'s pipeline (no gRPC): its own prefill stage's model info gives the
    markers' ids, so an answer whose `</think>` text decode sends late (a stop string that begins
    with it) counts as vLLM's, the tokens before `</think>`'s, whole and streamed, chat and the
    Responses API."""
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_5))
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    config = GatewayConfig(http=HttpApiConfig(reasoning_parser="qwen3"))
    with build_embedded_pipeline(ModelConfig(model=str(qwen3_5))) as pipeline:

        def chat(body: dict) -> dict:
            ((status, reply),) = post_embedded(pipeline, ("/v1/chat/completions", body), config=config)
            assert status == 200, reply
            return reply

        allowed, ids = _thinking_answer(chat, end_id)
        end = ids.index(end_id)
        held = _body(allowed_token_ids=allowed, stop=["</think>@@"])
        response = {"model": "epd", "input": "name a colour", "max_output_tokens": MAX_TOKENS,
                    "allowed_token_ids": allowed, "stop": ["</think>@@"]}  # fmt: skip
        (_, whole), (_, chunks), (status, answer) = post_embedded(
            pipeline,
            ("/v1/chat/completions", held),
            ("/v1/chat/completions", {**held, "stream": True, "stream_options": {"include_usage": True}}),
            ("/v1/responses", response),
            config=config,
        )
        assert whole["epd"]["token_ids"] == ids
        assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": end}
        assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": end}
        assert status == 200, answer
        assert answer["usage"]["output_tokens_details"] == {"reasoning_tokens": end}
