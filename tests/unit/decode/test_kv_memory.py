"""KvMemory, without a model: room is priced as the batch lays it out (rows x the longest final
length), granted FIFO, refused when even the wait queue is full, and given back however a
reservation ends (released, or its waiter cancelled)."""

from __future__ import annotations

import asyncio

import pytest

from epd.decode_svc.kv_memory import KvMemory
from epd.stages.errors import ResourceExhausted


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_cost_is_rows_times_the_longest_final_length():
    m = KvMemory(budget_bytes=1000, bytes_per_token=2, max_running=8, max_waiting=4)
    assert m.cost_bytes([100, 300, 50]) == 3 * 300 * 2
    assert m.cost_bytes([]) == 0


def test_grants_in_order_and_a_blocked_head_blocks_the_rest():
    async def scenario():
        m = KvMemory(budget_bytes=100, bytes_per_token=1, max_running=8, max_waiting=4)
        await m.reserve("a", 40)
        await m.reserve("b", 10)  # 2 x 40 = 80 <= 100
        assert m.used_bytes == 80
        big = asyncio.ensure_future(m.reserve("big", 60))  # 3 x 60 = 180: waits
        small = asyncio.ensure_future(m.reserve("small", 5))  # would fit (3 x 40), but queues behind big
        await asyncio.sleep(0)
        assert (m.num_waiting, big.done(), small.done()) == (2, False, False)
        m.free("a")  # b + big: 2 x 60 = 120 > 100, still not
        await asyncio.sleep(0)
        assert not big.done()
        m.free("b")  # big alone (60), then small: 2 x 60 = 120 > 100: small waits
        await asyncio.sleep(0)
        assert big.done() and not small.done()
        m.free("big")
        await small
        assert m.num_holding == 1 and m.num_waiting == 0

    _run(scenario())


def test_max_running_bounds_the_batch():
    async def scenario():
        m = KvMemory(budget_bytes=10**9, bytes_per_token=1, max_running=2, max_waiting=4)
        await m.reserve("a", 10)
        await m.reserve("b", 10)
        third = asyncio.ensure_future(m.reserve("c", 10))
        await asyncio.sleep(0)
        assert not third.done()
        m.free("a")
        await third

    _run(scenario())


def test_a_full_wait_queue_and_an_impossible_request_are_refused_with_what_to_change():
    async def scenario():
        m = KvMemory(budget_bytes=100, bytes_per_token=1, max_running=8, max_waiting=1)
        with pytest.raises(
            ResourceExhausted, match="more than the decoder's whole budget.*--kv-budget-bytes"
        ):
            await m.reserve("huge", 101)
        await m.reserve("a", 100)
        waiter = asyncio.ensure_future(m.reserve("b", 10))
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="KV memory is full.*1 more wait.*--max-waiting-requests"):
            await m.reserve("c", 10)
        m.free("a")
        await waiter
        assert m.num_holding == 1

    _run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_unblocks_those_behind_it():
    async def scenario():
        m = KvMemory(budget_bytes=100, bytes_per_token=1, max_running=8, max_waiting=4)
        await m.reserve("a", 50)
        big = asyncio.ensure_future(m.reserve("big", 100))  # needs everything
        small = asyncio.ensure_future(m.reserve("small", 10))  # fits now, but waits behind big
        await asyncio.sleep(0)
        big.cancel()
        await asyncio.gather(big, return_exceptions=True)
        await asyncio.wait_for(small, 1)
        assert m.num_waiting == 0 and m.num_holding == 2

    _run(scenario())


def test_the_reservation_context_frees_however_it_ends():
    async def scenario():
        m = KvMemory(budget_bytes=100, bytes_per_token=1, max_running=8, max_waiting=4)
        with pytest.raises(RuntimeError):
            async with m.reservation("a", 60):
                assert m.used_bytes == 60
                raise RuntimeError("pull failed")
        assert m.used_bytes == 0

    _run(scenario())


def test_a_fixed_state_per_request_counts_once_per_row():
    m = KvMemory(budget_bytes=1000, bytes_per_token=2, max_running=8, max_waiting=0, fixed_bytes=100)
    assert m.cost_bytes([100, 300]) == 2 * (300 * 2 + 100)
    with pytest.raises(ResourceExhausted, match="whole budget"):
        m.check_admissible(451)  # 451 * 2 + 100 > 1000
