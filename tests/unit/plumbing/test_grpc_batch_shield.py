"""`shield_grpc_batches` behind a real grpc.aio server on 127.0.0.1 (in this process): calls of
each shape gRPC has (a streamed answer, an upload with a streamed answer, an upload with one
answer, a unary call; the gateway makes all but the upload with one answer since Prefill answers a
stream) are cut at each point an operation can be in flight (a read, a stalled
upload, the answer of a unary call; by a cancelled task, a `wait_for` timeout, `call.cancel()`,
the call's deadline, or before its first operation). After each cut the call has its final
status, the server's handler has ended, no task is left pending, and every batch the cut left in
flight has been completed by gRPC (which is what frees its native memory: grpc/grpc#43360). The
memory itself is measured by bench/bench_grpc_cancel_memory.py, not here.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc._cython import cygrpc

from epd.transport.aio_cancel import LEFT_BATCHES, shield_grpc_batches
from tests.unit.plumbing.grpc_fakes import SERVICE, connected, start_server

HANG_GUARD_S = 30.0
DEADLINE_S = 2.0
"""The "deadline" cut's call deadline (its channel is connected first)."""
UPLOAD_CHUNK_BYTES = 1 << 20
# far past HTTP/2's flow-control window: the upload stalls on a server that does not read
NUM_UPLOAD_CHUNKS = 16
Code = grpc.StatusCode


class Servicer:
    """Handlers that answer a little and then hold the call open until it is cut."""

    def __init__(self) -> None:
        self.num_ended = 0

    async def _hold(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.num_ended += 1

    async def Tokens(self, request: bytes, context):
        yield b"token 0"
        await self._hold()

    async def Encode(self, requests, context):
        yield b"event"  # before reading the upload, which then stalls
        await self._hold()

    async def Prefill(self, requests, context) -> bytes:
        await self._hold()
        return b""

    async def ReleaseKv(self, request: bytes, context) -> bytes:
        await self._hold()
        return b""


@pytest.fixture
def shielded(monkeypatch):
    """The shield for this test only: grpcio's own execute_batch is put back afterwards."""
    monkeypatch.setattr(cygrpc, "execute_batch", cygrpc.execute_batch)
    assert shield_grpc_batches()


async def wait_until(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    end_at = loop.time() + HANG_GUARD_S
    while not predicate():
        assert loop.time() < end_at, f"still not {what} after {HANG_GUARD_S} s"
        await asyncio.sleep(0.01)


class Upload:
    """A request stream of 1 MiB chunks that tells how far gRPC has taken it."""

    def __init__(self) -> None:
        self.num_taken = 0

    async def __call__(self):
        for _ in range(NUM_UPLOAD_CHUNKS):
            yield b"\0" * UPLOAD_CHUNK_BYTES
            self.num_taken += 1

    async def stalled(self) -> None:
        """Until a chunk's write has been in flight for a while (the server reads none)."""
        seen, still_for_s = -1, 0.0
        while still_for_s < 0.3:
            await asyncio.sleep(0.05)
            still_for_s = still_for_s + 0.05 if self.num_taken == seen else 0.0
            seen = self.num_taken
        assert self.num_taken < NUM_UPLOAD_CHUNKS, "the upload never stalled"


async def cut(channel: grpc.aio.Channel, how: str) -> tuple[grpc.aio.Call, int]:
    """Make a call and cut it as `how` says; (the call, how many batches the cut surely left in flight)."""
    tokens = channel.unary_stream(f"/{SERVICE}/Tokens")
    if how == "before first operation":
        call = tokens(b"request")
        call.cancel()
        return call, 0
    if how == "stalled upload":
        upload = Upload()
        call = channel.stream_stream(f"/{SERVICE}/Encode")(upload())
        assert await call.read() == b"event"
        reader = asyncio.ensure_future(call.read())
        await upload.stalled()
        reader.cancel()  # a read and the stalled write in flight
        with pytest.raises(asyncio.CancelledError):
            await reader
        return call, 2
    if how == "upload, one answer":
        upload = Upload()
        call = channel.stream_unary(f"/{SERVICE}/Prefill")(upload())
        waiter = asyncio.ensure_future(call)
        await upload.stalled()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return call, 1
    if how == "unary":
        call = channel.unary_unary(f"/{SERVICE}/ReleaseKv")(b"request", timeout=HANG_GUARD_S)
        waiter = asyncio.ensure_future(call)
        await asyncio.sleep(0.2)
        waiter.cancel()  # the call's one batch in flight
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return call, 1

    # The deadline case's first message must come before its deadline: on a loaded machine too.
    call = tokens(b"request", timeout=DEADLINE_S if how == "deadline" else HANG_GUARD_S)
    if how == "async for":  # the gateway's decode stream: its request task is cancelled (client gone)
        received = []

        async def consume() -> None:
            async for message in call:
                received.append(message)

        consumer = asyncio.ensure_future(consume())
        await wait_until(lambda: received == [b"token 0"], "given the first message")
        await asyncio.sleep(0.2)
        consumer.cancel()  # the second read in flight
        with pytest.raises(asyncio.CancelledError):
            await consumer
        return call, 1
    assert await call.read() == b"token 0"
    if how == "read":
        reader = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.2)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        return call, 1
    if how == "wait_for timeout":
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call.read(), 0.2)
        return call, 1
    if how == "call.cancel()":  # the reader is told by the call, its task is not cancelled
        asyncio.get_running_loop().call_later(0.2, call.cancel)
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        return call, 0
    if how == "deadline":
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == Code.DEADLINE_EXCEEDED
        return call, 0
    raise AssertionError(how)


def started_by_the_call(before: set[asyncio.Task]) -> set[asyncio.Task]:
    """The tasks started since `before`, but the server's own wait for its next call."""
    new = asyncio.all_tasks() - before - {asyncio.current_task()}
    return {t for t in new if getattr(t.get_coro(), "__qualname__", "") != "AioServer._request_call"}


@pytest.mark.parametrize(
    "how",
    [
        "before first operation",
        "read",
        "async for",
        "wait_for timeout",
        "call.cancel()",
        "deadline",
        "stalled upload",
        "upload, one answer",
        "unary",
    ],
)
def test_a_cut_call_ends_with_its_status_and_leaves_nothing_in_flight(shielded, how):
    async def main() -> None:
        servicer = Servicer()
        server, address = await start_server(
            {
                "Tokens": grpc.unary_stream_rpc_method_handler(servicer.Tokens),
                "Encode": grpc.stream_stream_rpc_method_handler(servicer.Encode),
                "Prefill": grpc.stream_unary_rpc_method_handler(servicer.Prefill),
                "ReleaseKv": grpc.unary_unary_rpc_method_handler(servicer.ReleaseKv),
            }
        )
        before = asyncio.all_tasks()
        num_ended_before = LEFT_BATCHES.num_ended
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                await connected(channel)  # a cut's timings count from its call, not the connection's
                call, num_left = await cut(channel, how)
                code = await asyncio.wait_for(call.code(), HANG_GUARD_S)
                assert code == (Code.DEADLINE_EXCEEDED if how == "deadline" else Code.CANCELLED)
                if how != "before first operation":  # a call cut that early may never reach the handler
                    await wait_until(lambda: servicer.num_ended == 1, "ended on the server")
                await wait_until(lambda: not LEFT_BATCHES.in_flight, "completed (the left batches)")
                # Each batch the cut left in flight was run to its end (its memory freed); unshielded,
                # none is: the task that awaited it dropped it.
                assert LEFT_BATCHES.num_ended - num_ended_before >= num_left
                await wait_until(lambda: not started_by_the_call(before), "ended (tasks the call started)")
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_shielding_twice_wraps_once(shielded):
    wrapper = cygrpc.execute_batch
    assert shield_grpc_batches()
    assert cygrpc.execute_batch is wrapper
