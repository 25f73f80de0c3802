"""The one message model of every door: a conversation is a list of `Message`s (role "system",
"user", "assistant" or "tool"), each a list of `ContentPart`s ("text", "video", "image") in the user's
order; an assistant's message may hold the tool calls it made (`ToolCall`), and a tool's message
answers one of them (`Message.tool_call_id`). Plain Python (no torch, no gRPC): the SDK builds it, the HTTP and gRPC doors parse into it,
`epd.transport.message_convert` carries it over the wire, and the prefill engine renders it with
the model's own chat template, exactly as `processor.apply_chat_template` renders
`to_chat_template(messages, modality)`.

    [Message.user(VIDEO, "what colour is the circle?")]                      # 0.1's question
    [Message.user("what happens here?", VIDEO, "answer in one word")]         # text around a video
    [Message.system("be brief"), Message.user(IMAGE, "what is it?"),
     Message.assistant("a circle"), Message.user("what colour?")]             # earlier turns
    [Message.user("weather in Paris?"),
     Message("assistant", (text(""),), (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
     Message("tool", (text("sunny"),), tool_call_id="call_1")]                # a tool's answer

A media part ("video" / "image") marks where the request's media goes; the media itself travels
beside the messages (uploaded bytes, a URL, a sha256). A request carries at most one media part
(the encoder encodes one media per request), or none: a text-only conversation ("hello", a
client's health ping, a title to generate) skips the encoder and is rendered as the template
renders text alone, as vLLM and SGLang answer it on a vision-language model. The media part's
placeholder takes the kind the encoder found in the bytes: a "video" part whose bytes are a PNG is
rendered as an image, as 0.1 did.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from epd.model_runtime.adapter import RenderOptions
from epd.stages.chat_template import check_request_chat_template
from epd.stages.errors import InvalidRequest
from epd.stages.template_kwargs import check_chat_template_kwargs
from epd.stages.tools import check_function_name, check_tools, parsed_arguments

ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "video", "image")
MEDIA_TYPES = ("video", "image")
MAX_PARTS = 2048
"""Content parts of a conversation in all (every message has one at least). The text limit
(prefill's 262,144 characters) let 100,000 one-character messages through, and rendering their
chat template cost prefill ~6 s of CPU before its prompt-token limit refused them."""


@dataclass(frozen=True)
class ContentPart:
    """A piece of a message: text, or the place of the request's video or image."""

    type: str
    """"text", "video" or "image"."""
    text: str = ""
    """The text of a "text" part (empty for media parts)."""

    @property
    def is_media(self) -> bool:
        return self.type in MEDIA_TYPES


VIDEO = ContentPart("video")
"""Where the request's video goes."""
IMAGE = ContentPart("image")
"""Where the request's image goes."""


def text(value: str) -> ContentPart:
    """A text part."""
    return ContentPart("text", value)


@dataclass(frozen=True)
class ToolCall:
    """A function call an assistant's message made (OpenAI's `tool_calls` item of type function)."""

    id: str
    """The call's id, which the tool's message answering it names (`Message.tool_call_id`)."""
    name: str
    """The function's name."""
    arguments: str
    """The arguments, a JSON object's text (as OpenAI's API carries them); rendered as the object
    (`to_chat_template`)."""


@dataclass(frozen=True)
class Message:
    """One turn of the conversation: its role and its content parts, in order."""

    role: str
    """"system", "user", "assistant" or "tool"."""
    parts: tuple[ContentPart, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant's message: the tool calls it made (its text, often empty, in `parts`)."""
    tool_call_id: str = ""
    """A tool's message: the id of the call whose result its content is."""

    @classmethod
    def user(cls, *parts: ContentPart | str) -> Message:
        """A user message; a str is a text part."""
        return cls("user", tuple(text(p) if isinstance(p, str) else p for p in parts))

    @classmethod
    def system(cls, content: str) -> Message:
        return cls("system", (text(content),))

    @classmethod
    def assistant(cls, content: str) -> Message:
        """An earlier answer, for multi-turn history."""
        return cls("assistant", (text(content),))


def question_messages(question: str, media: str = "video") -> list[Message]:
    """The 0.1 form, one question about one media: one user message [media, question] (what
    gRPC's `AskHeader.question` and the SDK's `ask(video, question)` mean). This form asks a
    question, so a blank one is refused (InvalidRequest); messages may hold the media alone."""
    if not question.strip():
        raise InvalidRequest("the question is empty; ask something about the video")
    return [Message.user(ContentPart(media), question)]


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How the chat template renders the conversation: vLLM's chat request fields of the same
    names, passed to `processor.apply_chat_template` as they are."""

    add_generation_prompt: bool = True
    """End with the template's opening of the assistant's answer: the model answers in a new
    assistant message (after the user's, or after an assistant's last message)."""
    continue_final_message: bool = False
    """Leave the last message (the assistant's) open, without the template's end of its turn: the
    model continues it ("assistant prefill"; the answer is the continuation alone, as vLLM's;
    the HTTP API's `echo` puts the given text in front). Not with `add_generation_prompt`."""
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Extra variables of the template (`{"enable_thinking": False}` for Qwen3 / Qwen3.5's), JSON
    values (`epd.stages.template_kwargs`); those the template does not read are dropped where it is
    rendered, as vLLM's. Empty: the template's own defaults."""
    chat_template: str | None = None
    """vLLM's request `chat_template`: a Jinja template that renders this request's prompt instead
    of the server's (`epd.stages.chat_template`); prefill refuses it unless started with
    --trust-request-chat-template. None: the server's template (its --chat-template, or the
    model's own)."""
    tools: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    """OpenAI's function tools (`epd.stages.tools`), the template's `tools` variable, as
    transformers' `apply_chat_template(..., tools=...)` passes them; a template that does not read
    it renders the conversation without them (as vLLM's). Empty: none."""

    def render_options(self, chat_template: str | None, requests_template: bool = False) -> RenderOptions:
        """What the model's adapter renders the prompt with (`RenderOptions`): the two flags, the
        variables the template renders with beyond the conversation (the request's
        `chat_template_kwargs` and, when given, its `tools`, both filtered where the template is
        rendered to those it reads), and `chat_template`, the template the server resolved for
        this request (the request's own, `requests_template`, else --chat-template; None: the
        model's own)."""
        variables = dict(self.chat_template_kwargs)
        if self.tools:
            variables["tools"] = [dict(tool) for tool in self.tools]
        return RenderOptions(
            self.add_generation_prompt,
            self.continue_final_message,
            variables,
            chat_template,
            requests_template,
        )

    def check(self, messages: Sequence[Message], to_answer: bool = True) -> None:
        """InvalidRequest unless these options can render `messages`: not both flags (vLLM's 400:
        the template cannot both open a new answer and leave the last message open), and, for a
        request `to_answer`, only the assistant's message continued (/tokenize, not to answer,
        leaves any last message open, as vLLM's does); and `chat_template_kwargs` variables epd
        passes on (`check_chat_template_kwargs`), a `chat_template` of bounded size
        (`check_request_chat_template`), and tools as `check_tools` takes them."""
        check_chat_template_kwargs(self.chat_template_kwargs)
        check_request_chat_template(self.chat_template)
        check_tools(self.tools)
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequest(
                "add_generation_prompt and continue_final_message cannot both be true: set add_generation_prompt "
                "to false to continue the last message, or continue_final_message to false to open a new answer"
            )
        if to_answer and self.continue_final_message and messages and messages[-1].role != "assistant":
            raise InvalidRequest(
                f"continue_final_message continues the last message, the assistant's, but the last message is the "
                f"{messages[-1].role}'s: end with the assistant's message to continue, or leave "
                "continue_final_message false"
            )


def _check_tool_fields(message: Message, i: int) -> None:
    """InvalidRequest unless `message`'s tool calls (an assistant's) and call id (a tool's) are
    where they belong and its calls' names and arguments are a function's."""
    if message.tool_calls and message.role != "assistant":
        raise InvalidRequest(
            f"messages[{i}] is a {message.role} message with tool calls; only an assistant's has them"
        )
    if message.tool_call_id and message.role != "tool":
        raise InvalidRequest(
            f"messages[{i}] is a {message.role} message with a tool_call_id; only a tool's message answers a call"
        )
    for j, call in enumerate(message.tool_calls):
        check_function_name(call.name, f"messages[{i}].tool_calls[{j}].function.name")
        parsed_arguments(call.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")


def num_text_chars(messages: Sequence[Message]) -> int:
    """The text the chat template may render: the text parts, the calls' ids and arguments, and the
    tool messages' call ids (the names are bounded on their own, `check_function_name`)."""
    return sum(
        sum(len(p.text) for p in m.parts)
        + len(m.tool_call_id)
        + sum(len(call.id) + len(call.arguments) for call in m.tool_calls)
        for m in messages
    )


def check_messages(
    messages: Sequence[Message],
    max_text_chars: int | None = None,
    to_answer: bool = True,
    template: ChatTemplateOptions = ChatTemplateOptions(),
) -> None:
    """Raise InvalidRequest, saying what to change, unless `messages` is a conversation epd can
    answer: known roles and part types, text only in text parts, at most one media part (in a
    user message; none: a text-only conversation), tool calls only in assistant messages (their
    arguments a JSON object's text) and call ids only in tool messages, the last message the
    user's, a tool's or the assistant's (which the answer follows, or with `template.continue_final_message` continues;
    any role unless `to_answer`: /tokenize renders any conversation, as vLLM's does), at most
    MAX_PARTS parts and `max_text_chars` of text. A message may be the media alone, with no text at all (as
    in vLLM and OpenAI's API: the model then answers the video as its chat template frames it; the
    text-guided prefill drop then scores the visual tokens by the template's own tokens after the
    video)."""
    if not messages:
        raise InvalidRequest(
            "the request has no messages; send a user message (with a video or image and a "
            "question, or text alone)"
        )
    if (num_parts := sum(len(m.parts) for m in messages)) > MAX_PARTS:
        raise InvalidRequest(
            f"the messages have {num_parts} content parts; the limit is {MAX_PARTS}: send a "
            "shorter conversation (or join its texts)"
        )
    media = 0
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidRequest(f"messages[{i}] has role {_shown(m.role)}; use one of {', '.join(ROLES)}")
        if not m.parts:
            raise InvalidRequest(f"messages[{i}] has no content; give it a text part")
        for j, p in enumerate(m.parts):
            if p.type not in PART_TYPES:
                raise InvalidRequest(
                    f"messages[{i}] part {j} has type {_shown(p.type)}; use one of {', '.join(PART_TYPES)}"
                )
            if p.is_media:
                if p.text:
                    raise InvalidRequest(f"messages[{i}] part {j} is a {p.type} part and cannot carry text")
                if m.role != "user":
                    raise InvalidRequest(
                        f"messages[{i}] is a {m.role} message with a {p.type} part; media go in user messages"
                    )
                media += 1
        _check_tool_fields(m, i)
    if media > 1:
        raise InvalidRequest(
            f"the messages have {media} video or image parts; at most one video or image per request is "
            "supported (the encoder encodes one media per request): send one"
        )
    if to_answer:
        if messages[-1].role not in ("user", "assistant", "tool"):
            raise InvalidRequest(
                f"the last message is the {messages[-1].role}'s; end with the user's message (the answer is "
                "generated as the assistant's next message), a tool's result, or an assistant's to continue"
            )
        template.check(messages)
    if max_text_chars is not None and (n := num_text_chars(messages)) > max_text_chars:
        raise InvalidRequest(
            f"the messages have {n} characters of text; the limit is {max_text_chars}: send a "
            "shorter conversation (or start a new one without the oldest turns)"
        )


def media_type(messages: Iterable[Message]) -> str:
    """The type of the (first) media part: "video" or "image"; "" when there is none."""
    return next((p.type for m in messages for p in m.parts if p.is_media), "")


def media_in_opening(messages: Iterable[Message]) -> bool:
    """Whether the media part is in the conversation's opening (every message up to and including
    the first user message), i.e. before any text-only turn. It decides where the prefill prefix
    cache can help (docs/architecture.md, "Prefix cache"): a conversation that opens with its media
    shares its prompt through the media with other conversations about it; one whose media comes
    in a later turn had text-only turns first, whose cached prompt covers the text before it."""
    for m in messages:
        if any(p.is_media for p in m.parts):
            return True
        if m.role == "user":
            return False
    return False


def to_chat_template(messages: Sequence[Message], modality: str) -> list[dict[str, Any]]:
    """The conversation in the form `processor.apply_chat_template` takes:
    [{"role": ..., "content": [{"type": "video"}, {"type": "text", "text": ...}, ...]}], each
    media part typed `modality`, the kind the encoder found in the media; an assistant's tool
    calls as transformers' chat form has them, {"tool_calls": [{"id", "type": "function",
    "function": {"name", "arguments": {...}}}]}, the arguments parsed into the object (as vLLM
    renders them), and a tool's message with its "tool_call_id"."""
    out = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {
            "role": m.role,
            "content": [
                {"type": modality} if p.is_media else {"type": "text", "text": p.text} for p in m.parts
            ],
        }
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": parsed_arguments(
                            call.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"
                        ),
                    },
                }
                for j, call in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def from_chat_template(conversation: Any) -> list[Message]:
    """The inverse of `to_chat_template`, for callers that hold the processor's form (or
    OpenAI's, without URLs): content a string, or parts {"type": "text", "text": ...},
    {"type": "video"}, {"type": "image"} (a "video_url" / "image_url" part counts as its media;
    the URL itself is ignored here). Raises InvalidRequest on anything else."""
    if not isinstance(conversation, list):
        raise InvalidRequest("messages must be a list of {'role': ..., 'content': ...} objects")
    out = []
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a 'role' string and 'content'")
        content = m.get("content")
        if content is None and m.get("tool_calls"):  # OpenAI's assistant turn of tool calls alone
            content = ""
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("text"), str):
                parts.append(text(p["text"]))
            elif kind in ("video", "image", "video_url", "image_url"):
                parts.append(ContentPart(kind.removesuffix("_url")))
            else:
                raise InvalidRequest(
                    f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': ...}}, "
                    "{'type': 'video'} or {'type': 'image'}"
                )
        tool_call_id = m.get("tool_call_id") or ""
        if not isinstance(tool_call_id, str):
            raise InvalidRequest(f"messages[{i}].tool_call_id must be a string")
        out.append(
            Message(m["role"], tuple(parts), tool_calls_from_chat(m.get("tool_calls"), i), tool_call_id)
        )
    return out


def tool_calls_from_chat(calls: Any, i: int) -> tuple[ToolCall, ...]:
    """OpenAI's (or transformers') `tool_calls` of message `i`: [{"id", "type": "function",
    "function": {"name", "arguments"}}], the arguments a JSON object's text (OpenAI's) or the object
    (transformers'); None or [] for none. InvalidRequest on anything else (`check_messages` checks
    the names and arguments)."""
    if not calls:
        return ()
    if not isinstance(calls, list):
        raise InvalidRequest(f"messages[{i}].tool_calls must be a list of function calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise InvalidRequest(
                f'messages[{i}].tool_calls[{j}] must be {{"id": ..., "type": "function", "function": '
                '{"name": ..., "arguments": "{...}"}}'
            )
        arguments = function.get("arguments")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call_id, name = call.get("id") or "", function.get("name")
        if not isinstance(arguments, str) or not isinstance(call_id, str) or not isinstance(name, str):
            raise InvalidRequest(
                f"messages[{i}].tool_calls[{j}] needs a string id, function.name and function.arguments "
                "(a JSON object's text)"
            )
        out.append(ToolCall(call_id, name, arguments))
    return tuple(out)


def _shown(value: object) -> str:
    text_ = repr(value)
    return text_ if len(text_) <= 40 else text_[:37] + "..."
