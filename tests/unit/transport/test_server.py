"""The server factory: a port already in use is an error, not a silently shared socket."""

import asyncio

import pytest

from epd.stages.server_config import ServerConfig
from epd.transport.server import create_server


def test_second_server_on_a_used_port_fails():
    async def run():
        first = await create_server(ServerConfig(port=0), lambda s: None, [])
        try:
            with pytest.raises(OSError, match="already using that port"):
                await create_server(ServerConfig(port=first.port), lambda s: None, [])
        finally:
            await first.stop(0)

    asyncio.run(run())


def test_a_server_on_port_0_writes_the_port_it_bound_to_its_ports_file(tmp_path):
    """`--port 0 --ports-file PATH`: the caller learns the free port the kernel picked from the
    file, written once the server listens (with the gateway's other ports), replacing what was
    there; no file without `ports_file`."""
    from epd.cli.health import health_answer
    from epd.transport.ports_file import read_ports_file

    path = tmp_path / "ports.json"
    path.write_text('{"grpc": 1}')  # an earlier run's

    async def run() -> tuple[int, dict | None, bool | None]:
        config = ServerConfig(port=0, ports_file=str(path))
        hs = await create_server(config, lambda s: None, [], other_ports={"http": 8123})
        try:
            bound = read_ports_file(str(path))
            answer = await asyncio.to_thread(health_answer, f"127.0.0.1:{bound['grpc']}", "liveness", 5.0)
            return hs.port, bound, answer
        finally:
            await hs.stop(0)

    port, bound, answer = asyncio.run(run())
    assert port > 0 and bound == {"grpc": port, "http": 8123} and answer is True
    assert [p.name for p in tmp_path.iterdir()] == ["ports.json"]  # no staging file left


def test_a_stage_server_ends_old_connections_so_callers_resolve_its_name_again():
    """gRPC resolves a `dns:///stage-headless:port` name again only when a connection ends: a stage
    server that kept its connections forever left replicas added by `kubectl scale` without calls.
    After `max_connection_age_s` the caller's next call comes on a new connection, and a call in
    flight at that moment still completes on the old one."""
    import grpc

    from tests.unit.plumbing.grpc_fakes import SERVICE, unary

    async def peer(request: bytes, context) -> bytes:
        if request == b"slow":
            await asyncio.sleep(1.5)  # spans the connection's end of life
        return context.peer().encode()

    def register(server) -> None:
        handlers = {"Peer": grpc.unary_unary_rpc_method_handler(peer)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    async def run():
        hs = await create_server(ServerConfig(port=0, max_connection_age_s=0.5), register, [])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
                call = unary(channel, "Peer")
                first = await call(b"", timeout=10)
                in_flight = await call(b"slow", timeout=10)  # answered after the GOAWAY
                later = await call(b"", timeout=10)
                return first, in_flight, later
        finally:
            await hs.stop(0)

    first, in_flight, later = asyncio.run(run())
    assert in_flight == first  # the old connection carried its call to the end
    assert later != first  # a new connection (another client port)
    assert ServerConfig().max_connection_age_s > 0


def test_liveness_is_serving_while_the_server_runs_whatever_its_readiness():
    """Kubernetes' gRPC livenessProbe wants SERVING: on the gateway's own status, NOT_SERVING while a
    stage has no replica serving, it restarted a sound gateway. Probes ask LIVENESS_SERVICE."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from epd.transport.server import LIVENESS_SERVICE

    async def run():
        hs = await create_server(ServerConfig(port=0), lambda s: None, ["epd.v1.GatewayService"])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
                check = health_pb2_grpc.HealthStub(channel).Check
                statuses = []
                for serving in (False, True, False):
                    await hs.set_serving(serving)
                    statuses.append(
                        [
                            (await check(health_pb2.HealthCheckRequest(service=name), timeout=10)).status
                            for name in ("", LIVENESS_SERVICE)
                        ]
                    )
                return statuses
        finally:
            await hs.stop(0)

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert asyncio.run(run()) == [[not_serving, serving], [serving, serving], [not_serving, serving]]
