"""`dns:///NAME:PORT` stage addresses (`epd.gateway.dns_replicas`, `epd.gateway.replica_list.
ReplicaUpdater`): one replica per address NAME resolves to, looked up with an injected function
(no DNS); changes applied to real replica pools (their channels connect to nothing); a failed
lookup never empties a stage; the TLS check of a resolved address is against NAME (a real TLS
server on loopback)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.gateway.config import GatewayConfig
from epd.gateway.dns_replicas import DnsName, ReplicaSets, parse_dns_entry, replica_address
from epd.gateway.readiness import StageHealth
from epd.gateway.replica_list import ReplicaFileError, ReplicaListWatcher, ReplicaUpdater, parse_replicas
from epd.gateway.server import remote_pipeline, stage_pools, start
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import PrefillHandle
from epd.stages.server_config import ServerConfig, TransportSecurity
from epd.transport import security
from epd.transport.errors import UpstreamError
from epd.transport.remote_decode import RemoteDecodeStage
from epd.transport.remote_prefill import RemotePrefillStage
from epd.transport.replica_pool import ReplicaPool
from epd.transport.server import create_server
from epd.v1 import prefill_pb2

ENCODER = "dns:///encoder-headless:50051"
NAME = DnsName("encoder-headless", 50051)


def test_entries_parse_and_a_malformed_one_says_what_to_write():
    assert parse_dns_entry(ENCODER) == NAME
    assert parse_dns_entry("dns:///Encoder-Headless:50051") == NAME
    assert parse_dns_entry("dns:///[::1]:7") == DnsName("::1", 7)
    for dialled_as_written in (
        "10.0.0.5:50051",
        "encoder:50051",
        "dns://8.8.8.8/encoder:50051",
        "ipv4:1.2.3.4:5",
    ):
        assert parse_dns_entry(dialled_as_written) is None
    for bad in (
        "dns:///encoder-headless",
        "dns:///encoder-headless:0",
        "dns:///:50051",
        "dns:///a b:1",
        "dns:///::1:7",
        "dns:///e:70000",
    ):
        with pytest.raises(ValueError, match="is not dns:///NAME:PORT"):
            parse_dns_entry(bad)
    assert replica_address("fd00::5", 50051) == "[fd00::5]:50051"
    assert replica_address("10.0.0.5", 50051) == "10.0.0.5:50051"


def test_a_malformed_entry_is_refused_at_start_naming_the_flag_or_the_file():
    with pytest.raises(ValueError, match="--prefill: stage address 'dns:///prefill-headless' is not"):
        GatewayConfig(prefill_addresses=("dns:///prefill-headless",))
    with pytest.raises(ReplicaFileError, match="decode: stage address 'dns:///d' is not"):
        parse_replicas('{"decode": ["dns:///d"]}')


def test_a_name_becomes_one_replica_per_address_with_its_tls_name():
    sets = ReplicaSets({"encoder": [ENCODER, "10.0.0.9:50051", "dns:///other:50051"], "decode": ["d:3"]})
    # Not looked up yet: listed as written, a placeholder that gets no call (`unresolved`).
    assert sets.expanded("encoder").addresses == (ENCODER, "10.0.0.9:50051", "dns:///other:50051")
    assert sets.pending() == [NAME, DnsName("other", 50051)]
    assert sets.record(NAME, ["10.0.0.2", "10.0.0.1", "fd00::1", "10.0.0.1"]) is None
    assert sets.record(DnsName("other", 50051), ["10.0.0.2", "10.0.0.3"]) is None
    listed = sets.expanded("encoder")
    # Each address once (the first name listing it wins it), entries in order, a name's sorted.
    assert listed.addresses == ("10.0.0.1:50051", "10.0.0.2:50051", "[fd00::1]:50051", "10.0.0.9:50051",
                                "10.0.0.3:50051")  # fmt: skip
    assert listed.server_names == {"10.0.0.1:50051": "encoder-headless", "10.0.0.2:50051": "encoder-headless",
                                   "[fd00::1]:50051": "encoder-headless", "10.0.0.3:50051": "other"}  # fmt: skip
    assert sets.expanded("decode").addresses == ("d:3",) and sets.pending() == []


def test_a_failed_or_empty_lookup_keeps_the_last_addresses_and_is_logged_once_per_change():
    sets = ReplicaSets({"encoder": [ENCODER]})
    failure = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    first = sets.record(NAME, failure)  # at start-up: no pod ready yet
    assert first is not None and "does not resolve (Name or service not known) yet" in first
    assert (
        "no calls go to it until a lookup finds its addresses" in first and sets.record(NAME, failure) is None
    )
    assert sets.expanded("encoder").addresses == (ENCODER,)
    assert (
        sets.record(NAME, ["10.0.0.1", "10.0.0.2"])
        == f"{ENCODER} resolves again: 10.0.0.1:50051, 10.0.0.2:50051"
    )
    for blip in (failure, []):  # a DNS blip, or a name with no address: the stage keeps its replicas
        message = sets.record(NAME, blip)
        assert message is not None and "keeping its last addresses 10.0.0.1:50051, 10.0.0.2:50051" in message
        assert sets.record(NAME, blip) is None and sets.record(NAME, failure) is None
        assert sets.expanded("encoder").addresses == ("10.0.0.1:50051", "10.0.0.2:50051")
        assert sets.record(NAME, ["10.0.0.2"]) is not None
        assert sets.expanded("encoder").addresses == ("10.0.0.2:50051",)
        sets.record(NAME, ["10.0.0.1", "10.0.0.2"])
    assert "resolves to no address" in (sets.record(NAME, []) or "")


def test_a_reconfigured_stage_forgets_the_names_it_no_longer_lists():
    sets = ReplicaSets({"encoder": [ENCODER], "prefill": ["p:2"]})
    sets.record(NAME, ["10.0.0.1"])
    sets.configure({"encoder": ["e:1"]})
    assert sets.names() == [] and sets.expanded("prefill").addresses == ("p:2",)
    assert sets.record(NAME, ["10.0.0.2"]) is None and sets.pending() == []  # a lookup that was under way
    sets.configure({"encoder": [ENCODER]})
    assert sets.never_looked_up() == [NAME] and sets.expanded("encoder").addresses == (ENCODER,)


class FakeDns:
    """An injected lookup: name -> addresses, or an OSError to raise."""

    def __init__(self, **answers: list[str] | OSError) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        answer = self.answers[host.replace("-", "_")]
        if isinstance(answer, OSError):
            raise answer
        return answer


def test_lookups_reach_the_pools_through_the_updater_and_a_blip_changes_nothing(caplog):
    dns = FakeDns(encoder_headless=["10.0.0.1", "10.0.0.2"])

    async def scenario():
        pools = {"encoder": ReplicaPool([ENCODER, "10.0.0.9:50051"]), "decode": ReplicaPool(["d:3"])}
        updater = ReplicaUpdater(pools, lookup=dns)
        try:
            await updater.refresh()
            assert pools["encoder"].addresses == ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.9:50051"]
            assert pools["encoder"].server_name("10.0.0.1:50051") == "encoder-headless"
            assert pools["encoder"].server_name("10.0.0.9:50051") == ""
            # A pod goes, one comes: the same path as a reloaded replica file (added, removed).
            dns.answers["encoder_headless"] = ["10.0.0.2", "10.0.0.3"]
            await updater.refresh()
            assert pools["encoder"].addresses == ["10.0.0.2:50051", "10.0.0.3:50051", "10.0.0.9:50051"]
            with caplog.at_level(logging.WARNING, logger="epd.gateway.replica_list"):
                dns.answers["encoder_headless"] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure")
                await updater.refresh()
                await updater.refresh()
            assert pools["encoder"].addresses == ["10.0.0.2:50051", "10.0.0.3:50051", "10.0.0.9:50051"]
            assert sum("keeping its last addresses" in r.getMessage() for r in caplog.records) == 1
            assert pools["decode"].addresses == ["d:3"]
        finally:
            for pool in pools.values():
                await pool.close()

    asyncio.run(scenario())


def test_the_updater_looks_names_up_again_every_interval_and_a_name_not_found_yet_sooner():
    dns = FakeDns(encoder_headless=socket.gaierror(socket.EAI_NONAME, "Name or service not known"))

    async def scenario():
        pool = ReplicaPool([ENCODER])
        updater = ReplicaUpdater({"encoder": pool}, lookup=dns)
        task = asyncio.ensure_future(updater.run(interval_s=0.05))
        try:
            await updater.refresh()
            assert pool.addresses == [ENCODER]  # no pod ready yet: a placeholder, no calls
            dns.answers["encoder_headless"] = ["10.0.0.1"]
            for _ in range(200):
                if pool.addresses == ["10.0.0.1:50051"]:
                    break
                await asyncio.sleep(0.02)
            assert pool.addresses == ["10.0.0.1:50051"]
            dns.answers["encoder_headless"] = ["10.0.0.1", "10.0.0.4"]
            for _ in range(200):
                if len(pool.addresses) == 2:
                    break
                await asyncio.sleep(0.02)
            assert pool.addresses == ["10.0.0.1:50051", "10.0.0.4:50051"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await pool.close()

    asyncio.run(scenario())


def test_with_no_refresh_interval_a_found_name_is_not_looked_up_again_but_a_missing_one_is():
    dns = FakeDns(encoder_headless=["10.0.0.1"], prefill_headless=OSError("no pod ready"))

    async def scenario():
        pools = {"encoder": ReplicaPool([ENCODER]), "prefill": ReplicaPool(["dns:///prefill-headless:50052"])}
        updater = ReplicaUpdater(pools, lookup=dns)
        await updater.refresh()
        task = asyncio.ensure_future(updater.run(interval_s=0))
        try:
            dns.answers["encoder_headless"] = ["10.0.0.7"]
            dns.answers["prefill_headless"] = ["10.0.0.2"]
            for _ in range(100):
                if pools["prefill"].addresses == ["10.0.0.2:50052"]:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.2)  # past another retry period: the found names stay as they were
            return {stage: pool.addresses for stage, pool in pools.items()}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for pool in pools.values():
                await pool.close()

    assert asyncio.run(scenario()) == {"encoder": ["10.0.0.1:50051"], "prefill": ["10.0.0.2:50052"]}
    assert dns.asked.count("encoder-headless") == 1 and dns.asked.count("prefill-headless") >= 2


def test_a_name_the_replica_file_adds_is_looked_up_before_it_is_applied(tmp_path):
    path = tmp_path / "replicas.yaml"
    path.write_text(f"encoder: ['{ENCODER}']\n")
    dns = FakeDns(encoder_headless=["10.0.0.1", "10.0.0.2"])

    async def scenario():
        pools = {"encoder": ReplicaPool(["e:1"])}
        try:
            assert await ReplicaListWatcher(path, ReplicaUpdater(pools, lookup=dns)).reload()
            return pools["encoder"].addresses
        finally:
            await pools["encoder"].close()

    assert asyncio.run(scenario()) == ["10.0.0.1:50051", "10.0.0.2:50051"]
    assert dns.asked == ["encoder-headless"]


def test_a_name_not_found_yet_gets_no_call_and_its_stage_is_not_serving_until_the_lookup_lands():
    """`localhost` resolves for gRPC's own resolver, not (yet) for the gateway's lookup: a name
    dialled as written answered its health check SERVING, the gateway served, and calls went to
    whatever gRPC picked, past the router (and, with TLS, to prefill pods whose advertised IPs had
    no name to be checked against). Now the stage has no replica until the lookup lands."""
    dns = FakeDns(localhost=socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    config = GatewayConfig(encoder_addresses=("unused:1",), prefill_addresses=("unused:2",),
                           decode_addresses=("unused:3",))  # fmt: skip

    async def scenario():
        server = await create_server(ServerConfig(host="127.0.0.1", port=0), lambda s: None, [])
        await server.set_serving()
        serving = f"127.0.0.1:{server.port}"
        pools = {"encoder": ReplicaPool([f"dns:///localhost:{server.port}"]),
                 "prefill": ReplicaPool([serving]), "decode": ReplicaPool([serving])}  # fmt: skip
        health = StageHealth(config, timeout_s=10, pools=pools)
        called: list[str] = []

        async def attempt(channel: grpc.aio.Channel, timeout_s: float) -> str:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
            called.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            return "answered"

        try:
            updater = ReplicaUpdater(pools, lookup=dns)
            await updater.refresh()
            before = await health.status()
            with pytest.raises(UpstreamError) as refused:
                await pools["encoder"].call("", attempt, "encode", "r1", 10)
            handle = PrefillHandle(first_token_id=0, num_prompt_tokens=1, num_cached_tokens=0,
                                   next_position_ids=[1, 1, 1, 1], kv_num_bytes=0, prefill_ms=0.0,
                                   kv_handle="h1", kv_address=serving)  # fmt: skip
            with pytest.raises(UpstreamError, match=r"^decode stage unavailable \(request id r1\)$"):
                async for _ in RemoteDecodeStage(pools["encoder"], 10).generate(
                    handle, GenerationConfig(), "r1"
                ):
                    pass  # (the encoder's pool: a decode stream is refused the same way)
            dns.answers["localhost"] = ["127.0.0.1"]
            await updater.refresh()
            after = await health.status()
            answered = await pools["encoder"].call("", attempt, "encode", "r2", 10)
            return before, refused.value, after, answered, called, pools["encoder"].addresses, serving
        finally:
            await health.close()
            for pool in pools.values():
                await pool.close()
            await server.stop(0)

    before, refused, after, answered, called, addresses, serving = asyncio.run(scenario())
    assert before == (["encoder"], [f"encoder dns:///localhost:{serving.rsplit(':', 1)[1]}"]), before
    assert (refused.code, str(refused)) == (
        grpc.StatusCode.UNAVAILABLE,
        "encode stage unavailable (request id r1)",
    )
    assert after == ([], []) and addresses == [serving]
    assert answered == "answered" and called == ["SERVING"]  # the one call made after the lookup


class HangingDns:
    """An injected lookup that hangs (a DNS server that does not answer) until `answer` is set."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.answer = threading.Event()
        self.asked = threading.Event()

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.set()
        self.answer.wait()
        return self.addresses


async def _health(port: int, service: str = "") -> str:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=10)  # fmt: skip
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_the_gateway_serves_its_health_while_a_lookup_hangs_and_expands_the_name_once_it_answers():
    """`remote_pipeline` builds the pools from the names as written and looks them up
    once it serves: with the lookup hung, the gateway answers its probes at once (liveness SERVING,
    readiness NOT_SERVING: no stage has a replica serving); when the lookup answers, the name
    becomes its addresses. Before, `start` (and `main`, before anything bound) awaited the lookup."""
    config = GatewayConfig(server=ServerConfig(port=0), encoder_addresses=("dns:///encoder-headless:1",),
                           dns_refresh_interval_s=0, stage_check_interval_s=0.2)  # fmt: skip
    dns = HangingDns(["10.0.0.1", "10.0.0.2"])

    async def scenario():
        pipeline = remote_pipeline(config)
        pool = stage_pools(pipeline)["encoder"]
        hs = await asyncio.wait_for(start(config, pipeline, lookup=dns), 30)  # a deadline, not a timing
        try:
            assert await asyncio.to_thread(dns.asked.wait, 30)
            assert not dns.answer.is_set() and pool.addresses == ["dns:///encoder-headless:1"]
            assert await _health(hs.port, "liveness") == "SERVING"
            assert await _health(hs.port) == "NOT_SERVING"
            dns.answer.set()
            for _ in range(300):
                if pool.addresses != ["dns:///encoder-headless:1"]:
                    break
                await asyncio.sleep(0.05)
            assert await _health(hs.port) == "NOT_SERVING"  # nothing listens at the addresses
            return pool.addresses
        finally:
            dns.answer.set()
            await hs.stop(0)
            await pipeline.aclose()

    assert asyncio.run(scenario()) == ["10.0.0.1:1", "10.0.0.2:1"]


@pytest.fixture
def tls_files(tmp_path):
    """A CA, and a server certificate that names stage.epd.test only (not 127.0.0.1)."""
    ca = trustme.CA()
    leaf = ca.issue_cert("stage.epd.test")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return {name: str(tmp_path / f"{name}.pem") for name in ("cert", "key", "ca")}


@pytest.mark.parametrize(("operator_name", "verified"), [("", True), ("another.epd.test", False)])
def test_a_resolved_address_is_checked_against_the_name_unless_the_operator_names_another(
    tls_files, operator_name, verified
):
    """The gateway dials a pod by IP, which no certificate names: it checks the certificate against
    the name it resolved (what --tls-server-name did for every channel); an operator's
    --tls-server-name still wins."""
    server_security = TransportSecurity(tls_cert=tls_files["cert"], tls_key=tls_files["key"])

    async def health(pool: ReplicaPool, address: str) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(pool.channel(address)).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def scenario():
        hs = await create_server(ServerConfig(security=server_security), lambda s: None, [])
        await hs.set_serving()
        address = f"127.0.0.1:{hs.port}"
        by_name = ReplicaPool([f"dns:///stage.epd.test:{hs.port}"])
        by_ip = ReplicaPool([address])
        try:
            await ReplicaUpdater(
                {"prefill": by_name}, lookup=FakeDns(**{"stage.epd.test": ["127.0.0.1"]})
            ).refresh()
            assert by_name.addresses == [address]
            return await health(by_name, address), await health(by_ip, address)
        finally:
            await by_name.close()
            await by_ip.close()
            await hs.stop(0)

    security.configure(TransportSecurity(tls_ca=tls_files["ca"], tls_server_name=operator_name))
    try:
        by_name, by_ip = asyncio.run(scenario())
    finally:
        security.configure(TransportSecurity())
    assert by_name == verified
    assert not by_ip  # the IP alone fails the check: the name is what makes it pass


@pytest.mark.parametrize("pod_left_dns", [False, True])
def test_a_kv_cache_is_released_at_a_resolved_prefill_address_checked_against_the_name(
    tls_files, pod_left_dns
):
    """The gateway releases a KV cache no decoder took at the address its prefill pod advertised,
    the pod's IP: where that IP is a replica resolved from `dns:///NAME`, the certificate is
    checked against NAME (before, only an operator's --tls-server-name made the release pass, and
    without it the cache stayed until --kv-ttl). Also once the pod has left NAME's answer (a
    draining pod keeps its caches), which the k8s-tls overlay's --tls-server-name on the gateway
    covered, at the price of checking every stage's pods against prefill's name."""
    released: list[str] = []

    async def release_kv(request: prefill_pb2.ReleaseKvRequest, context) -> prefill_pb2.ReleaseKvResult:
        released.append(request.kv_handle)
        return prefill_pb2.ReleaseKvResult(released=True)

    service = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
    handler = grpc.method_handlers_generic_handler(service, {"ReleaseKv": grpc.unary_unary_rpc_method_handler(
        release_kv, request_deserializer=prefill_pb2.ReleaseKvRequest.FromString,
        response_serializer=prefill_pb2.ReleaseKvResult.SerializeToString)})  # fmt: skip
    server_security = TransportSecurity(tls_cert=tls_files["cert"], tls_key=tls_files["key"])

    async def scenario():
        hs = await create_server(ServerConfig(security=server_security),
                                 lambda s: s.add_generic_rpc_handlers((handler,)), [])  # fmt: skip
        pool = ReplicaPool([f"dns:///stage.epd.test:{hs.port}"])
        stage = RemotePrefillStage(pool, timeout_s=5)
        try:
            dns = FakeDns(**{"stage.epd.test": ["127.0.0.1"]})
            updater = ReplicaUpdater({"prefill": pool}, lookup=dns)
            await updater.refresh()
            if pod_left_dns:
                dns.answers["stage.epd.test"] = ["127.0.0.2"]
                await updater.refresh()
                assert pool.addresses == [f"127.0.0.2:{hs.port}"]
            handle = PrefillHandle(first_token_id=0, num_prompt_tokens=1, num_cached_tokens=1,
                                   next_position_ids=[1, 1, 1, 1], kv_num_bytes=0, prefill_ms=0.0,
                                   kv_handle="h1", kv_address=f"127.0.0.1:{hs.port}")  # fmt: skip
            await stage.release(handle, "r1")
        finally:
            await pool.close()
            await stage.close()
            await hs.stop(0)

    security.configure(TransportSecurity(tls_ca=tls_files["ca"]))
    try:
        asyncio.run(scenario())
    finally:
        security.configure(TransportSecurity())
    assert released == ["h1"]
