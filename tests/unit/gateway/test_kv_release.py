"""Releasing a KV cache that no decoder took (`epd.gateway.kv_release`): the release reaches
prefill even when the request's task is cancelled while it runs, and the pipeline's `aclose` waits
for it (`wait_for_releases`); a failed release is logged, not raised over the request's own error;
a prefill call cancelled as its answer came in has that answer's cache released, and a call that
failed or was cut before answering releases nothing. A prefill stand-in that records its releases
(no gRPC: the channels' side is tests/unit/gateway/test_pipeline_close.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from epd.gateway.kv_release import release_kv, release_outcome, wait_for_releases
from epd.stages.contracts import PrefillHandle


def _handle(kv_handle: str) -> PrefillHandle:
    return PrefillHandle(first_token_id=0, num_prompt_tokens=1, num_cached_tokens=0, next_position_ids=[1],
                         kv_num_bytes=0, prefill_ms=0.0, kv_handle=kv_handle, kv_address="prefill-0:50052")  # fmt: skip


class _Prefill:
    """Releases a handle once `go` is set (at once when it is set already); raises `error` if set."""

    def __init__(self, error: Exception | None = None) -> None:
        self.go = asyncio.Event()
        self.started = asyncio.Event()
        self.released: list[str] = []
        self.error = error

    async def release(self, handle: PrefillHandle, request_id: str) -> None:
        self.started.set()
        await self.go.wait()
        if self.error is not None:
            raise self.error
        self.released.append(handle.kv_handle)


def test_a_release_goes_on_when_its_request_is_cancelled_and_the_close_waits_for_it():
    async def scenario() -> tuple[bool, list[str]]:
        prefill = _Prefill()
        request = asyncio.ensure_future(release_kv(prefill, _handle("h1"), "r-1"))  # type: ignore[arg-type]
        await prefill.started.wait()
        request.cancel()  # the client went away again while the release runs
        await asyncio.gather(request, return_exceptions=True)
        closing = asyncio.ensure_future(wait_for_releases(30.0))  # as `Pipeline.aclose`
        await asyncio.sleep(0)
        waited = not closing.done()  # the close waits while the release still runs
        prefill.go.set()
        await closing
        return waited, prefill.released

    waited, released = asyncio.run(scenario())
    assert waited
    assert released == ["h1"]


def test_a_failed_release_is_logged_not_raised(caplog):
    async def scenario() -> None:
        prefill = _Prefill(error=ConnectionError("prefill-0 went away"))
        prefill.go.set()
        await release_kv(prefill, _handle("h2"), "r-2")  # type: ignore[arg-type]

    with caplog.at_level(logging.WARNING, logger="epd.gateway.kv_release"):
        asyncio.run(scenario())  # raises nothing over the request's own outcome
    assert "could not release the KV cache of request r-2 (its TTL will)" in caplog.text
    assert "prefill-0 went away" in caplog.text


@pytest.mark.parametrize("outcome", ["answered", "failed", "cancelled"])
def test_a_cancelled_prefill_call_has_its_answers_cache_released_and_no_other(outcome):
    async def scenario() -> list[str]:
        prefill = _Prefill()
        prefill.go.set()
        call: asyncio.Future = asyncio.get_running_loop().create_future()
        if outcome == "answered":
            call.set_result(_handle("h3"))  # the answer came in as the request's task was cancelled
        elif outcome == "failed":
            call.set_exception(RuntimeError("prefill refused it"))
        else:
            call.cancel()
        release_outcome(prefill, "r-3")(call)  # type: ignore[arg-type]
        await wait_for_releases(30.0)
        return prefill.released

    assert asyncio.run(scenario()) == (["h3"] if outcome == "answered" else [])
