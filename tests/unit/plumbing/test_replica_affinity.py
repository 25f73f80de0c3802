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
from epd.transport.ports_file import free_port
from epd.transport.replica_pool import ReplicaPool
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
        # Picked, not bound as port 0: the replica is down (nothing listens) before it serves there;
        # `free_port` holds it meanwhile (no other process can take it; the server below binds it).
        port = free_port()
        address = f"127.0.0.1:{port}"
        pool = ReplicaPool([address])
        config = GatewayConfig(
            encoder_addresses=(address,), prefill_addresses=(address,), decode_addresses=(address,)
        )
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
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(SERVICE, _named(b"back", [])),)
            )
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


def _prefill_replicas(turns) -> tuple[dict[str, str], list[str]]:
    """Each (request id, messages, media or None[, template options]) of `turns(addresses)` prefilled in order through
    the real `RemotePrefillStage` over three real grpc.aio prefill servers on loopback that note
    who got which request: ({request id: replica address}, the addresses)."""
    from epd.model_runtime.sampling import GenerationConfig
    from epd.stages.messages import ChatTemplateOptions
    from epd.transport.remote_prefill import RemotePrefillStage
    from epd.v1 import prefill_pb2

    got: dict[str, str] = {}

    def prefill_methods(address: list[str]) -> dict[str, grpc.RpcMethodHandler]:
        async def prefill(requests, context):
            header = None
            async for msg in requests:
                header = header or msg.header
            got[header.request_id] = address[0]
            result = prefill_pb2.PrefillResult(kv_handle=header.kv_handle, next_position_ids=[1, 1, 1, 1])
            yield prefill_pb2.PrefillResponse(result=result)

        return {
            "Prefill": grpc.stream_stream_rpc_method_handler(
                prefill, prefill_pb2.PrefillRequest.FromString, prefill_pb2.PrefillResponse.SerializeToString
            )
        }

    async def scenario() -> list[str]:
        servers = []
        for _ in range(3):
            address: list[str] = []
            server = grpc.aio.server()
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("epd.v1.PrefillService", prefill_methods(address)),)
            )
            address.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append((server, address[0]))
        pool = ReplicaPool([address for _, address in servers])
        stage = RemotePrefillStage(pool, TIMEOUT_S)
        try:
            for request_id, messages, media, *template in turns([address for _, address in servers]):
                options = template[0] if template else ChatTemplateOptions()
                await stage.prefill(messages, media, GenerationConfig(), request_id, template=options)
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)
        return [address for _, address in servers]

    addresses = asyncio.run(scenario())
    return got, addresses


def test_a_text_only_conversations_turns_go_to_one_prefill_replica():
    """A conversation without media has no video to key on: each of its turns goes where its first
    turn's prefix cache is (rendezvous on its opening), and different conversations spread. Calls
    without a key went round robin, so a follow-up missed the cache on another replica."""
    from epd.stages.messages import Message

    turns = []
    for i in range(8):
        first = [Message.system("be brief"), Message.user(f"question {i}")]
        follow_up = [*first, Message.assistant("an answer"), Message.user("and then?")]
        turns += [(f"c{i}-1", first, None), (f"c{i}-2", follow_up, None)]
    got, _ = _prefill_replicas(lambda addresses: turns)
    assert len(got) == 16
    home = {i: {got[f"c{i}-1"], got[f"c{i}-2"]} for i in range(8)}
    assert all(len(replicas) == 1 for replicas in home.values()), home
    assert len(set.union(*home.values())) >= 2, "8 conversations all went to one replica"


def _media(sha256: str):
    import torch

    from epd.model_runtime.adapter import VisualMeta
    from epd.stages.contracts import EncodedMedia

    return EncodedMedia(
        torch.zeros(3, 2), VisualMeta("video", (1, 2, 6), 1.0, 3), 2, [0.0, 0.5], 1.0, 2.0, sha256=sha256
    )


def test_a_conversation_whose_video_comes_later_stays_on_its_openings_replica():
    """Turns 1-2 text alone, turn 3 brings a video, turn 4 asks about it: the video's turns reuse
    the text turns' prefix (and then each other's), so all four go to the opening's replica (they
    went to the video's from turn 3). Conversations that open with the same video still share the
    video's replica: their prompts agree through the video, whatever their questions."""
    from epd.stages.messages import VIDEO, Message
    from epd.transport.affinity import conversation_key

    turn1 = [Message.user("hello")]
    turn2 = [*turn1, Message.assistant("hi"), Message.user("I will show you a clip")]
    turn3 = [*turn2, Message.assistant("ok, send it"), Message.user(VIDEO, "what moves?")]
    turn4 = [*turn3, Message.assistant("a square"), Message.user("what colour is it?")]
    chosen: dict[str, object] = {}

    def turns(addresses: list[str]) -> list:
        # A video whose own home is not the opening's, and other conversations, whose video comes
        # after another opening, with openings at home on another replica than the video too.
        home = rendezvous_order(conversation_key(turn1), addresses)[0]
        sha = next(s for i in range(100) if rendezvous_order(s := f"{i:064x}", addresses)[0] != home)
        video = chosen["video"] = _media(sha)
        others = [
            m
            for i in range(100)
            if rendezvous_order(
                conversation_key(
                    m := [
                        Message.user(f"hello {i}"),
                        Message.assistant("hi"),
                        Message.user(VIDEO, "what moves?"),
                    ]
                ),
                addresses,
            )[0]
            != rendezvous_order(sha, addresses)[0]
        ][:3]
        chosen["others"] = others
        opening_with_video = [
            [Message.system("be brief"), Message.user(VIDEO, f"question {i}")] for i in range(4)
        ]
        return [
            ("t1", turn1, None),
            ("t2", turn2, None),
            ("t3", turn3, video),
            ("t4", turn4, video),
            *((f"later{i}", m, video) for i, m in enumerate(others)),
            *((f"opens{i}", m, video) for i, m in enumerate(opening_with_video)),
        ]

    got, addresses = _prefill_replicas(turns)
    video_home = rendezvous_order(chosen["video"].sha256, addresses)[0]  # type: ignore[attr-defined]
    assert [got[t] for t in ("t1", "t2", "t3", "t4")] == [
        rendezvous_order(conversation_key(turn1), addresses)[0]
    ] * 4
    assert {got[f"opens{i}"] for i in range(4)} == {video_home}
    for i, messages in enumerate(chosen["others"]):  # type: ignore[arg-type]
        assert got[f"later{i}"] == rendezvous_order(conversation_key(messages), addresses)[0] != video_home


def test_the_prefill_replica_does_not_depend_on_the_requests_tools():
    """Tools are rendered into the prompt, but keying on them would win no prefix-cache hit and
    lose some: a template that renders them does so ahead of the conversation (Qwen's: in its
    system message), so prompts with other tools differ from there on and share nothing through
    the video or the opening wherever they go; a template that does not read them (the shipped
    model's) renders the same prompt with any tools, which must then share one replica. So the
    conversations about one video, and the turns of one text-only conversation, with any tools or
    none, each go to one home."""
    from epd.stages.messages import VIDEO, ChatTemplateOptions, Message
    from epd.transport.affinity import conversation_key
    from tests.tool_data import TOOLS

    weather = TOOLS[0]
    tool_sets = [
        (),
        *(({**weather, "function": {**weather["function"], "name": f"f{i}"}},) for i in range(8)),
    ]
    sha = "7" * 64
    opening = [Message.system("be brief"), Message.user("hello")]
    follow_up = [*opening, Message.assistant("hi"), Message.user("and then?")]
    about_video = [
        (
            f"v{i}",
            [Message.system("be brief"), Message.user(VIDEO, f"question {i}")],
            _media(sha),
            ChatTemplateOptions(tools=tools),
        )
        for i, tools in enumerate(tool_sets)
    ]
    text_only = [
        (f"t{i}", follow_up if i % 2 else opening, None, ChatTemplateOptions(tools=tools))
        for i, tools in enumerate(tool_sets)
    ]
    got, addresses = _prefill_replicas(lambda addresses: about_video + text_only)
    assert {got[f"v{i}"] for i in range(len(tool_sets))} == {rendezvous_order(sha, addresses)[0]}
    opening_home = rendezvous_order(conversation_key(opening), addresses)[0]
    assert {got[f"t{i}"] for i in range(len(tool_sets))} == {opening_home}
