"""`ReplicaPool`: calls go to the replicas in turn, each channel to its own address, checked
with real calls to three in-process servers that answer with their own name; a client-streaming
call that gRPC cancels itself (its request stream failed) is the stage's error, a cancel of the
calling task stays a cancel."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from epd.transport.replica_pool import ReplicaPool
from tests.unit.plumbing.grpc_fakes import SERVICE, connected, start_server, unary

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
            await connected(*pool.channels)
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
            await connected(*pool.channels)
            answers = [await unary(pool.pick(), "Who")(b"", timeout=HANG_GUARD_S) for _ in range(3)]
            await pool.close()
            with pytest.raises(grpc.aio.UsageError):
                await unary(pool.pick(), "Who")(b"", timeout=HANG_GUARD_S)
            return answers
        finally:
            await server.stop(0)

    assert asyncio.run(scenario()) == [b"only"] * 3


def test_the_first_pick_is_never_a_name_not_resolved_yet():
    """`pick` is the first candidate a call tries: a `dns:///` name the gateway has not found yet
    gets no call (`unresolved`), whatever its rendezvous score for the key."""

    async def scenario():
        pool = ReplicaPool(["dns:///stage.invalid:1", "127.0.0.1:1"])
        try:
            for key in ("", "a", "b", "c", "d"):
                assert pool.pick(key) is pool.channel("127.0.0.1:1")
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_stage_needs_an_address():
    with pytest.raises(ValueError, match="at least one address"):
        ReplicaPool([])


def _collector(gate: asyncio.Event | None = None) -> dict[str, grpc.RpcMethodHandler]:
    async def collect(requests, context) -> bytes:
        got = [r async for r in requests]
        if gate is not None:
            await gate.wait()
        return b"".join(got)

    return {"Collect": grpc.stream_unary_rpc_method_handler(collect)}


def test_grpcs_own_cancel_of_a_call_whose_request_failed_is_the_stages_error_not_a_cancelled_task():
    """grpc.aio cancels a client-streaming call itself when its request stream fails (as when the
    deadline passes before the request is written), and reading the answer raises CancelledError:
    the gateway's stage call turns it into an INTERNAL naming the stage and the request, not a
    cancel of the request's task (which its front door would take for a client gone)."""
    from epd.transport.errors import UpstreamError

    async def scenario():
        server, address = await start_server(_collector())
        pool = ReplicaPool([address])

        async def failing_requests():
            yield b"header"
            raise OSError("the embeddings could not be read")

        async def attempt(channel, timeout_s):
            call = channel.stream_unary(f"/{SERVICE}/Collect")
            return await call(failing_requests(), timeout=timeout_s)

        try:
            # Connected first: a stale subchannel to this port (grpc_fakes.connected) would fail the
            # call UNAVAILABLE before its request stream fails, which is another test's subject.
            await connected(*pool.channels)
            with pytest.raises(UpstreamError) as err:
                await pool.call("", attempt, "prefill", "req-7", HANG_GUARD_S)
            return err.value
        finally:
            await pool.close()
            await server.stop(0)

    err = asyncio.run(scenario())
    assert err.code == grpc.StatusCode.INTERNAL
    assert str(err) == "prefill stage call failed while sending its request (request id req-7)"


def test_a_cancel_of_the_calling_task_still_cancels_it():
    """The other CancelledError: the request's own task cancelled (its client went away) while the
    stage holds the call. It stays a cancel."""

    async def scenario():
        gate = asyncio.Event()
        server, address = await start_server(_collector(gate))
        pool = ReplicaPool([address])

        async def requests():
            yield b"all of it"

        async def attempt(channel, timeout_s):
            return await channel.stream_unary(f"/{SERVICE}/Collect")(requests(), timeout=timeout_s)

        try:
            await connected(*pool.channels)
            task = asyncio.ensure_future(pool.call("", attempt, "prefill", "req-8", HANG_GUARD_S))
            await asyncio.sleep(0.2)  # the call is open, the server holds it
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            gate.set()
            await pool.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_name_not_resolved_yet_holds_no_channel():
    """A pending `dns:///` entry gets no call, so it gets no channel either: one opened for it sat
    idle, never connecting, for as long as the name stayed unresolved (for good, for a name that
    never resolves). Its addresses get channels once found, and a reloaded list that names a new
    pending name opens nothing for it; the replaced addresses' channels close."""

    async def scenario():
        pending = "dns:///stage.invalid:1"
        pool = ReplicaPool([pending, "127.0.0.1:1"])
        try:
            assert len(pool.channels) == 1 and pool.channels[0] is pool.channel("127.0.0.1:1")
            with pytest.raises(KeyError):
                pool.channel(pending)
            pool.set_addresses(["127.0.0.2:1", "127.0.0.1:1"])  # the name found: one address
            assert len(pool.channels) == 2
            found = pool.channel("127.0.0.2:1")
            pool.set_addresses(["dns:///other.invalid:1"])  # a reloaded list: a new name, pending
            assert pool.channels == []
            await asyncio.sleep(0)  # the retired channels close in tasks of their own
            await asyncio.gather(*pool._closing)
            assert found.get_state() == grpc.ChannelConnectivity.SHUTDOWN
        finally:
            await pool.close()

    asyncio.run(scenario())
