"""Chat completions that continue an assistant message (vLLM's `continue_final_message` with
`add_generation_prompt: false`, "assistant prefill"), and an assistant message last with the
defaults (a new answer after it): the prompt is the processor's own
`apply_chat_template(messages, add_generation_prompt=..., continue_final_message=...)`, and the
answer's tokens equal `model.generate(do_sample=False)` on it, in every family in one process
(text alone and with a video in an earlier user turn, the prefix cache on), and through the real
stack's HTTP (plain and streamed) and gRPC doors. The answer is the continuation alone, as vLLM's."""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest

from epd.client import EpdClient, EpdError
from epd.gateway.ask_types import AskRequest
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput
from epd.stages.errors import InvalidRequest
from epd.stages.messages import ChatTemplateOptions, from_chat_template
from epd.stages.raw_prompt import RawPrompt
from epd.stages.tokenize import TokenizeInput
from epd.video.types import SamplingOptions
from tests.embedded import request_summary
from tests.families import FAMILIES, family_checkpoints
from tests.integration.continued_chat import (
    CHAT,
    CONTINUE,
    MAX_NEW_TOKENS,
    NUM_FRAMES,
    VIDEO_EARLIER,
    _openai,
    continued_over_http,
)
from tests.local_http import post_json, sse_chunks
from tests.reference import decode_for_test, template_reference
from tests.stack import Stack

# The processor's chat form, ending with the assistant's (partial) answer (as VIDEO_EARLIER does).
TEXT_ONLY = [
    {"role": "system", "content": [{"type": "text", "text": "answer briefly"}]},
    {"role": "user", "content": [{"type": "text", "text": "name a colour"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "The colour is"}]},
]


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models, tmp_path_factory.mktemp("continue_models"))


def _ask(pipeline, messages: list[dict], media: bytes | None, **template: bool):
    request = AskRequest(from_chat_template(messages), MediaInput(media) if media else None,
                         SamplingOptions(num_frames=NUM_FRAMES), GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
                         template=ChatTemplateOptions(**template))  # fmt: skip
    return asyncio.run(request_summary(pipeline, request))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_continues_the_assistants_message_or_answers_after_it_as_generate(
    checkpoints, media_files, family
):
    """Per conversation, first with the defaults (a new assistant turn after the last message),
    then continued: each equals generate() on the processor's own rendering (its prompt length
    too), and the continued prompt is the defaults' prompt's true token prefix up to the open
    message, whatever the prefix cache reused from the first (every answer is still exact)."""
    path = checkpoints[family]
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    data = media_files["mp4"].read_bytes()
    with build_embedded_pipeline(ModelConfig(model=str(path))) as pipeline:
        for name, messages, media in (("text", TEXT_ONLY, None), ("video", VIDEO_EARLIER, video)):
            prompts = []
            for template in ({}, CONTINUE):
                prompt_ids, want = template_reference(path, messages, MAX_NEW_TOKENS, media, **template)
                got = _ask(pipeline, messages, data if media is not None else None, **template)
                label = f"{name} {template or 'defaults'}"
                assert len(set(want)) > 2, (
                    f"{label}: the tiny model repeats one token; the comparison proves little"
                )
                assert got.token_ids == want, label
                assert got.num_prompt_tokens == len(prompt_ids), label
                prompts.append(prompt_ids)
            # The continued prompt is the defaults' up to the open message (its end of turn and
            # the new turn's opening cut): the prefix cache serves exactly that common prefix
            # (all but the one token prefill must compute), never past it.
            common = next((i for i, (a, b) in enumerate(zip(*prompts)) if a != b), min(map(len, prompts)))
            assert common == len(prompts[1]), name
            if family != "qwen3_5":  # its recurrent layers keep no prefix cache
                assert got.num_reused_prompt_tokens == common - 1, name
            if media is None:  # /tokenize counts the continued prompt as the chat route builds it
                tokenize = TokenizeInput(
                    messages=from_chat_template(messages), template=ChatTemplateOptions(**CONTINUE)
                )
                assert asyncio.run(pipeline.prefill.tokenize(tokenize, "t")).token_ids == prompt_ids
        with pytest.raises(InvalidRequest, match="a raw prompt has no template"):
            asyncio.run(
                request_summary(
                    pipeline,
                    AskRequest([], raw_prompt=RawPrompt("once"), template=ChatTemplateOptions(**CONTINUE)),
                )
            )


# -- through the real processes (tiny Qwen2-VL) ------------------------------------------------


def test_the_stack_continues_a_message_over_http_streamed_and_grpc(shared_stack, tiny_models, media_files):
    """HTTP (plain and SSE) and gRPC (the SDK's ask) continue the assistant's message with the
    video in an earlier user turn, as generate() does; the answer's text is the continuation
    alone. Both flags true, or continuing a user's message, are 400 / INVALID_ARGUMENT naming
    what to change, and the stack keeps serving."""
    prompt_ids, want, text, body = continued_over_http(tiny_models, media_files)
    url = body["messages"][0]["content"][0]["video_url"]["url"]
    port = shared_stack.http_port

    status, reply = post_json(port, CHAT, body)
    assert status == 200, reply
    assert reply["epd"]["token_ids"] == want and reply["usage"]["prompt_tokens"] == len(prompt_ids)
    assert reply["choices"][0]["message"]["content"] == text
    chunks = sse_chunks(port, CHAT, body)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text

    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        result = client.ask(media_files["mp4"], messages=VIDEO_EARLIER, num_frames=NUM_FRAMES,
                            max_new_tokens=MAX_NEW_TOKENS, **CONTINUE)  # fmt: skip
        assert result.token_ids == want and result.answer == text
        for options, match in (
            (
                {"continue_final_message": True},
                "add_generation_prompt and continue_final_message cannot both be true",
            ),
            (
                {"add_generation_prompt": False, "continue_final_message": True},
                "continue_final_message continues the last message, the assistant's, but the last "
                "message is the user's",
            ),
        ):
            messages = VIDEO_EARLIER if "cannot both" in match else VIDEO_EARLIER[:-1]
            with pytest.raises(EpdError, match=match) as info:
                client.ask(media_files["mp4"], messages=messages, num_frames=NUM_FRAMES, **options)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            status, reply = post_json(
                port,
                CHAT,
                {**body, "messages": _openai(messages, url), "add_generation_prompt": True, **options},
            )
            assert status == 400 and match in reply["error"]["message"], reply
        assert (
            client.ask(
                media_files["mp4"],
                messages=VIDEO_EARLIER,
                num_frames=NUM_FRAMES,
                max_new_tokens=MAX_NEW_TOKENS,
                **CONTINUE,
            ).token_ids
            == want
        )  # still serving


NO_USER_QUERY = "No user query found in messages."
USER_GUARD = (
    "{%- if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
    "{{- raise_exception('" + NO_USER_QUERY + "') }}{%- endif %}"
)
"""Qwen3.5's own chat template's guard (its `raise_exception` call, a jinja2 TemplateError): it
renders no conversation without a user message."""


def test_a_conversation_the_models_template_refuses_is_a_400_quoting_it(tiny_models, tmp_path):
    """An assistant's message may now come last, so a conversation may have no user message at
    all ([system, assistant] continued; /tokenize of any roles): a template that refuses that
    shape (Qwen3.5's) is the client's 400 / INVALID_ARGUMENT quoting the template, as vLLM's, not
    an internal error; the stack keeps serving."""
    model = tmp_path / "guarded"
    shutil.copytree(tiny_models["qwen2_vl"], model)
    template = model / "chat_template.jinja"
    template.write_text(USER_GUARD + template.read_text())
    no_user = [
        {"role": "system", "content": "answer briefly"},
        {"role": "assistant", "content": "The colour is"},
    ]
    said = f"the model's chat template cannot render this conversation: {NO_USER_QUERY}"
    with Stack(model, tmp_path / "logs", http=True) as stack:
        http_port = stack.http_port
        status, body = post_json(
            http_port,
            CHAT,
            {"model": "epd", "max_tokens": 2, "messages": no_user, **CONTINUE},
        )
        assert status == 400 and said in body["error"]["message"], body
        status, body = post_json(
            http_port, "/tokenize", {"messages": no_user, "add_generation_prompt": False}
        )
        assert status == 400 and said in body["error"]["message"], body
        with EpdClient(stack.gateway, timeout_s=120) as client:
            with pytest.raises(EpdError, match=said) as refused:
                client.ask(None, messages=no_user, max_new_tokens=2, **CONTINUE)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            served = client.ask(
                None,
                messages=[{"role": "user", "content": "name a colour"}, no_user[1]],
                max_new_tokens=2,
                **CONTINUE,
            )
        assert len(served.token_ids) == 2
