"""`LoadService`: EngineLoad on the wire field for field, and a real in-process server that
answers with what its stage's `load()` says (nothing before the stage is built)."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from epd.stages.engine_core import EngineLoad
from epd.transport.load import fetch_loads, load_from_proto, load_to_proto
from epd.transport.load_servicer import stage_loads, with_load_service

HANG_GUARD_S = 30.0
BUSY = EngineLoad(
    stage="decode", num_running=3, num_waiting=2, last_batch_size=3, num_steps=41, queue_wait_s_total=1.25,
    num_preemptions=1, memory_used_bytes=4096, memory_total_bytes=1 << 20,
)  # fmt: skip


def test_every_field_survives_the_wire():
    wire_fields = {f.name for f in load_to_proto(BUSY).DESCRIPTOR.fields}
    assert {f.name for f in dataclasses.fields(EngineLoad)} == wire_fields
    assert load_from_proto(load_to_proto(BUSY)) == BUSY
    assert load_from_proto(load_to_proto(EngineLoad("encoder"))) == EngineLoad("encoder")
    numbers = [f.name for f in dataclasses.fields(EngineLoad) if f.name != "stage"]
    every = EngineLoad("prefill", **{name: i + 1 for i, name in enumerate(numbers)})  # none left at 0
    assert load_from_proto(load_to_proto(every)) == every


class _Stage:
    def __init__(self, result) -> None:
        self.result = result

    def load(self):
        return self.result


def test_stage_loads_takes_one_load_a_list_or_none():
    assert stage_loads(None) == []  # the model is still loading
    assert stage_loads(object()) == []  # a stage without an engine core
    assert stage_loads(_Stage(BUSY)) == [BUSY]
    assert stage_loads(_Stage((BUSY, EngineLoad("video_decode")))) == [BUSY, EngineLoad("video_decode")]


class _Servicer:
    stage: object = None


async def _serve(servicer: _Servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    registered = []
    register = with_load_service(registered.append, lambda: stage_loads(servicer.stage))
    register(server)
    assert registered == [server]  # the service's own registration runs too
    port = server.add_insecure_port("127.0.0.1:0")
    assert port
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_get_load_answers_what_the_stage_reports_now():
    async def scenario():
        servicer = _Servicer()
        server, address = await _serve(servicer)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                before = await fetch_loads(channel, HANG_GUARD_S)
                servicer.stage = _Stage(BUSY)  # the model loaded
                after = await fetch_loads(channel, HANG_GUARD_S)
                servicer.stage = _Stage([BUSY, EngineLoad("video_decode", num_steps=2)])
                two = await fetch_loads(channel, HANG_GUARD_S)
            return before, after, two
        finally:
            await server.stop(0)

    before, after, two = asyncio.run(scenario())
    assert before == []
    assert after == [BUSY]
    assert two == [BUSY, EngineLoad("video_decode", num_steps=2)]


def test_a_failing_load_is_an_rpc_error():
    class Broken:
        def load(self):
            raise RuntimeError("scheduler gone")

    async def scenario():
        servicer = _Servicer()
        servicer.stage = Broken()
        server, address = await _serve(servicer)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                await fetch_loads(channel, HANG_GUARD_S)
        finally:
            await server.stop(0)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(scenario())
    assert info.value.code() == grpc.StatusCode.UNKNOWN
