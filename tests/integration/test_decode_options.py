"""vLLM's `skip_special_tokens` and `spaces_between_special_tokens` (both default true): the answer's
text, streamed and whole, is `tokenizer.decode(ids, skip_special_tokens=...,
spaces_between_special_tokens=...)` of its own token ids, in one process and through the real
stack's HTTP (chat and legacy completions, plain and streamed) and gRPC (the SDK) doors.

To put special tokens in an answer of a random tiny model, a request biases two of them
(`<|vision_start|>` by +100, `<|vision_end|>` by +50) and sets a repetition penalty that takes
a token out of the running once it has been generated: the answer opens with those two
(the first from prefill's first token, the second from decode), then ordinary text."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from epd.client import EpdClient, EpdError
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import TokenStep
from epd.stages.messages import Message
from tests.local_http import post_json, sse_chunks

MAX_NEW_TOKENS = 10
SPECIALS = ("<|vision_start|>", "<|vision_end|>")
OPTIONS = list(itertools.product((True, False), (True, False)))  # (skip_special_tokens, spaces_between)


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_models["qwen2_vl"])).tokenizer


def _biased(tokenizer) -> dict:
    first, second = tokenizer.convert_tokens_to_ids(list(SPECIALS))
    return {"logit_bias": {first: 100.0, second: 50.0}, "repetition_penalty": 1000.0, "ignore_eos": True}


def _check(tokenizer, ids: list[int], text: str, skip: bool, spaces: bool, label: str) -> None:
    assert ids[:2] == tokenizer.convert_tokens_to_ids(list(SPECIALS)), label
    want = tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert text == want, label
    assert (SPECIALS[0] in text) == (not skip), label


async def _stream(pipeline, request: AskRequest) -> tuple[str, AskSummary]:
    deltas = []
    async for item in pipeline.ask(request):
        if isinstance(item, TokenStep):
            deltas.append(item.text)
        elif isinstance(item, AskSummary):
            return "".join(deltas), item
    raise RuntimeError("no summary")


def test_the_answers_text_is_the_tokenizers_decode_with_the_requests_options(tiny_models, tokenizer):
    """Streamed deltas and the summary's answer, for each pair of options; with
    skip_special_tokens false a stop string may match a special token's text (as vLLM's, whose
    stop strings are looked for in the detokenised text)."""
    biased = _biased(tokenizer)
    bias = tuple(sorted(biased["logit_bias"].items()))
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        for skip, spaces in OPTIONS:
            generation = GenerationConfig(
                max_new_tokens=MAX_NEW_TOKENS,
                logit_bias=bias,
                repetition_penalty=biased["repetition_penalty"],
                ignore_eos=True,
                skip_special_tokens=skip,
                spaces_between_special_tokens=spaces,
            )
            streamed, summary = asyncio.run(
                _stream(pipeline, AskRequest([Message.user("name a colour")], None, generation=generation))
            )
            label = f"skip_special_tokens={skip} spaces_between_special_tokens={spaces}"
            _check(tokenizer, summary.token_ids, summary.answer, skip, spaces, label)
            assert streamed == summary.answer, label
        stopped = GenerationConfig(
            max_new_tokens=MAX_NEW_TOKENS,
            logit_bias=bias,
            repetition_penalty=biased["repetition_penalty"],
            ignore_eos=True,
            skip_special_tokens=False,
            stop=(SPECIALS[1],),
        )
        summary = asyncio.run(
            _stream(pipeline, AskRequest([Message.user("name a colour")], None, generation=stopped))
        )[1]
        assert (summary.answer, summary.finish_reason, summary.stop_reason) == (
            SPECIALS[0],
            "stop",
            SPECIALS[1],
        )


def _sse_text(port: int, path: str, body: dict) -> str:
    chunks = sse_chunks(port, path, body)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    return "".join((c["delta"].get("content") or "") if "delta" in c else c.get("text", "") for c in choices)


def test_the_stack_decodes_with_the_requests_options_at_every_door(shared_stack, tokenizer):
    """Chat and legacy completions over HTTP (plain and SSE), and the SDK's ask over gRPC: the
    text is the tokenizer's decode of the answer's ids with the request's options; a value that
    is not true or false is a 400 / INVALID_ARGUMENT naming the field."""
    biased = _biased(tokenizer)
    port = shared_stack.http_port
    chat = {
        "model": "epd",
        "messages": [{"role": "user", "content": "name a colour"}],
        "max_tokens": MAX_NEW_TOKENS,
    }
    chat["logit_bias"] = {str(k): v for k, v in biased["logit_bias"].items()}
    chat.update(repetition_penalty=biased["repetition_penalty"], ignore_eos=True)
    completion = {k: v for k, v in chat.items() if k != "messages"} | {
        "prompt": "name a colour",
        "return_token_ids": True,
    }
    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        for skip, spaces in OPTIONS:
            label = f"skip_special_tokens={skip} spaces_between_special_tokens={spaces}"
            options = {"skip_special_tokens": skip, "spaces_between_special_tokens": spaces}
            status, reply = post_json(port, "/v1/chat/completions", {**chat, **options})
            assert status == 200, reply
            ids, text = reply["epd"]["token_ids"], reply["choices"][0]["message"]["content"]
            _check(tokenizer, ids, text, skip, spaces, label)
            assert _sse_text(port, "/v1/chat/completions", {**chat, **options}) == text, label
            status, reply = post_json(port, "/v1/completions", {**completion, **options})
            assert status == 200, reply
            choice = reply["choices"][0]
            _check(tokenizer, choice["token_ids"], choice["text"], skip, spaces, f"completions {label}")
            assert _sse_text(port, "/v1/completions", {**completion, **options}) == choice["text"], label
            result = client.ask(
                None,
                messages=[{"role": "user", "content": "name a colour"}],
                max_new_tokens=MAX_NEW_TOKENS,
                logit_bias=biased["logit_bias"],
                repetition_penalty=biased["repetition_penalty"],
                ignore_eos=True,
                **options,
            )
            _check(tokenizer, result.token_ids, result.answer, skip, spaces, f"gRPC {label}")
        status, reply = post_json(port, "/v1/chat/completions", {**chat, "skip_special_tokens": "sometimes"})
        assert status == 400 and "'skip_special_tokens' must be true or false" in reply["error"]["message"]
        with pytest.raises((TypeError, EpdError), match="skip_special_tokens") as refused:
            client.ask(None, messages=[{"role": "user", "content": "hi"}], skip_special_tokens="no")
        assert (
            not isinstance(refused.value, EpdError) or refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        )


def test_the_end_of_sequence_that_ends_an_answer_is_left_out_of_its_text(tiny_models, tokenizer):
    """With skip_special_tokens false, the end-of-sequence token that ends the answer is in its
    token ids but not in its text (vLLM's detokenizer leaves out the token that stopped the request
    unless include_stop_str_in_output), whether prefill's first token or a decoder's ends it; with
    include_stop_str_in_output its text is kept."""
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        for min_tokens, include in itertools.product((0, 2), (False, True)):
            generation = GenerationConfig(
                max_new_tokens=MAX_NEW_TOKENS,
                logit_bias=((eos, 100.0),),
                min_tokens=min_tokens,
                skip_special_tokens=False,
                include_stop_str_in_output=include,
            )
            streamed, summary = asyncio.run(
                _stream(pipeline, AskRequest([Message.user("name a colour")], None, generation=generation))
            )
            label = f"min_tokens={min_tokens} include_stop_str_in_output={include}"
            assert summary.token_ids[-1] == eos and len(summary.token_ids) == min_tokens + 1, label
            kept = summary.token_ids if include else summary.token_ids[:-1]
            assert summary.answer == tokenizer.decode(kept, skip_special_tokens=False), label
            assert summary.answer.endswith(tokenizer.eos_token) == include, label
            assert (summary.finish_reason, summary.stop_reason) == ("stop", None), label
            assert streamed == summary.answer, label
