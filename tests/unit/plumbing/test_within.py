"""`aio_cancel.within`, the gateway's time limit on uploads, bodies and media fetches: a cancel of
the awaiting task is never lost, and the limit still ends what overruns it."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

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


def test_no_product_code_waits_with_asyncio_wait_for():
    """Every time limit goes through `within`; the gateway's replica-file poll still used
    wait_for, and a stop landing as a SIGHUP did left the watcher polling through the drain
    (tests/unit/gateway/test_replica_list.py). Only `within`'s Python 3.10 fallback may call it."""
    root = Path(__file__).resolve().parents[3]
    top = ["epd", "encoder_svc", "prefill_svc", "decode_svc", "video", "token_pruning"]
    calls = []
    for path in sorted(
        p for d in top for p in (root / d).rglob("*.py") if p.is_file() and p.name != "aio_cancel.py"
    ):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "wait_for":
                calls.append(f"{path.relative_to(root)}:{node.lineno}")
    assert calls == [], "use epd.transport.aio_cancel.within: " + "; ".join(calls)
