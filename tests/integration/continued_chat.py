"""A chat whose last assistant message is continued (vLLM's `continue_final_message` with
`add_generation_prompt: false`), shared by test_continue_final_message and test_chat_echo: a video
in an earlier user turn (`VIDEO_EARLIER`), its OpenAI form (`_openai`), and the body that asks the
stack to continue it, with generate()'s answer to compare (`continued_over_http`)."""

from __future__ import annotations

import base64

from tests.reference import decode_for_test, template_reference

MAX_NEW_TOKENS = 8
NUM_FRAMES = 4
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
CHAT = "/v1/chat/completions"

# The processor's chat form, ending with the assistant's partial answer.
VIDEO_EARLIER = [
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "a square"}]},
    {"role": "user", "content": [{"type": "text", "text": "which colour is it?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "It is"}]},
]


def _openai(messages: list[dict], url: str) -> list[dict]:
    return [
        {
            "role": m["role"],
            "content": [
                {"type": "video_url", "video_url": {"url": url}} if p["type"] == "video" else p
                for p in m["content"]
            ],
        }
        for m in messages
    ]


def continued_over_http(tiny_models, media_files) -> tuple[list[int], list[int], str, dict]:
    """VIDEO_EARLIER continued on tiny Qwen2-VL: (prompt ids, generate()'s new tokens, their text,
    the chat-completions body that asks for them)."""
    from transformers import AutoProcessor

    path = tiny_models["qwen2_vl"]
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    prompt_ids, want = template_reference(path, VIDEO_EARLIER, MAX_NEW_TOKENS, video, **CONTINUE)
    text = AutoProcessor.from_pretrained(str(path)).tokenizer.decode(want, skip_special_tokens=True)
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    body = {
        "model": "epd",
        "messages": _openai(VIDEO_EARLIER, url),
        "max_tokens": MAX_NEW_TOKENS,
        "media": {"num_frames": NUM_FRAMES},
        **CONTINUE,
    }
    return prompt_ids, want, text, body
