"""The client's deadline bounds the gateway's stage calls (`epd.stages.deadline`): a call made for a
request whose client gives up in 5 s reaches the stage with at most 5 s left, not the gateway's
stage timeout (600 s here), so that the stage drops work nobody waits for at the client's
deadline; one without a client deadline keeps the stage timeout; a KV release, which must outlive
its client, keeps its own. Real grpc.aio servers in this process that report the deadline they
got (`context.time_remaining()`), the gateway's real `ReplicaPool`, `RemoteDecodeStage` and
`RemotePrefillStage`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

import grpc

from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import PrefillHandle
from epd.stages.deadline import client_time_left_s, set_client_deadline, timeout_within_client_deadline
from epd.transport.remote_decode import RemoteDecodeStage
from epd.transport.remote_prefill import RemotePrefillStage
from epd.transport.replica_pool import ReplicaPool
from epd.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.unit.plumbing.grpc_fakes import start_server, unary

STAGE_TIMEOUT_S = 600.0
CLIENT_DEADLINE_S = 5.0
WIRE_ROUNDING_S = 1.0
"""gRPC sends a deadline rounded up to its wire unit (600 s arrives as up to 601 s)."""


def test_a_stage_call_lasts_no_longer_than_the_client_waits():
    assert client_time_left_s() is None and timeout_within_client_deadline(STAGE_TIMEOUT_S) == STAGE_TIMEOUT_S

    async def scenario() -> tuple[float | None, float | None]:
        set_client_deadline(CLIENT_DEADLINE_S)
        return client_time_left_s(), timeout_within_client_deadline(STAGE_TIMEOUT_S)

    left, timeout_s = asyncio.run(scenario())
    assert left is not None and 0 < left <= CLIENT_DEADLINE_S
    assert timeout_s is not None and 0 < timeout_s <= CLIENT_DEADLINE_S
    assert client_time_left_s() is None  # set in the request's task only
    set_client_deadline(-1.0)  # past: nothing left, never a negative timeout
    try:
        assert client_time_left_s() == 0.0 and timeout_within_client_deadline(STAGE_TIMEOUT_S) == 0.0
    finally:
        set_client_deadline(None)


async def _in_request(client_deadline_s: float | None, call: Callable[[], Awaitable[float]]) -> float:
    """`call()` in a task of its own, as a gateway request's (its handler sets the deadline)."""

    async def request() -> float:
        set_client_deadline(client_deadline_s)
        return await call()

    return await asyncio.ensure_future(request())


async def _with_and_without_a_deadline(call: Callable[[], Awaitable[float]]) -> list[float]:
    """The deadlines `call` reached its server with: under a client's, then under none."""
    return [await _in_request(deadline, call) for deadline in (CLIENT_DEADLINE_S, None)]


def _bounded_by_the_client_alone(seen: list[float]) -> None:
    bounded, unbounded = seen
    assert 0 < bounded <= CLIENT_DEADLINE_S + WIRE_ROUNDING_S
    assert STAGE_TIMEOUT_S - 60 < unbounded <= STAGE_TIMEOUT_S + WIRE_ROUNDING_S


def test_encode_and_prefill_calls_carry_the_clients_deadline():
    """`ReplicaPool.call`, which every encode, prefill, compile and (de)tokenize call goes through."""

    async def seen(request: bytes, context) -> bytes:
        return str(context.time_remaining()).encode()

    async def scenario() -> list[float]:
        server, address = await start_server({"Seen": grpc.unary_unary_rpc_method_handler(seen)})
        pool = ReplicaPool([address])

        async def call() -> float:
            async def attempt(channel: grpc.aio.Channel, timeout_s: float) -> bytes:
                return await unary(channel, "Seen")(b"", timeout=timeout_s)

            return float(await pool.call("", attempt, "prefill", "r", STAGE_TIMEOUT_S))

        try:
            return await _with_and_without_a_deadline(call)
        finally:
            await pool.close()
            await server.stop(0)

    _bounded_by_the_client_alone(asyncio.run(scenario()))


class _Decoder(decode_pb2_grpc.DecodeServiceServicer):
    """Answers one token whose text is the deadline its call got."""

    async def Generate(self, request, context):
        yield decode_pb2.GenerateResponse(token_ids=[1], text=str(context.time_remaining()))


HANDLE = PrefillHandle(first_token_id=1, num_prompt_tokens=4, num_cached_tokens=4, next_position_ids=[4, 4, 4, 4],
                       kv_num_bytes=64, prefill_ms=1.0, kv_handle="h", kv_address="127.0.0.1:1")  # fmt: skip


def test_a_decode_call_carries_the_clients_deadline():
    async def scenario() -> list[float]:
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(_Decoder(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stage = RemoteDecodeStage(ReplicaPool([f"127.0.0.1:{port}"]), STAGE_TIMEOUT_S)

        async def call() -> float:
            return float("".join([s.text async for s in stage.generate(HANDLE, GenerationConfig(), "r")]))

        try:
            return await _with_and_without_a_deadline(call)
        finally:
            await stage.close()
            await server.stop(0)

    _bounded_by_the_client_alone(asyncio.run(scenario()))


class _Prefill(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self) -> None:
        self.release_deadlines: list[float] = []

    async def ReleaseKv(self, request, context):
        self.release_deadlines.append(context.time_remaining())
        return prefill_pb2.ReleaseKvResult(released=True)


def test_a_kv_release_keeps_its_own_timeout():
    """A KV cache is released after its client left (that is when most are): the client's deadline,
    passed or near, must not cut the release, or the cache stays stored until --kv-ttl."""

    async def scenario() -> list[float]:
        servicer = _Prefill()
        server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        stage = RemotePrefillStage(ReplicaPool([address]), STAGE_TIMEOUT_S)

        async def release() -> float:
            await stage.release(replace(HANDLE, kv_address=address), "r")
            return 0.0

        try:
            await _in_request(CLIENT_DEADLINE_S, release)
            return servicer.release_deadlines
        finally:
            await stage.close()
            await server.stop(0)

    (deadline,) = asyncio.run(scenario())
    assert STAGE_TIMEOUT_S - 60 < deadline <= STAGE_TIMEOUT_S + WIRE_ROUNDING_S
