"""OpenAI's chat `messages` -> the conversation (`epd.stages.messages`) and its media URL (no HTTP
in here). Roles system (or OpenAI's `developer`), user, assistant and tool; earlier turns are
history. A message's content is a string or a list of text, `video_url` and `image_url` parts,
kept in the client's order, as the model's chat template renders them; at most one media part
per request, in a user message (none: the conversation is text alone). An assistant's
`tool_calls` and a tool's `tool_call_id` are kept for the template. Chat completions, the
Responses API (through chat's body) and /tokenize read messages here."""

from __future__ import annotations

from typing import Any

from epd.gateway.json_fields import checked_text
from epd.stages.errors import InvalidRequest
from epd.stages.messages import ROLES, ContentPart, Message, tool_calls_from_chat
from epd.stages.messages import text as text_part


def parse_messages(messages: Any) -> tuple[list[Message], str, str]:
    """OpenAI messages -> (the conversation, the media URL, "video" | "image"). Roles system, user,
    assistant and tool; content a string or a list of text / video_url / image_url parts (or the
    other spellings vLLM reads: `_TEXT_PARTS`, input_image, a media part without "type"), kept in the
    client's order; at most one media part, in a user message (none: text alone, URL and kind ""),
    and the last message the user's, a tool's or the assistant's. An assistant's `tool_calls`
    (content null) and a tool's `tool_call_id` are kept for the template; the deprecated
    `function_call` is refused, not dropped."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    # OpenAI's newer name of the system role (its models take developer messages in its place).
    roles = [
        _ROLE_ALIASES.get(r, r) if isinstance(r := m.get("role") if isinstance(m, dict) else None, str) else r
        for m in messages
    ]
    if any(r not in ROLES for r in roles):
        shown = [r[:32] if isinstance(r, str) else None for r in roles[:8]]
        raise InvalidRequest(
            f"message roles must be {', '.join(ROLES)} (got roles {shown}{'...' if len(roles) > 8 else ''})"
        )
    out: list[Message] = []
    media: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if message.get(
            "function_call"
        ):  # the deprecated form of a turn's call: its content alone is not what was said
            raise InvalidRequest(
                f"messages[{i}] has 'function_call', OpenAI's deprecated form of a call; send it as "
                '\'tool_calls\': [{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}]'
            )
        tool_calls = tool_calls_from_chat(message.get("tool_calls"), i)
        for j, call in enumerate(tool_calls):  # text the wire can carry (no lone surrogate)
            for value, what in (
                (call.id, "id"),
                (call.name, "function.name"),
                (call.arguments, "function.arguments"),
            ):
                checked_text(value, f"messages[{i}].tool_calls[{j}].{what}")
        tool_call_id = message.get("tool_call_id") if roles[i] == "tool" else None
        if tool_call_id is not None and not isinstance(tool_call_id, str):
            raise InvalidRequest(
                f"messages[{i}].tool_call_id must be a string, the id of the call it answers"
            )
        content = message.get("content")
        if content is None and roles[i] == "assistant":  # OpenAI's own history: a turn of tool calls alone
            content = ""
        as_string = isinstance(content, str)  # a text's refusal names the content, or its part's text
        if as_string:
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or not content:
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a non-empty list of content parts"
            )
        parts: list[ContentPart] = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is None and isinstance(part, dict):  # vLLM's media part without "type"
                kind = next((key for key in ("video_url", "image_url") if key in part), None)
            if isinstance(kind, str) and (text_key := _TEXT_PARTS.get(kind)) is not None:
                if not isinstance(part.get(text_key), str):
                    raise InvalidRequest(
                        f"a {kind} part of messages[{i}] needs its text: {{'type': '{kind}', '{text_key}': '...'}}"
                    )
                name = f"messages[{i}].content" + ("" if as_string else f"[{k}].{text_key}")
                parts.append(text_part(checked_text(part[text_key], name)))
            elif kind in ("video_url", "image_url", "input_image"):
                if roles[i] != "user":
                    raise InvalidRequest(
                        f"messages[{i}] is a {roles[i]} message; put the {kind} part in a user message"
                    )
                # the Responses API's input_image holds its URL as image_url, as vLLM's chat reads it
                kind = "image_url" if kind == "input_image" else kind
                ref = part.get(kind)
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise InvalidRequest(f"a {kind} part needs {{'{kind}': {{'url': ...}}}}")
                if not url.startswith("data:"):  # a data: URL is checked as it is decoded (ASCII only)
                    checked_text(url, f"{kind}.url")
                media.append((url, kind.removesuffix("_url")))
                parts.append(ContentPart(kind.removesuffix("_url")))
            else:
                kind_text = (
                    kind[:64] if isinstance(kind, str) else kind if kind is None else type(kind).__name__
                )
                raise InvalidRequest(
                    f"unsupported content part {kind_text!r}; use 'text', 'video_url' or 'image_url'"
                )
        out.append(
            Message(str(roles[i]), tuple(parts), tool_calls, checked_text(tool_call_id, "tool_call_id"))
        )
    if len(media) > 1:
        raise InvalidRequest(
            f"the messages have {len(media)} video_url / image_url parts; at most one video or image per "
            "request is supported (the encoder encodes one media per request): send one"
        )
    if not media:  # a text-only conversation, as vLLM answers one on a vision-language model
        return out, "", ""
    return out, media[0][0], media[0][1]


_ROLE_ALIASES = {"developer": "system"}

_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
"""The text parts vLLM's chat reads (`_parse_chat_message_content_mm_part` in
vllm/entrypoints/chat_utils.py), by type: the field that holds the text. The Responses API's
input_text / output_text come from clients that build chat messages from Responses items, and an
assistant's refusal part from OpenAI's own history."""
