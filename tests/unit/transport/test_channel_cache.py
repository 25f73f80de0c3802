"""Channels to KV-cache addresses (which come and go with prefill pods) are kept for reuse but
bounded: the least recently used idle ones close; one with a call in flight never does."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from epd.stages.contracts import PrefillHandle
from epd.stages.errors import EpdError
from epd.transport.channel_cache import ChannelCache
from epd.transport.ports_file import free_port
from epd.transport.remote_prefill import RemotePrefillStage
from epd.transport.replica_pool import ReplicaPool

CLOSED: list[str] = []


class _Channel:
    def __init__(self, target: str) -> None:
        self.target = target
        self.closed = False

    async def close(self) -> None:
        self.closed = True
        CLOSED.append(self.target)


def test_idle_channels_beyond_the_bound_close_least_recently_used_first_and_busy_ones_stay():
    opened: list[_Channel] = []

    def open_channel(target: str) -> _Channel:
        opened.append(_Channel(target))
        return opened[-1]

    cache = ChannelCache(open_channel, max_idle=2)  # type: ignore[arg-type]
    CLOSED.clear()

    async def run() -> None:
        async with cache.use("busy") as busy:
            for target in ("a", "b", "a", "c", "d", "e"):
                async with cache.use(target) as channel:
                    assert channel.target == target
            # "a" was used again after "b": "b" then "a" closed; the busy one stayed. The last
            # one used was busy when the others closed: it goes at the next call.
            assert CLOSED == ["b", "a"]
            assert not busy.closed
            assert cache.targets == ["busy", "c", "d", "e"]
        await cache.close()

    asyncio.run(run())
    assert all(c.closed for c in opened)
    assert [c.target for c in opened] == ["busy", "a", "b", "c", "d", "e"]  # "a" reused while open


def test_the_gateways_kv_releases_keep_a_bounded_number_of_channels():
    """Each prefill pod that answered a request is a KV address the gateway releases at: pods
    replaced over weeks kept one channel each, for good. Real channels to loopback ports where
    nothing listens (each release fails UNAVAILABLE, as at a pod that is gone)."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(5)]

    async def run() -> list[str]:
        pool = ReplicaPool([f"127.0.0.1:{free_port()}"])
        stage = RemotePrefillStage(pool, timeout_s=5.0)
        stage.kv_channels.max_idle = 2
        try:
            for i, address in enumerate(addresses):
                handle = PrefillHandle(first_token_id=0, num_prompt_tokens=1, num_cached_tokens=0,
                                       next_position_ids=[1], kv_num_bytes=0, prefill_ms=0.0,
                                       kv_handle=f"h{i}", kv_address=address)  # fmt: skip
                with pytest.raises(EpdError) as failed:
                    await stage.release(handle, f"r{i}")
                assert failed.value.code == grpc.StatusCode.UNAVAILABLE
            return stage.kv_channels.targets
        finally:
            await stage.close()
            await pool.close()

    # The last used is closed only at the next call (it was busy when the others closed).
    assert asyncio.run(run()) == addresses[-3:]
