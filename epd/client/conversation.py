"""A conversation about one video or image (or about text alone: `conversation(None)`): follow-up
questions that see the earlier answers.

    with EpdClient("127.0.0.1:50050") as client:
        chat = client.conversation("clip.mp4", num_frames=8, max_new_tokens=32)
        print(chat.ask("how many objects are there?").answer)
        result = chat.ask("which appears first?")     # sent: [video, q1], a1, q2
        print(result.answer, result.num_reused_prompt_tokens)
        for event in chat.stream("and last?"):       # StageEvent | TokenDelta | AskResult
            ...
        chat.history   # [user(VIDEO, q1), assistant(a1), user(q2), assistant(a2), user(q3), assistant(a3)]
        chat.reset()   # same video and options, no history

    async with AsyncEpdClient("127.0.0.1:50050") as client:
        chat = client.conversation("clip.mp4", num_frames=8)
        result = await chat.ask("how many objects are there?")

The servers keep no conversation state: each turn is one ordinary `ask` whose `messages` are the
whole history (the first user turn holds the media part and the first question, then the
previous answers as assistant turns, then the new question), so any gateway replica can answer
any turn. What makes a follow-up cheap is on the servers: the encoder's cache (by the media's
sha256) and prefill's prefix cache, which reuses the KV of the history's common prefix; a result
says how many prompt tokens it reused in `num_reused_prompt_tokens` where the server reports it.

The media bytes go up once: after a turn has uploaded them, later turns send only their sha256
and upload again only if the servers answer NOT_FOUND (their cache dropped the media, or a turn
changed the sampling options). One turn at a time per conversation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import grpc

from epd.client.media import Media, MediaSource
from epd.client.types import AskResult, EpdError, StreamEvent
from epd.stages.messages import VIDEO, Message

if TYPE_CHECKING:
    from epd.client.client import AsyncEpdClient
    from epd.client.sync_client import EpdClient

__all__ = ["AsyncConversation", "Conversation", "History"]


class History:
    """The messages of a conversation about one media, without any I/O (the CLI's embedded mode
    uses it too, so both modes send the same conversation)."""

    def __init__(self, system: str = "", with_media: bool = True) -> None:
        self.system = system
        self.with_media = with_media
        """False: a text-only conversation, no turn has a media part."""
        self._messages: list[Message] = []

    @property
    def messages(self) -> list[Message]:
        """The finished turns: [system,] user, assistant, user, assistant, ... (a copy)."""
        return list(self._messages)

    @property
    def num_turns(self) -> int:
        return sum(1 for m in self._messages if m.role == "assistant")

    def messages_for(self, question: str) -> list[Message]:
        """What a turn asking `question` sends: the history, then the question; the first user
        turn carries the media part before the question, as `ask(video, question)` does."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError(
                "the question is empty; ask something" + (" about the video" if self.with_media else "")
            )
        first = self.with_media and not any(m.role == "user" for m in self._messages)
        prefix = [Message.system(self.system)] if self.system and not self._messages else []
        turn = Message.user(VIDEO, question) if first else Message.user(question)
        return [*prefix, *self._messages, turn]

    def add(self, question: str, answer: str) -> None:
        """Record a finished turn."""
        self._messages = [*self.messages_for(question), Message.assistant(answer)]

    def reset(self) -> None:
        self._messages = []


class AsyncConversation:
    """A conversation over an `AsyncEpdClient`; made by `AsyncEpdClient.conversation(video, ...)`.

    `await ask(question, **overrides)` returns the turn's `AskResult` and appends the question and
    its answer to `history`; `stream(question, **overrides)` yields what `AsyncEpdClient.stream`
    yields and appends when the `AskResult` arrives. A turn that fails (or a stream left early)
    leaves the history as it was. Overrides replace the conversation's options for one turn."""

    def __init__(
        self, client: AsyncEpdClient, video: Media | None, *, system: str = "", **options: Any
    ) -> None:
        self._client = client
        # Hashed once, streamed per upload; None: a text-only conversation (nothing to upload).
        self._media = None if video is None else MediaSource(video, client.chunk_bytes)
        self._uploaded = False
        self._busy = False
        self._history = History(system, with_media=video is not None)
        self._results: list[AskResult] = []
        self.options = options
        """The keyword options of every turn (see `build_header`), `timeout_s` included."""

    @property
    def history(self) -> list[Message]:
        """Every finished turn's messages, as the next turn will send them (before its question)."""
        return self._history.messages

    @property
    def results(self) -> list[AskResult]:
        """Every finished turn's result, in order."""
        return list(self._results)

    @property
    def media_sha256(self) -> str:
        """The media's sha256; "" in a text-only conversation."""
        return "" if self._media is None else self._media.sha256

    def reset(self) -> None:
        """Forget the turns; keep the media (the servers may still have it) and the options."""
        self._history.reset()
        self._results = []

    async def ask(self, question: str, **overrides: Any) -> AskResult:
        items = self.stream(question, **overrides)
        async with aclosing(items):  # a cancelled turn cancels its call now
            async for item in items:
                if isinstance(item, AskResult):
                    return item
        raise EpdError(grpc.StatusCode.INTERNAL, "the stream ended without a summary")

    async def stream(self, question: str, **overrides: Any) -> AsyncGenerator[StreamEvent, None]:
        if self._busy:
            raise RuntimeError("a turn of this conversation is still running; ask one question at a time")
        messages = self._history.messages_for(question)
        options = {**self.options, **overrides}
        timeout_s = options.pop("timeout_s", None)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self._client.timeout_s)
        self._busy = True
        try:
            # aclosing: a consumer that leaves this stream early closes the client's stream now,
            # which cancels the call on the server.
            if self._uploaded or self._media is None:  # by hash, or text alone: no upload
                try:
                    async with aclosing(self._turn(None, messages, deadline, options)) as items:
                        async for item in items:
                            if isinstance(item, AskResult):
                                self._finish(question, item)
                            yield item
                    return
                except EpdError as exc:
                    # By hash first: NOT_FOUND comes before any token, so uploading now is safe.
                    if exc.code != grpc.StatusCode.NOT_FOUND or self._media is None:
                        raise
            async with aclosing(self._turn(self._media, messages, deadline, options)) as items:
                async for item in items:
                    if isinstance(item, AskResult):
                        self._uploaded = True
                        self._finish(question, item)
                    yield item
        finally:
            self._busy = False

    def _finish(self, question: str, result: AskResult) -> None:
        # Before the result is yielded: a caller that stops at the result (`ask`, a `break`)
        # leaves the stream there, and may ask the next question at once.
        self._history.add(question, result.answer)
        self._results.append(result)
        self._busy = False

    def _turn(
        self, media: MediaSource | None, messages: list[Message], deadline: float, options: dict[str, Any]
    ) -> AsyncGenerator[StreamEvent, None]:
        return self._client.stream(
            media,
            messages=messages,
            media_sha256="" if media is not None else self.media_sha256,
            timeout_s=max(0.0, deadline - time.monotonic()),
            **options,
        )


class Conversation:
    """The blocking form of `AsyncConversation`, made by `EpdClient.conversation(video, ...)`:
    `ask(question, **overrides) -> AskResult`, `stream(question)`, `history`, `results`,
    `reset()`."""

    def __init__(self, client: EpdClient, conversation: AsyncConversation) -> None:
        self._client = client
        self._async = conversation

    @property
    def history(self) -> list[Message]:
        return self._async.history

    @property
    def results(self) -> list[AskResult]:
        return self._async.results

    @property
    def options(self) -> dict[str, Any]:
        return self._async.options

    @property
    def media_sha256(self) -> str:
        return self._async.media_sha256

    def reset(self) -> None:
        self._async.reset()

    def ask(self, question: str, **overrides: Any) -> AskResult:
        """One turn; see `AsyncConversation`."""
        return self._client._run(self._async.ask(question, **overrides))

    def stream(self, question: str, **overrides: Any) -> Iterator[StreamEvent]:
        """One turn, as it happens: `StageEvent`s, `TokenDelta`s, then the `AskResult`."""
        return self._client._iterate(self._async.stream(question, **overrides))
