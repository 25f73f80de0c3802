"""`epd.stages.messages` <-> `epd.v1.ChatMessage`, the one converter of the message model, used by
the gateway (Ask), the remote prefill stage and its servicer, and the SDK; likewise the raw prompt
(`epd.stages.raw_prompt` <-> `epd.v1.RawPrompt`) and a finished answer's `stop_reason` (a oneof of
GenerateResponse and AskSummary), a token's logprobs (`TokenLogprob`; a prompt's in pieces,
`prompt_logprobs_pieces`), and the chat template's options (`ChatTemplateOptions`). Kept
free of torch so that the SDK can import it; `epd.transport.convert` re-exports it beside the
other converters."""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any, overload

from epd.model_runtime.logprobs import TokenLogprob, TopLogprob
from epd.stages import template_kwargs, tools
from epd.stages.messages import ChatTemplateOptions, ContentPart, Message, ToolCall
from epd.stages.raw_prompt import RawPrompt
from epd.v1 import common_pb2, messages_pb2


def messages_to_proto(messages: Sequence[Message]) -> list[messages_pb2.ChatMessage]:
    return [
        messages_pb2.ChatMessage(
            role=m.role,
            parts=[messages_pb2.ContentPart(type=p.type, text=p.text) for p in m.parts],
            tool_calls=[
                messages_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls
            ],
            tool_call_id=m.tool_call_id,
        )
        for m in messages
    ]


def messages_from_proto(msgs: Iterable[messages_pb2.ChatMessage]) -> list[Message]:
    """Field for field; what the messages may hold is checked by `epd.stages.messages.check_messages`."""
    return [
        Message(
            m.role,
            tuple(ContentPart(p.type, p.text) for p in m.parts),
            tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
            m.tool_call_id,
        )
        for m in msgs
    ]


def template_to_proto(options: ChatTemplateOptions) -> messages_pb2.ChatTemplateOptions | None:
    """None for the defaults (the field stays unset: a new answer)."""
    if options == ChatTemplateOptions():
        return None
    return messages_pb2.ChatTemplateOptions(
        add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message,
        chat_template_kwargs_json=template_kwargs.to_json(options.chat_template_kwargs)
        if options.chat_template_kwargs
        else "",
        chat_template=options.chat_template,
        tools_json=tools.to_json(options.tools) if options.tools else "",
    )


def template_from_proto(msg: messages_pb2.ChatTemplateOptions) -> ChatTemplateOptions:
    """An unset add_generation_prompt is true (the default); InvalidRequest for variables that are
    not a JSON object (or tools not a JSON list), and `ChatTemplateOptions.check` checks the rest."""
    return ChatTemplateOptions(
        add_generation_prompt=msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True,
        continue_final_message=msg.continue_final_message,
        chat_template_kwargs=template_kwargs.from_json(msg.chat_template_kwargs_json),
        chat_template=msg.chat_template if msg.HasField("chat_template") else None,
        tools=tools.from_json(msg.tools_json),
    )


def raw_prompt_to_proto(prompt: RawPrompt) -> messages_pb2.RawPrompt:
    return messages_pb2.RawPrompt(text=prompt.text, token_ids=prompt.token_ids)


def raw_prompt_from_proto(msg: messages_pb2.RawPrompt) -> RawPrompt:
    """Field for field; `epd.stages.raw_prompt.check_raw_prompt` checks what it holds."""
    return RawPrompt(msg.text, tuple(msg.token_ids))


def set_stop_reason(msg: Any, reason: str | int | None) -> Any:
    """Sets the `stop_reason` oneof of a GenerateResponse or AskSummary: `stop_string` (a str),
    `stop_token_id` (an int), or neither (None: end-of-sequence or length); returns `msg`."""
    if isinstance(reason, str):
        msg.stop_string = reason
    elif reason is not None:
        msg.stop_token_id = reason
    return msg


def stop_reason_from_proto(msg: Any) -> str | int | None:
    """The inverse of `set_stop_reason`, from a message with the `stop_reason` oneof."""
    field = msg.WhichOneof("stop_reason")
    return None if field is None else getattr(msg, field)


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        token=lp.token,
        logprob=lp.logprob,
        top_logprobs=[
            common_pb2.TokenLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob) for t in lp.top
        ],
        rank=lp.rank,
    )


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    """float32 on the wire, as computed: the value comes back exactly."""
    return TokenLogprob(
        msg.token_id,
        msg.token,
        msg.logprob,
        tuple(TopLogprob(t.token_id, t.token, t.logprob) for t in msg.top_logprobs),
        msg.rank,
    )


def logprobs_from_proto(msgs: Sequence[common_pb2.TokenLogprob]) -> list[TokenLogprob] | None:
    """A step's (or answer's) logprobs: None when none were sent (the request did not ask)."""
    return [logprob_from_proto(m) for m in msgs] or None


class PromptLogprobsFromPieces(Sequence[TokenLogprob]):
    """A prompt's logprobs as the pieces that brought them (`PromptLogprobs`), kept as those protobuf
    messages, each entry made a `TokenLogprob` only when read. Joined as `TokenLogprob`s, the half
    million entries a request may hold (`MAX_PROMPT_LOGPROB_ENTRIES`) were as many Python objects,
    each of which every full garbage collection walks holding the GIL, stalling every other stream
    on the gateway up to 0.75 s (docs/benchmarks.md, "Prompt logprobs on the event loop"); a piece
    holds its entries outside Python's heap, a few objects whatever its size. Equal to any sequence
    of the same entries, as the list it replaces was."""

    def __init__(self) -> None:
        self._pieces: list[common_pb2.PromptLogprobs] = []
        self._ends: list[int] = []  # each piece's end: how many entries it and those before hold

    def append_piece(self, piece: common_pb2.PromptLogprobs) -> None:
        if piece.logprobs:
            self._pieces.append(piece)
            self._ends.append(len(self) + len(piece.logprobs))

    @property
    def pieces(self) -> tuple[common_pb2.PromptLogprobs, ...]:
        """The pieces as they came, in order (none empty): what the Ask stream forwards."""
        return tuple(self._pieces)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, index: int) -> TokenLogprob: ...

    @overload
    def __getitem__(self, index: slice) -> list[TokenLogprob]: ...

    def __getitem__(self, index: int | slice) -> TokenLogprob | list[TokenLogprob]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(f"prompt logprob {index} of {len(self)}")
        piece = bisect.bisect_right(self._ends, position)
        start = self._ends[piece - 1] if piece else 0
        return logprob_from_proto(self._pieces[piece].logprobs[position - start])

    def __iter__(self) -> Iterator[TokenLogprob]:
        for piece in self._pieces:
            for msg in piece.logprobs:
                yield logprob_from_proto(msg)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable, as the list it replaces

    def __repr__(self) -> str:
        return f"PromptLogprobsFromPieces({len(self)} entries in {len(self._pieces)} pieces)"


PROMPT_LOGPROBS_PIECE_BYTES = 1 << 20
"""A piece of a prompt's logprobs (`PromptLogprobs`) holds entries until the next would take it
past this many bytes, as tensors go in 1 MiB chunks: far under gRPC's 4 MiB message limit, however
long the prompt. One position's entry alone may pass it (k + 1 tokens, about 22 bytes each)."""

_ENTRY_FRAMING_BYTES = 6
"""A repeated message's tag and length prefix (1 + up to 5 bytes) around each entry in a piece."""


def prompt_logprobs_pieces(
    logprobs: Iterable[TokenLogprob], piece_bytes: int = PROMPT_LOGPROBS_PIECE_BYTES
) -> Iterator[common_pb2.PromptLogprobs]:
    """A prompt's logprobs as consecutive pieces, in order, each at most `piece_bytes` on the wire
    unless its one entry is larger; none for an empty list."""
    entries: list[common_pb2.TokenLogprob] = []
    num_bytes = 0
    for lp in logprobs:
        entry = logprob_to_proto(lp)
        entry_bytes = entry.ByteSize() + _ENTRY_FRAMING_BYTES
        if entries and num_bytes + entry_bytes > piece_bytes:
            yield common_pb2.PromptLogprobs(logprobs=entries)
            entries, num_bytes = [], 0
        entries.append(entry)
        num_bytes += entry_bytes
    if entries:
        yield common_pb2.PromptLogprobs(logprobs=entries)


async def prompt_logprobs_pieces_off_loop(
    logprobs: Iterable[TokenLogprob], piece_bytes: int = PROMPT_LOGPROBS_PIECE_BYTES
) -> AsyncIterator[common_pb2.PromptLogprobs]:
    """`prompt_logprobs_pieces`, each piece made on a worker thread: a piece is about 50,000
    entries, 0.3 s of Python (3.6 s for the largest list), which on a server's event loop would
    stall every other call's stream that long (docs/benchmarks.md, "Prompt logprobs on the event
    loop"). A caller cancelled while a piece is made leaves that piece to end on its thread.
    Logprobs that came in pieces (`PromptLogprobsFromPieces`: the gateway's, from prefill, which
    cut them to `PROMPT_LOGPROBS_PIECE_BYTES` too) go on as those pieces: no entry is made a
    `TokenLogprob` and a message again (2.7 s of Python for the largest list, for the same bytes;
    docs/benchmarks.md, "Prompt logprobs on the event loop")."""
    if isinstance(logprobs, PromptLogprobsFromPieces):
        for as_it_came in logprobs.pieces:
            yield as_it_came
        return
    pieces = prompt_logprobs_pieces(logprobs, piece_bytes)
    while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
        yield piece
