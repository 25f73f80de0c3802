"""`EpdClient`, the blocking client: an `AsyncEpdClient` run on a private event loop in its own
thread, and how that thread, loop and channel are closed (by `close()`, or by the client's
finalizer when it is dropped unclosed or the interpreter exits)."""

from __future__ import annotations

import asyncio
import threading
import warnings
import weakref
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from epd.client.client import AsyncEpdClient
from epd.client.conversation import Conversation
from epd.client.media import Media
from epd.client.types import AskResult, StreamEvent, TokenizeResult
from epd.v1 import gateway_pb2

__all__ = ["EpdClient"]


class EpdClient:
    """Blocking client with the same methods and arguments. It runs an `AsyncEpdClient` on a
    private event loop in its own thread, so it also works where a loop is already running
    (Jupyter, other async frameworks' threads).

    `close()` when done (or `with`). A client dropped without it is closed when it is garbage
    collected (its channel, sockets and thread), with a ResourceWarning as Python gives for an
    unclosed file (shown under `python -X dev` or `-W default`); one still open at interpreter exit
    is closed then, likewise. Both by its `weakref.finalize` (`_close_dropped`), which holds what it
    closes (`_ClientParts`), never the client. Its thread is a daemon, which cannot run once the
    interpreter finalizes: a stream left half read was closed only then, by its generator's
    finalizer, which waited forever for the loop to cancel the call (the script hung at exit);
    finalizers run at exit before that, while the thread still runs."""

    def __init__(self, endpoint: str, timeout_s: float = 600.0, **settings) -> None:
        loop = asyncio.new_event_loop()
        self._parts = _ClientParts(
            loop, threading.Thread(target=_run_loop, args=(loop,), name="epd-client", daemon=True)
        )
        self._parts.thread.start()
        try:
            self._client: AsyncEpdClient = self._run(_make(endpoint, timeout_s, settings))
        except BaseException:
            # No one can close a client that was never made: each failed construction (a missing
            # certificate file, a bad option) would leave its thread and loop running.
            self._parts.closed = True
            _stop_loop(self._parts)
            raise
        self._parts.client = self._client
        self._finalizer = weakref.finalize(self, _close_dropped, self._parts)

    def _run(self, coro):
        if self._parts.closed:
            coro.close()  # never to be awaited: closed now, or Python warns about it later
            raise RuntimeError("the client is closed; make a new EpdClient")
        return asyncio.run_coroutine_threadsafe(coro, self._parts.loop).result()

    @property
    def endpoint(self) -> str:
        return self._client.endpoint

    def ask(self, video: Media | None, question: str | None = None, **options) -> AskResult:
        """See `AsyncEpdClient.ask`; `messages=[...]` instead of a question for a conversation."""
        return self._run(self._client.ask(video, question, **options))

    def conversation(self, video: Media | None, *, system: str = "", **options) -> Conversation:
        """A conversation about `video` (see `AsyncEpdClient.conversation`):

        chat = client.conversation("clip.mp4", num_frames=8)
        print(chat.ask("how many objects are there?").answer)
        print(chat.ask("which appears first?").answer)   # sees the first answer
        """
        return Conversation(self, self._client.conversation(video, system=system, **options))

    def upload_or_reuse(self, video: Media, question: str | None = None, **options) -> AskResult:
        return self._run(self._client.upload_or_reuse(video, question, **options))

    def tokenize(self, prompt: str | None = None, **options) -> TokenizeResult:
        """See `AsyncEpdClient.tokenize`: `tokenize("text")` or `tokenize(messages=[...])`."""
        return self._run(self._client.tokenize(prompt, **options))

    def detokenize(self, token_ids: Sequence[int], **options) -> str:
        """See `AsyncEpdClient.detokenize`."""
        return self._run(self._client.detokenize(token_ids, **options))

    def stream(self, video: Media | None, question: str | None = None, **options) -> Iterator[StreamEvent]:
        """Yields `StageEvent`s and `TokenDelta`s as they arrive, then one `AskResult`."""
        return self._iterate(self._client.stream(video, question, **options))

    def ask_stream(
        self, video: Media | None, question: str | None = None, **options
    ) -> Iterator[gateway_pb2.AskResponse]:
        """Deprecated (removed in 0.3): raw protos; use `stream`."""
        return self._iterate(self._client.ask_stream(video, question, **options))

    def _iterate(self, agen: AsyncGenerator) -> Iterator:
        if self._parts.closed:  # before the generator starts on a loop that is gone
            raise RuntimeError("the client is closed; make a new EpdClient")
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            # Breaking out early cancels the call on the server (the async generators close
            # theirs in turn, down to `_responses`). A client closed meanwhile cancelled it already.
            if not self._parts.closed:
                self._run(agen.aclose())

    def close(self) -> None:
        """Close the channel (a call in flight ends with CANCELLED) and the streams left open, then
        stop the client's thread. Idempotent."""
        if self._finalizer.detach() is not None:  # closed here: nothing left for the finalizer, no warning
            _close(self._parts)

    def __enter__(self) -> EpdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _end_other_tasks() -> None:
    """Cancel every task on the running loop but this one, and wait for them to end."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _make(endpoint: str, timeout_s: float, settings: dict[str, Any]) -> AsyncEpdClient:
    return AsyncEpdClient(endpoint, timeout_s, **settings)  # grpc.aio channels bind to the running loop


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The client thread: its loop until stopped, then closed there (a client collected on this very
    thread cannot wait for that: `_close`)."""
    try:
        loop.run_forever()
    finally:
        loop.close()


@dataclass
class _ClientParts:
    """What an EpdClient holds that must be closed: what its finalizer takes, as it may not hold the client."""

    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    client: AsyncEpdClient | None = None
    closed: bool = False
    """Set as closing starts: a call made from then on is refused, not queued on a stopped loop."""


async def _wind_down(client: AsyncEpdClient) -> None:
    await client.close()
    # A stream left half read: its async generators are closed now, on the loop, rather than by the
    # garbage collector later, when the loop is gone ("Event loop is closed").
    await asyncio.get_running_loop().shutdown_asyncgens()
    # What grpc.aio still has running for a call the closed channel ended (its status handler waits
    # one more turn of the loop): cancelled and awaited, as `asyncio.run` ends its tasks, not
    # destroyed pending when the loop closes ("Task was destroyed but it is pending!").
    await _end_other_tasks()


def _close(parts: _ClientParts) -> None:
    """Close the channel and the streams left open, then stop the loop and its thread."""
    parts.closed = True
    assert parts.client is not None
    if threading.current_thread() is parts.thread:
        # Collected on its own loop's thread (a cycle the collector found there): waiting for the
        # loop here would wait for itself; the loop winds down on its own, then stops and closes.
        parts.loop.create_task(_wind_down(parts.client)).add_done_callback(lambda _: parts.loop.stop())
        return
    try:
        asyncio.run_coroutine_threadsafe(_wind_down(parts.client), parts.loop).result()
    finally:
        _stop_loop(parts)


def _stop_loop(parts: _ClientParts) -> None:
    parts.loop.call_soon_threadsafe(parts.loop.stop)
    parts.thread.join()  # `_run_loop` closes the loop as it ends


def _close_dropped(parts: _ClientParts) -> None:
    """An EpdClient's finalizer: it was garbage collected, or the interpreter exits, unclosed."""
    assert parts.client is not None
    warnings.warn(
        f"unclosed EpdClient for {parts.client.endpoint}: close() it, or use `with EpdClient(...) as client:`",
        ResourceWarning,
        stacklevel=1,  # the collector or the exit calls this: no caller of the user's to point at
    )
    _close(parts)
