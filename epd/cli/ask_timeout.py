"""`epd ask --timeout SECONDS`: each question's deadline, and the error that ends a question when
it passes (exit status EXIT_TIMEOUT, `epd.cli.ask`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epd.client import StreamEvent


class AskTimedOut(Exception):
    """A question's --timeout passed before its answer ended (`within_timeout`)."""

    def __init__(self, timeout_s: float, given: bool) -> None:
        where = "--timeout" if given else "the SDK's default deadline with --endpoint; --timeout sets it"
        super().__init__(
            f"no answer within {timeout_s:g} s ({where}): raise --timeout, or ask for less "
            "(fewer --max-new-tokens, --num-frames or --max-frames)"
        )


async def within_timeout(
    stream: AsyncGenerator[StreamEvent, None], timeout_s: float | None, given: bool
) -> AsyncGenerator[StreamEvent, None]:
    """One question's `stream`, ended by AskTimedOut once `timeout_s` has passed since it began
    (None: no deadline). It is the request's client deadline for the stages it runs in this
    process (`set_client_deadline`: their tasks inherit it; prefill's render checks read it), and
    at the deadline the stream is cancelled, as gRPC ends a front door's call (embedded mode has
    none to end it); a remote stream's SDK call carries it as its gRPC deadline itself, and its
    DEADLINE_EXCEEDED once it passed is the same AskTimedOut. `given`: by --timeout (the message
    says so), not the SDK's default."""
    from epd.client import EpdError
    from epd.client.client import DEADLINE_CLOCK_SLACK_S
    from epd.stages.deadline import set_client_deadline
    from epd.stages.errors import DeadlineExceeded

    if timeout_s is None:
        async with contextlib.aclosing(stream):
            async for item in stream:
                yield item
        return
    end_at = time.monotonic() + timeout_s
    set_client_deadline(timeout_s)
    async with contextlib.aclosing(stream):  # at the deadline: its stage calls cancelled now
        while True:
            limit = asyncio.timeout(max(0.0, end_at - time.monotonic()))
            try:
                async with limit:
                    item = await anext(stream)
            except StopAsyncIteration:
                return
            except Exception as exc:
                # Ours: the timer fired (whatever the cancelled stream raised), or a stage or the
                # SDK saw the same deadline pass a moment before the timer.
                late = time.monotonic() >= end_at - DEADLINE_CLOCK_SLACK_S
                deadline_error = isinstance(exc, DeadlineExceeded) or (
                    isinstance(exc, EpdError) and exc.code.name == "DEADLINE_EXCEEDED"
                )
                if limit.expired() or (late and deadline_error):
                    raise AskTimedOut(timeout_s, given) from None
                raise
            yield item
