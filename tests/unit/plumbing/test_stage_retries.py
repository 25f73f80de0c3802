"""Retries before anything reached the client, none after: a stage call that finds a replica gone or
hung goes on to the next healthy replica within its deadline; a decode stream is retried only
before its first token, and one that breaks later is ABORTED saying the answer is incomplete.
Real grpc.aio servers in this process (a decode service that follows a script per replica), the
gateway's real `ReplicaPool` and `RemoteDecodeStage`; plus the routing loads read over the real
LoadService."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from epd.gateway.engine_load import refresh_routing_loads
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import PrefillHandle
from epd.stages.engine_core import EngineLoad
from epd.stages.errors import Busy, ResourceExhausted
from epd.transport.errors import UpstreamError, rpc_errors
from epd.transport.load_servicer import with_load_service
from epd.transport.remote_decode import RemoteDecodeStage
from epd.transport.replica_pool import ReplicaPool
from epd.v1 import decode_pb2, decode_pb2_grpc
from epd.video.decord_backend import DECODER_CRASHED
from epd.video.types import DecoderCrashed
from tests.unit.plumbing.grpc_fakes import start_server, unary

TIMEOUT_S = 20.0
KEY = "cd" * 32


class _CrashingDecoder:
    """A service method that fails as an encoder does when its decord child dies mid-request,
    through the real error mapping (`rpc_errors`)."""

    @rpc_errors
    async def who(self, request: bytes, context) -> bytes:
        raise DecoderCrashed(DECODER_CRASHED)


def _methods(name: bytes, calls: list[bytes], behaviour: str) -> dict[str, grpc.RpcMethodHandler]:
    async def who(request: bytes, context) -> bytes:
        calls.append(name)
        if behaviour == "decoder-crashed":
            return await _CrashingDecoder().who(request, context)
        if behaviour == "hang":
            await asyncio.sleep(TIMEOUT_S)
        if behaviour == "own-deadline":  # the service's own answer, not our attempt timeout
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the media took too long to decode")
        return name

    return {"Who": grpc.unary_unary_rpc_method_handler(who)}


def _who(channel: grpc.aio.Channel, timeout_s: float):
    return unary(channel, "Who")(b"", timeout=timeout_s)


async def _servers(behaviours: dict[bytes, str], calls: list[bytes]):
    started = {name: await start_server(_methods(name, calls, b)) for name, b in behaviours.items()}
    return {name: address for name, (_, address) in started.items()}, [s for s, _ in started.values()]


def test_a_hung_replica_is_left_for_the_next_within_the_deadline_and_held_back():
    async def scenario():
        calls: list[bytes] = []
        names, servers = await _servers({b"hang": "hang", b"ok": "ok"}, calls)
        pool = ReplicaPool([names[b"hang"], names[b"ok"]], attempt_timeout_s=0.5)
        try:
            # No key: least loaded, ties in turn; the first call's first choice is the hung one.
            assert await pool.call("", _who, "encode", "r", TIMEOUT_S) == b"ok"
            assert calls == [b"hang", b"ok"]
            assert pool.chooser.healthy() == [names[b"ok"]]  # held back, hung: a health check won't undo it
            pool.set_serving(names[b"hang"], True)
            assert pool.chooser.healthy() == [names[b"ok"]]
            # The whole call's timeout (a duration, `timeout_s`, as every other one) shorter than
            # the attempt timeout: its expiry is not a hang, no retry.
            pool.chooser._failed_until.clear()  # noqa: SLF001 - try the hung one first again
            calls.clear()
            pool.chooser._turn = 0  # noqa: SLF001
            with pytest.raises(UpstreamError) as err:
                await pool.call("", _who, "encode", "r", timeout_s=0.3)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and calls == [b"hang"]
        finally:
            await pool.close()
            for s in servers:
                await s.stop(0)

    asyncio.run(scenario())


def _the_first_replica_fails(behaviour: str) -> tuple[UpstreamError, list[bytes], bool]:
    """(the call's error, the replicas called, whether every replica is still in routing) when the
    first of two replicas fails with `behaviour` and the second would answer."""

    async def scenario():
        calls: list[bytes] = []
        names, servers = await _servers({b"first": behaviour, b"ok": "ok"}, calls)
        pool = ReplicaPool([names[b"first"], names[b"ok"]], attempt_timeout_s=5.0)
        try:
            with pytest.raises(UpstreamError) as err:
                await pool.call("", _who, "encode", "r", TIMEOUT_S)
            return err.value, calls, pool.chooser.healthy() == pool.addresses
        finally:
            await pool.close()
            for s in servers:
                await s.stop(0)

    return asyncio.run(scenario())


def test_a_services_own_deadline_status_is_the_requests_and_not_retried():
    error, calls, all_in_routing = _the_first_replica_fails("own-deadline")
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and calls == [b"first"]
    assert all_in_routing


def test_a_decoder_crash_is_the_requests_failure_not_its_replicas_and_keeps_its_message():
    """The encoder answers UNAVAILABLE when its decord child dies (the replica serves on, with a
    fresh child). The gateway took it for a lost replica: it held the replica back, sent the
    request to the next one (a video that crashes decord crashed each replica's child in turn),
    and replaced the message by "encode stage unavailable"."""
    error, calls, all_in_routing = _the_first_replica_fails("decoder-crashed")
    assert (error.code, str(error)) == (grpc.StatusCode.UNAVAILABLE, DECODER_CRASHED)
    assert calls == [b"first"]  # not tried again on the other replica
    assert all_in_routing  # not held back


def test_removed_replicas_get_no_calls_and_added_ones_do():
    async def scenario():
        calls: list[bytes] = []
        names, servers = await _servers({b"a": "ok", b"b": "ok"}, calls)
        pool = ReplicaPool([names[b"a"]])
        try:
            assert await pool.call(KEY, _who, "prefill", "r", TIMEOUT_S) == b"a"
            assert pool.set_addresses([names[b"b"]]) == ([names[b"b"]], [names[b"a"]])
            assert [await pool.call(KEY, _who, "prefill", "r", TIMEOUT_S) for _ in range(3)] == [b"b"] * 3
            assert pool.addresses == [names[b"b"]] and len(pool.channels) == 1
            assert pool.set_addresses([names[b"b"], names[b"a"]]) == ([names[b"a"]], [])
            answers = {await pool.call("", _who, "decode", "r", TIMEOUT_S) for _ in range(4)}
            assert answers == {b"a", b"b"}
        finally:
            await pool.close()
            for s in servers:
                await s.stop(0)

    asyncio.run(scenario())


def test_a_replica_removed_while_a_call_runs_gets_no_retry():
    """The replica file drops a replica while a call hangs on another: the retry does not go to
    the removed one, whose channel closed when the file was applied (a call on a closed channel
    made gRPC core crash the gateway, SIGSEGV)."""

    async def scenario():
        calls: list[bytes] = []
        names, servers = await _servers({b"hang": "hang", b"ok": "ok", b"new": "ok"}, calls)
        pool = ReplicaPool([names[b"hang"], names[b"ok"]], attempt_timeout_s=0.5)
        tried_closed: list[str] = []

        async def who(channel: grpc.aio.Channel, timeout_s: float) -> bytes:
            if channel not in pool.channels:  # never make the call that crashes the process
                tried_closed.append("a removed replica's channel")
                return b"removed"
            return await _who(channel, timeout_s)

        async def remove_ok() -> None:
            await asyncio.sleep(0.1)
            pool.set_addresses([names[b"hang"], names[b"new"]])

        try:
            # No key: ties in turn, the first call's first choice is the hung replica.
            remove = asyncio.ensure_future(remove_ok())
            with pytest.raises(UpstreamError) as err:
                await pool.call("", who, "encode", "r", TIMEOUT_S)
            await remove
            assert tried_closed == [] and calls == [b"hang"]
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            # The next call routes over the new list.
            assert await pool.call("", who, "encode", "r", TIMEOUT_S) == b"new"
        finally:
            await pool.close()
            for s in servers:
                await s.stop(0)

    asyncio.run(scenario())


class _Decoder(decode_pb2_grpc.DecodeServiceServicer):
    """A decode replica that follows a script: "ok" streams 3 tokens, "dead" is UNAVAILABLE before
    its first token, "hang" sends nothing, "breaks" sends 2 tokens and then fails, "kv-gone"
    says the KV cache is unknown (as a real decoder whose pull found it taken), "full" is busy
    (its KV memory and wait queue full: `Busy` through the real error mapping), "too-long" refuses
    the request itself as too large for its memory (not busy)."""

    def __init__(self, behaviour: str, calls: list[str]) -> None:
        self.behaviour = behaviour
        self.calls = calls

    @rpc_errors
    async def Generate(self, request, context):
        self.calls.append(self.behaviour)
        if self.behaviour == "full":
            raise Busy("the decoder's KV memory is full")
        if self.behaviour == "too-long":
            raise ResourceExhausted("this request needs more KV memory than the decoder has")
        if self.behaviour == "dead":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        if self.behaviour == "hang":
            await asyncio.sleep(TIMEOUT_S)
        if self.behaviour == "kv-gone":
            await context.abort(grpc.StatusCode.NOT_FOUND, "KV cache 'h' is unknown or expired")
        for i in range(3):
            if self.behaviour == "breaks" and i == 2:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "socket closed")
            yield decode_pb2.GenerateResponse(token_ids=[10 + i], text=f"t{i}")


async def _decoders(behaviours: list[str], calls: list[str]) -> tuple[list[grpc.aio.Server], list[str]]:
    servers, addresses = [], []
    for b in behaviours:
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(_Decoder(b, calls), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    return servers, addresses


HANDLE = PrefillHandle(first_token_id=1, num_prompt_tokens=4, num_cached_tokens=4, next_position_ids=[4, 4, 4, 4],
                       kv_num_bytes=64, prefill_ms=1.0, kv_handle="h", kv_address="127.0.0.1:1")  # fmt: skip


async def _generate(behaviours: list[str], attempt_timeout_s: float = 0.0) -> tuple[list[int], list[str]]:
    calls: list[str] = []
    servers, addresses = await _decoders(behaviours, calls)
    stage = RemoteDecodeStage(ReplicaPool(addresses, attempt_timeout_s=attempt_timeout_s), TIMEOUT_S)
    tokens: list[int] = []
    try:
        async for step in stage.generate(HANDLE, GenerationConfig(), "req-1"):
            tokens += step.token_ids
        return tokens, calls
    except UpstreamError as exc:
        exc.tokens, exc.calls = tokens, calls  # type: ignore[attr-defined]
        raise
    finally:
        await stage.close()
        for s in servers:
            await s.stop(0)


def test_decode_is_retried_on_another_replica_before_its_first_token():
    assert asyncio.run(_generate(["dead", "ok"])) == ([10, 11, 12], ["dead", "ok"])
    assert asyncio.run(_generate(["hang", "ok"], attempt_timeout_s=0.5)) == ([10, 11, 12], ["hang", "ok"])


def test_a_decode_replica_removed_while_a_stream_waits_gets_no_retry(monkeypatch):
    """As for encode and prefill: the decode retry skips a replica the replica file removed."""
    import types

    import epd.transport.remote_decode as remote_decode

    async def scenario():
        calls: list[str] = []
        servers, addresses = await _decoders(["hang", "ok", "ok"], calls)
        pool = ReplicaPool(addresses[:2], attempt_timeout_s=0.5)
        closed: list[str] = []

        def stub(channel: grpc.aio.Channel):
            if channel not in pool.channels:  # never make the call that crashes the process
                closed.append("a removed replica's channel")
                raise AssertionError("a decode call on a removed replica's channel")
            return decode_pb2_grpc.DecodeServiceStub(channel)

        monkeypatch.setattr(remote_decode, "decode_pb2_grpc", types.SimpleNamespace(DecodeServiceStub=stub))
        stage = RemoteDecodeStage(pool, TIMEOUT_S)

        async def remove_second() -> None:
            await asyncio.sleep(0.1)
            pool.set_addresses([addresses[0], addresses[2]])

        remove = asyncio.ensure_future(remove_second())
        try:
            with pytest.raises(UpstreamError) as err:
                async for _ in stage.generate(HANDLE, GenerationConfig(), "req-1"):
                    pass
            await remove
            return err.value.code, calls, closed
        finally:
            await pool.close()
            for s in servers:
                await s.stop(0)

    code, calls, closed = asyncio.run(scenario())
    assert closed == [] and calls == ["hang"] and code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_decode_retry_that_finds_the_kv_cache_gone_says_so():
    with pytest.raises(UpstreamError) as err:
        asyncio.run(_generate(["dead", "kv-gone"]))
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert "unknown or expired" in str(err.value) and "retried" in str(err.value)


def test_a_decode_replica_that_fails_after_the_first_token_aborts_the_answer():
    with pytest.raises(UpstreamError) as err:
        asyncio.run(_generate(["breaks", "ok"]))
    assert err.value.code == grpc.StatusCode.ABORTED
    assert "after 2 tokens" in str(err.value) and "incomplete" in str(err.value) and "req-1" in str(err.value)
    assert err.value.tokens == [10, 11] and err.value.calls == ["breaks"]  # type: ignore[attr-defined]
    assert "127.0.0.1" not in str(err.value)  # addresses go to the server log, not to the client


def test_a_full_decode_replica_is_left_for_one_with_room_and_all_full_is_busy():
    """Full is not failed: the next replica is asked before the first token; when every replica is
    full the busy error (RESOURCE_EXHAUSTED with its retry mark) is the call's, for the pipeline to
    wait on. A request too large for a decoder is its own error, not retried."""
    assert asyncio.run(_generate(["full", "ok"])) == ([10, 11, 12], ["full", "ok"])
    with pytest.raises(UpstreamError) as err:
        asyncio.run(_generate(["full", "full"]))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.retry_after_s == 1
    assert err.value.calls == ["full", "full"]  # type: ignore[attr-defined]
    with pytest.raises(UpstreamError) as err:
        asyncio.run(_generate(["too-long", "ok"]))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.retry_after_s is None
    assert err.value.calls == ["too-long"]  # type: ignore[attr-defined]


def test_all_decode_replicas_down_is_unavailable():
    with pytest.raises(UpstreamError) as err:
        asyncio.run(_generate(["dead", "dead"]))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.calls == ["dead", "dead"]  # type: ignore[attr-defined]


def test_routing_loads_come_from_each_replicas_load_service():
    async def scenario():
        loads = {
            "busy": [
                EngineLoad("prefill", num_running=2, num_waiting=5),
                EngineLoad("video_decode", num_running=1),
            ],
            "idle": [EngineLoad("prefill")],
        }
        servers, addresses = [], {}
        for name, answer in loads.items():
            server = grpc.aio.server()
            with_load_service(lambda s: None, lambda answer=answer: answer)(server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            servers.append(server)
            addresses[name] = f"127.0.0.1:{port}"
        pool = ReplicaPool([addresses["busy"], addresses["idle"], "127.0.0.1:1"])
        try:
            pool.begin("127.0.0.1:1")
            await refresh_routing_loads({"prefill": pool}, TIMEOUT_S)
            return [pool.chooser.load(a) for a in pool.addresses], [
                pool.pick() is pool.channel(addresses["idle"])
            ]
        finally:
            await pool.close()
            for s in servers:
                await s.stop(0)

    loads, picked_idle = asyncio.run(scenario())
    assert loads == [8, 0, 1]  # running + waiting over the cores; no answer: our own call only
    assert picked_idle == [True]


def test_a_call_before_the_stage_is_ready_logs_one_line_saying_so(caplog):
    """Before any replica of a stage has served, every early request's call is refused: it logged
    two WARNING lines (the replica's, then the status's) burying the start-up's own; one now, that
    says the stage is not ready. Once a replica has served, a lost one is named as lost."""
    from epd.transport.ports_file import free_port

    async def call(pool: ReplicaPool) -> UpstreamError:
        with pytest.raises(UpstreamError) as err:
            await pool.call("", _who, "prefill", "r1", TIMEOUT_S)
        return err.value

    async def scenario() -> tuple[UpstreamError, UpstreamError]:
        pool = ReplicaPool([f"127.0.0.1:{free_port()}"])
        try:
            early = await call(pool)
            pool.set_serving(pool.addresses[0], True)  # a health check found it serving, then it went
            late = await call(pool)
        finally:
            await pool.close()
        return early, late

    with caplog.at_level("WARNING"):
        early, late = asyncio.run(scenario())
    assert early.code == late.code == grpc.StatusCode.UNAVAILABLE  # the 503 of today
    assert str(early) == "prefill stage unavailable (request id r1)"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings  # one per call
    assert warnings[0].startswith(
        "request r1: the prefill stage is not ready (no replica has served yet): 127.0.0.1:"
    )
    assert "unavailable" in warnings[0]
    assert "no replica left to try" in warnings[1] and "not ready" not in warnings[1]
