"""`ReplicaPool.call`: a keyed call goes to its rendezvous home, a call that fails with UNAVAILABLE
is tried on the next replica (each healthy one once), other errors are not retried, and the gateway's health checks
(`StageHealth`) steer calls around a replica that does not serve. Real grpc.aio servers in this
process that answer with their own name."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epd.gateway.config import GatewayConfig
from epd.gateway.readiness import StageHealth
from epd.transport.affinity import rendezvous_order
from epd.transport.errors import UpstreamError
from epd.transport.remote_stages import ReplicaPool
from tests.stack import free_port
from tests.unit.plumbing.grpc_fakes import SERVICE, start_server, unary

TIMEOUT_S = 10.0
KEY = "ab" * 32


def _named(name: bytes, calls: list[bytes]) -> dict[str, grpc.RpcMethodHandler]:
    async def who(request: bytes, context) -> bytes:
        calls.append(name)
        if request == b"invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
        return name

    return {"Who": grpc.unary_unary_rpc_method_handler(who)}


def _who(request: bytes = b""):
    async def attempt(channel: grpc.aio.Channel, timeout_s: float) -> bytes:
        return await unary(channel, "Who")(request, timeout=timeout_s)

    return attempt


async def _servers(names: list[bytes], calls: list[bytes]):
    started = [await start_server(_named(name, calls)) for name in names]
    return {address: (server, name) for (server, address), name in zip(started, names)}


def test_a_keyed_call_goes_home_and_falls_back_in_order_when_replicas_are_gone():
    async def scenario():
        calls: list[bytes] = []
        servers = await _servers([b"a", b"b", b"c"], calls)
        pool = ReplicaPool(list(servers))
        order = rendezvous_order(KEY, pool.addresses)
        name = {address: servers[address][1] for address in servers}
        try:
            first = [await pool.call(KEY, _who(), "prefill", "r", TIMEOUT_S) for _ in range(3)]
            assert first == [name[order[0]]] * 3
            await servers[order[0]][0].stop(0)
            calls.clear()
            after = await pool.call(KEY, _who(), "prefill", "r", TIMEOUT_S)  # UNAVAILABLE at home, next
            assert after == name[order[1]] and calls == [name[order[1]]]
            # Home is now held back: the next call goes straight to the second choice.
            assert pool.candidates(KEY)[0][0] == order[1]
            # Not retried: an error of the request itself.
            calls.clear()
            with pytest.raises(UpstreamError) as err:
                await pool.call(KEY, _who(b"invalid"), "prefill", "r", TIMEOUT_S)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and calls == [name[order[1]]]
            # Every healthy replica is tried once: with home and its second gone, the third answers.
            await servers[order[1]][0].stop(0)
            pool.chooser._failed_until.clear()  # noqa: SLF001 - forget the hold, try home first again
            calls.clear()
            assert await pool.call(KEY, _who(), "prefill", "r", TIMEOUT_S) == name[order[2]]
            assert calls == [name[order[2]]]
            # All gone: UNAVAILABLE is the stage's error.
            await servers[order[2]][0].stop(0)
            pool.chooser._failed_until.clear()  # noqa: SLF001
            with pytest.raises(UpstreamError) as err:
                await pool.call(KEY, _who(), "prefill", "r", TIMEOUT_S)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            await pool.close()
            for server, _ in servers.values():
                await server.stop(0)

    asyncio.run(scenario())


def test_calls_without_a_key_go_round_robin():
    async def scenario():
        calls: list[bytes] = []
        servers = await _servers([b"a", b"b"], calls)
        pool = ReplicaPool(list(servers))
        try:
            return [await pool.call("", _who(), "decode", "r", TIMEOUT_S) for _ in range(4)]
        finally:
            await pool.close()
            for server, _ in servers.values():
                await server.stop(0)

    assert asyncio.run(scenario()) == [b"a", b"b", b"a", b"b"]


async def _health_server(status) -> tuple[grpc.aio.Server, str, health.aio.HealthServicer]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", servicer


def test_the_health_checks_tell_the_pools_which_replicas_serve():
    async def scenario():
        serving, a, _ = await _health_server(health_pb2.HealthCheckResponse.SERVING)
        loading, b, b_health = await _health_server(health_pb2.HealthCheckResponse.NOT_SERVING)
        pool = ReplicaPool([a, b])
        config = GatewayConfig(encoder_addresses=(a,), prefill_addresses=(a, b), decode_addresses=(a,))
        checks = StageHealth(config, timeout_s=TIMEOUT_S, pools={"prefill": pool})
        keys = [f"{i:064x}" for i in range(20)]
        try:
            assert await checks.down() == [f"prefill {b}"]
            assert await checks.not_serving() == []  # one prefill replica serves: the stage does
            assert pool.chooser.healthy() == [a]
            assert {pool.candidates(k)[0][0] for k in keys} == {a}
            await b_health.set("", health_pb2.HealthCheckResponse.SERVING)
            assert await checks.down() == []
            assert pool.chooser.healthy() == [a, b]
            assert {pool.candidates(k)[0][0] for k in keys} == {a, b}
            # Every replica of a stage down: that stage is not serving (and the gateway NOT_SERVING).
            await b_health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await serving.stop(0)
            assert await checks.not_serving() == ["decode", "encoder", "prefill"]
            # A reloaded replica list is what the checks follow.
            pool.set_addresses([b])
            assert [address for stage, address in checks.addresses if stage == "prefill"] == [b]
        finally:
            await checks.close()
            await pool.close()
            await serving.stop(0)
            await loading.stop(0)

    asyncio.run(scenario())


def test_a_restarted_replica_serves_again_only_once_its_calls_can_go_out():
    """A replica down long enough that the channel its calls use backs off (up to 2 s between
    reconnects), then listening again: the checks call it serving only once that channel has
    reconnected, so the first call routed to it after that is answered (a check on a channel of
    its own said SERVING at once, and calls failed UNAVAILABLE for the rest of the backoff)."""

    async def scenario():
        port = free_port()  # nothing listening on it yet
        address = f"127.0.0.1:{port}"
        pool = ReplicaPool([address])
        config = GatewayConfig(encoder_addresses=(address,), prefill_addresses=(address,), decode_addresses=(address,))
        checks = StageHealth(config, timeout_s=TIMEOUT_S, pools={"decode": pool})
        loop = asyncio.get_running_loop()
        server = None
        try:
            down_until = loop.time() + 3.0
            while loop.time() < down_until:
                with pytest.raises(UpstreamError) as err:
                    await pool.call("", _who(), "decode", "r", TIMEOUT_S)
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                pool.chooser._failed_until.clear()  # noqa: SLF001 - keep trying the one replica
                await asyncio.sleep(0.1)
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, _named(b"back", [])),))
            servicer = health.aio.HealthServicer()
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
            assert server.add_insecure_port(address) == port
            await server.start()
            serving_by = loop.time() + TIMEOUT_S
            while f"decode {address}" in await checks.down():
                assert loop.time() < serving_by, "never serving again"
                await asyncio.sleep(0.02)
            pool.chooser._failed_until.clear()  # noqa: SLF001
            assert await pool.call("", _who(), "decode", "r", TIMEOUT_S) == b"back"
        finally:
            await checks.close()
            await pool.close()
            if server is not None:
                await server.stop(0)

    asyncio.run(scenario())


def test_a_text_only_conversations_turns_go_to_one_prefill_replica():
    """A conversation without media has no video to key on: each of its turns goes where its first
    turn's prefix cache is (rendezvous on its opening), and different conversations spread. Calls
    without a key went round robin, so a follow-up missed the cache on another replica. Real
    grpc.aio prefill servers that note who got which conversation; the real `RemotePrefillStage`."""
    from epd.model_runtime.sampling import GenerationConfig
    from epd.stages.messages import Message
    from epd.transport.remote_stages import RemotePrefillStage
    from epd.v1 import prefill_pb2

    got: list[tuple[str, str]] = []  # (replica, the conversation's first question)

    def prefill_methods(name: str) -> dict[str, grpc.RpcMethodHandler]:
        async def prefill(requests, context) -> prefill_pb2.PrefillResult:
            header = None
            async for msg in requests:
                header = header or msg.header
            got.append((name, header.messages[1].parts[0].text))
            return prefill_pb2.PrefillResult(kv_handle=header.kv_handle, next_position_ids=[1, 1, 1, 1])

        return {"Prefill": grpc.stream_unary_rpc_method_handler(
            prefill, prefill_pb2.PrefillRequest.FromString, prefill_pb2.PrefillResult.SerializeToString)}

    async def scenario() -> None:
        servers = []
        for name in ("a", "b", "c"):
            server = grpc.aio.server()
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("epd.v1.PrefillService", prefill_methods(name)),))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            servers.append((server, f"127.0.0.1:{port}"))
        pool = ReplicaPool([address for _, address in servers])
        stage = RemotePrefillStage(pool, TIMEOUT_S)
        try:
            for i in range(8):
                question = f"question {i}"
                first = [Message.system("be brief"), Message.user(question)]
                for turn in (first, [*first, Message.assistant("an answer"), Message.user("and then?")]):
                    await stage.prefill(turn, None, GenerationConfig(), f"r{i}")
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    asyncio.run(scenario())
    home: dict[str, set[str]] = {}
    for replica, question in got:
        home.setdefault(question, set()).add(replica)
    assert len(got) == 16
    assert all(len(replicas) == 1 for replicas in home.values()), home
    assert len(set.union(*home.values())) >= 2, "8 conversations all went to one replica"
