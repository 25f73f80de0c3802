"""vLLM's `return_token_ids`, its prompt half (`prompt_token_ids`), through the real stack (encoder,
prefill, decode and gateway in processes of their own): the gateway has no tokenizer, so prefill
sends the prompt's ids back when the request asks, and they are the model tokenizer's ids of the
rendered prompt (the processor's `apply_chat_template`, as /tokenize counts them; a raw prompt's
`tokenizer(prompt)`), a video's placeholders expanded as the model ran them. Placed as vLLM places
them: chat's at the answer's top (a stream's role chunk), a completion's in its choice (a stream's
first chunk); null when not asked. The gRPC door (the SDK's `return_prompt_token_ids`) too."""

from __future__ import annotations

import base64

from transformers import AutoConfig

from epd.client import EpdClient, Message
from tests.local_http import post_json, sse_chunks
from tests.reference import raw_reference, template_reference

QUESTION = "what colour is the moving square?"
PROMPT = "Once upon a time, in a land far away,"
MAX_TOKENS = 3
CHAT = [{"role": "user", "content": QUESTION}]


def test_the_prompts_ids_are_the_tokenizers_plain_streamed_and_over_grpc(shared_stack, tiny_models):
    model = tiny_models["qwen2_vl"]
    chat_ids, _ = template_reference(model, CHAT, 1)
    raw_ids, _ = raw_reference(model, PROMPT, 1)
    port = shared_stack.http_port
    status, counted = post_json(port, "/tokenize", {"model": "epd", "messages": CHAT})
    assert status == 200 and counted["tokens"] == chat_ids, counted

    chat = {"model": "epd", "messages": CHAT, "max_tokens": MAX_TOKENS, "return_token_ids": True}
    status, plain = post_json(port, "/v1/chat/completions", chat)
    assert status == 200, plain
    assert plain["prompt_token_ids"] == chat_ids and plain["usage"]["prompt_tokens"] == len(chat_ids)
    assert plain["choices"][0]["token_ids"] == plain["epd"]["token_ids"]
    chunks = sse_chunks(port, "/v1/chat/completions", chat)
    assert (
        chunks[0]["prompt_token_ids"] == chat_ids and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    )
    assert not [c for c in chunks[1:] if "prompt_token_ids" in c]
    status, unasked = post_json(port, "/v1/chat/completions", {**chat, "return_token_ids": False})
    assert (
        status == 200 and unasked["prompt_token_ids"] is None and unasked["choices"][0]["token_ids"] is None
    )

    completion = {"model": "epd", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "return_token_ids": True}
    status, plain = post_json(port, "/v1/completions", completion)
    assert status == 200 and plain["choices"][0]["prompt_token_ids"] == raw_ids, plain
    chunks = sse_chunks(port, "/v1/completions", completion)
    ids = [c["choices"][0]["prompt_token_ids"] for c in chunks if c["choices"]]
    assert ids == [raw_ids] + [None] * (len(ids) - 1)
    # with echo: on the echo's chunk, the choice's first
    echoed = sse_chunks(port, "/v1/completions", {**completion, "echo": True})
    assert (
        echoed[0]["choices"][0]["text"] == PROMPT and echoed[0]["choices"][0]["prompt_token_ids"] == raw_ids
    )
    status, unasked = post_json(port, "/v1/completions", {**completion, "return_token_ids": False})
    assert status == 200 and unasked["choices"][0]["prompt_token_ids"] is None

    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        asked = client.ask(None, messages=[Message.user(QUESTION)], max_new_tokens=MAX_TOKENS,
                           return_prompt_token_ids=True)  # fmt: skip
        assert asked.prompt_token_ids == chat_ids and asked.to_dict()["prompt_token_ids"] == chat_ids
        assert client.ask(None, prompt=PROMPT, max_new_tokens=1).prompt_token_ids is None


def test_a_videos_prompt_ids_hold_its_placeholders_as_the_model_ran_them(
    shared_stack, tiny_models, media_files
):
    """The prompt's ids are its visual tokens' placeholders expanded (one per visual token), as
    vLLM's; their number is the usage's prompt tokens."""
    video_url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    content = [{"type": "video_url", "video_url": {"url": video_url}}, {"type": "text", "text": QUESTION}]
    body = {
        "model": "epd",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "media": {"num_frames": 4},
        "return_token_ids": True,
    }
    status, answer = post_json(shared_stack.http_port, "/v1/chat/completions", body)
    assert status == 200, answer
    ids = answer["prompt_token_ids"]
    video_pad = AutoConfig.from_pretrained(tiny_models["qwen2_vl"]).video_token_id
    assert len(ids) == answer["usage"]["prompt_tokens"]
    assert ids.count(video_pad) == answer["epd"]["num_visual_tokens"] > 0
