"""`ReplicaPool`: calls go to the replicas in turn, each channel to its own address, checked
with real calls to three in-process servers that answer with their own name."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from epd.transport.remote_stages import ReplicaPool
from tests.unit.plumbing.grpc_fakes import start_server, unary

HANG_GUARD_S = 30.0


def _named(name: bytes) -> dict[str, grpc.RpcMethodHandler]:
    async def who(request: bytes, context) -> bytes:
        return name

    return {"Who": grpc.unary_unary_rpc_method_handler(who)}


def test_calls_go_round_robin_over_the_replicas_in_order():
    async def scenario():
        started = [await start_server(_named(name)) for name in (b"a", b"b", b"c")]
        pool = ReplicaPool([address for _, address in started])
        try:
            return [await unary(pool.pick(), "Who")(b"", timeout=HANG_GUARD_S) for _ in range(7)]
        finally:
            await pool.close()
            for server, _ in started:
                await server.stop(0)

    assert asyncio.run(scenario()) == [b"a", b"b", b"c", b"a", b"b", b"c", b"a"]


def test_one_replica_gets_every_call_and_close_closes_its_channel():
    async def scenario():
        server, address = await start_server(_named(b"only"))
        pool = ReplicaPool([address])
        try:
            answers = [await unary(pool.pick(), "Who")(b"", timeout=HANG_GUARD_S) for _ in range(3)]
            await pool.close()
            with pytest.raises(grpc.aio.UsageError):
                await unary(pool.pick(), "Who")(b"", timeout=HANG_GUARD_S)
            return answers
        finally:
            await server.stop(0)

    assert asyncio.run(scenario()) == [b"only"] * 3


def test_a_stage_needs_an_address():
    with pytest.raises(ValueError, match="at least one address"):
        ReplicaPool([])
