"""The one message model of every door: a conversation is a list of `Message`s (role "system",
"user" or "assistant"), each a list of `ContentPart`s ("text", "video", "image") in the user's
order. Plain Python (no torch, no gRPC): the SDK builds it, the HTTP and gRPC doors parse into it,
`epd.transport.message_convert` carries it over the wire, and the prefill engine renders it with
the model's own chat template, exactly as `processor.apply_chat_template` renders
`to_chat_template(messages, modality)`.

    [Message.user(VIDEO, "what colour is the circle?")]                      # 0.1's question
    [Message.user("what happens here?", VIDEO, "answer in one word")]         # text around a video
    [Message.system("be brief"), Message.user(IMAGE, "what is it?"),
     Message.assistant("a circle"), Message.user("what colour?")]             # earlier turns

A media part ("video" / "image") marks where the request's media goes; the media itself travels
beside the messages (uploaded bytes, a URL, a sha256). A request carries at most one media part
(the encoder encodes one media per request), or none: a text-only conversation ("hello", a
client's health ping, a title to generate) skips the encoder and is rendered as the template
renders text alone, as vLLM and SGLang answer it on a vision-language model. The media part's
placeholder takes the kind the encoder found in the bytes: a "video" part whose bytes are a PNG is
rendered as an image, as 0.1 did.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from epd.stages.chat_template import check_request_chat_template
from epd.stages.errors import InvalidRequest
from epd.stages.template_kwargs import check_chat_template_kwargs

ROLES = ("system", "user", "assistant")
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
class Message:
    """One turn of the conversation: its role and its content parts, in order."""

    role: str
    """"system", "user" or "assistant"."""
    parts: tuple[ContentPart, ...]

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

    def check(self, messages: Sequence[Message], to_answer: bool = True) -> None:
        """InvalidRequest unless these options can render `messages`: not both flags (vLLM's 400:
        the template cannot both open a new answer and leave the last message open), and, for a
        request `to_answer`, only the assistant's message continued (/tokenize, not to answer,
        leaves any last message open, as vLLM's does); and `chat_template_kwargs` variables epd
        passes on (`check_chat_template_kwargs`); a `chat_template` of bounded size
        (`check_request_chat_template`)."""
        check_chat_template_kwargs(self.chat_template_kwargs)
        check_request_chat_template(self.chat_template)
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


def num_text_chars(messages: Sequence[Message]) -> int:
    return sum(len(p.text) for m in messages for p in m.parts)


def check_messages(
    messages: Sequence[Message],
    max_text_chars: int | None = None,
    to_answer: bool = True,
    template: ChatTemplateOptions = ChatTemplateOptions(),
) -> None:
    """Raise InvalidRequest, saying what to change, unless `messages` is a conversation epd can
    answer: known roles and part types, text only in text parts, at most one media part (in a
    user message; none: a text-only conversation), the last message the user's or the
    assistant's (which the answer follows, or with `template.continue_final_message` continues;
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
    if media > 1:
        raise InvalidRequest(
            f"the messages have {media} video or image parts; at most one video or image per request is "
            "supported (the encoder encodes one media per request): send one"
        )
    if to_answer:
        if messages[-1].role not in ("user", "assistant"):
            raise InvalidRequest(
                f"the last message is the {messages[-1].role}'s; end with the user's message (the answer is "
                "generated as the assistant's next message), or an assistant's to continue"
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
    media part typed `modality`, the kind the encoder found in the media."""
    return [
        {
            "role": m.role,
            "content": [
                {"type": modality} if p.is_media else {"type": "text", "text": p.text} for p in m.parts
            ],
        }
        for m in messages
    ]


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
        out.append(Message(m["role"], tuple(parts)))
    return out


def _shown(value: object) -> str:
    text_ = repr(value)
    return text_ if len(text_) <= 40 else text_[:37] + "..."
