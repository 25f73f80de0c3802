"""vLLM's `echo` on chat completions through the real stack's HTTP door (tiny Qwen2-VL, every
stage its own process): with `continue_final_message` the answer is the whole assistant message,
the given start then the continuation, whose tokens equal `model.generate(do_sample=False)` on the
processor's own rendering; streamed, the given start is a chunk of its own after the role's, as
vLLM streams it; usage counts the generated tokens alone. Without a generation prompt the user's
message is echoed (the answer's role is the user's), with the default one nothing is, and a video
in the echoed message is a 400. (Echo is HTTP's alone: tests/unit/gateway/test_chat_echo.py.)"""

from __future__ import annotations

import base64

from epd.gateway.chat_answer import UNSET_MESSAGE_FIELDS
from tests.integration.continued_chat import CHAT, VIDEO_EARLIER, continued_over_http
from tests.local_http import post_json, sse_chunks

GIVEN = VIDEO_EARLIER[-1]["content"][0]["text"]  # "It is": the assistant's start, continued


def _content(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_echo_gives_back_the_whole_continued_message_plain_and_streamed(
    shared_stack, tiny_models, media_files
):
    prompt_ids, want, text, body = continued_over_http(tiny_models, media_files)
    assert text and not text.startswith(GIVEN)  # the echo is what puts the start in front
    body["echo"] = True
    body["return_token_ids"] = True
    port = shared_stack.http_port

    status, reply = post_json(port, CHAT, body)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["message"] == {
        "role": "assistant", "content": GIVEN + text, **UNSET_MESSAGE_FIELDS, "reasoning": None, "reasoning_content": None
    }  # fmt: skip
    assert choice["token_ids"] == want and reply["epd"]["token_ids"] == want
    assert reply["usage"]["completion_tokens"] == len(want)
    assert reply["usage"]["prompt_tokens"] == len(prompt_ids)

    chunks = sse_chunks(
        port, CHAT, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    )
    role, echoed = chunks[0]["choices"][0], chunks[1]["choices"][0]
    assert role["delta"] == {"role": "assistant", "content": ""}
    # The given start in a chunk of its own, made by no generated token (vLLM's usage there: 0 tokens).
    assert echoed["delta"] == {"content": GIVEN} and "token_ids" not in echoed
    assert chunks[1]["usage"]["completion_tokens"] == 0
    assert _content(chunks) == GIVEN + text
    assert [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []] == want
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(want)


def test_echo_follows_the_answers_role_and_refuses_a_video_it_would_echo(shared_stack, media_files):
    """Without a generation prompt the answer's role is the user's and the user's text comes back
    first; with the default generation prompt after the user's message nothing is echoed; a video
    in the echoed message is a 400 saying what to change, and the stack keeps serving."""
    port = shared_stack.http_port
    question = "name a colour"
    base = {"model": "epd", "max_tokens": 4, "messages": [{"role": "user", "content": question}]}
    answers = {}
    for name, extra in (
        ("plain", {"add_generation_prompt": False}),
        ("echoed", {"add_generation_prompt": False, "echo": True}),
        ("defaults", {}),
        ("defaults echoed", {"echo": True}),
    ):
        status, reply = post_json(port, CHAT, {**base, **extra})
        assert status == 200, (name, reply)
        answers[name] = reply["choices"][0]["message"]
    assert answers["plain"]["role"] == answers["echoed"]["role"] == "user"
    assert answers["echoed"]["content"] == question + answers["plain"]["content"]
    assert answers["defaults echoed"] == answers["defaults"] and answers["defaults"]["role"] == "assistant"
    chunks = sse_chunks(port, CHAT, {**base, "add_generation_prompt": False, "echo": True})
    assert _content(chunks) == question + answers["plain"]["content"]

    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    video_part = {"type": "video_url", "video_url": {"url": url}}
    with_video = [{"role": "user", "content": [video_part, {"type": "text", "text": question}]}]
    status, reply = post_json(
        port, CHAT, {**base, "messages": with_video, "add_generation_prompt": False, "echo": True}
    )
    message = reply["error"]["message"]
    assert status == 400 and "the last message holds a video, which has no text to echo" in message, reply
    assert "leave 'echo' unset or false" in message
    status, reply = post_json(port, CHAT, {**base, "add_generation_prompt": False, "echo": True})
    assert status == 200 and reply["choices"][0]["message"] == answers["echoed"]  # still serving
