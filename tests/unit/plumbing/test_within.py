"""`aio_cancel.within`, the gateway's time limit on uploads, bodies and media fetches: a cancel of
the awaiting task is never lost, and the limit still ends what overruns it."""

from __future__ import annotations

import asyncio

import pytest

from epd.transport.aio_cancel import within


def test_a_cancel_as_the_awaited_completes_is_kept():
    """Python 3.11's asyncio.wait_for returned the result here and lost the cancel: a gateway
    handler whose client had gone as its upload arrived went on to encode and prefill."""

    async def scenario() -> str:
        arrived: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def handler() -> str:
            return await within(arrived, 60.0)

        task = asyncio.ensure_future(handler())
        await asyncio.sleep(0)  # the handler waits
        arrived.set_result("the upload")  # the upload completes ...
        task.cancel()  # ... in the same loop turn as the client goes
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(scenario()) == "cancelled"


def test_what_overruns_the_limit_is_cut_with_timeouterror():
    async def scenario() -> None:
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with pytest.raises(asyncio.TimeoutError):
            await within(never, 0.01)
        assert await within(asyncio.sleep(0, "on time"), 60.0) == "on time"

    asyncio.run(scenario())
