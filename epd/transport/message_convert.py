"""`epd.stages.messages` <-> `epd.v1.ChatMessage`, the one converter of the message model, used by
the gateway (Ask), the remote prefill stage and its servicer, and the SDK. Kept free of torch so
that the SDK can import it; `epd.transport.convert` re-exports it beside the other converters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from epd.stages.messages import ContentPart, Message
from epd.v1 import messages_pb2


def messages_to_proto(messages: Sequence[Message]) -> list[messages_pb2.ChatMessage]:
    return [
        messages_pb2.ChatMessage(
            role=m.role, parts=[messages_pb2.ContentPart(type=p.type, text=p.text) for p in m.parts]
        )
        for m in messages
    ]


def messages_from_proto(msgs: Iterable[messages_pb2.ChatMessage]) -> list[Message]:
    """Field for field; what the messages may hold is checked by `epd.stages.messages.check_messages`."""
    return [Message(m.role, tuple(ContentPart(p.type, p.text) for p in m.parts)) for m in msgs]
