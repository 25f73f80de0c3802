"""`epd serve`'s launcher (epd/cli/launcher.py): how long it waits for a service it stops, no torch
before it spawns the services, its supervision of the replicas (crash loops given up, a model that
cannot load stopping the stack) and its checks before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import grpc
import pytest

from epd.cli.launcher import not_ready_message, serve_stack
from epd.cli.parsers.root import build_parser
from epd.cli.process_exit import EXIT_MODEL
from epd.cli.stack_commands import check_max_model_len
from epd.resources import demo_model_dir
from tests.stack import ROOT, child_env


@pytest.mark.parametrize("close_timeout_s", [0.0, 2.0, 30.0, 120.0])
def test_the_launcher_waits_for_what_a_service_closes_after_its_drain(close_timeout_s):
    """The launcher SIGKILLs a service `stop_wait_s(--grace-period, --close-timeout-s)` after its
    SIGTERM: that must cover every service's stop, added up from the code's bounds
    (`_BEFORE_CLOSE_S` and `_GATEWAY_AFTER_DRAIN_S` are written out: the bounds' modules load
    torch; 5 s in all, before, cut a stage's 30 s close deadline short)."""
    from epd.cli import launcher
    from tests.unit.deploy.epd_commands import stop_bound_s

    for role in ("gateway", "encoder", "prefill", "decode"):
        assert launcher.stop_wait_s(30.0, close_timeout_s) >= stop_bound_s(role, 30.0, close_timeout_s), role


def test_the_start_timeout_names_the_services_not_serving_apart_from_those_never_started():
    """With every stage on port 0 the gateway starts only once the stages serve: at the timeout it
    never started, which is not the same as a service that started and does not serve."""
    tail = " (a model slower to load needs a longer --start-timeout)"
    assert not_ready_message(0.5, ["encoder[0]", "prefill[0]"], ["gateway"]) == (
        "epd: not ready after 0.5 s: started, not serving yet: encoder[0], prefill[0]; "
        "not started (waiting for the others to serve): gateway" + tail
    )
    assert not_ready_message(600.0, ["decode[0]"], []) == (
        "epd: not ready after 600 s: started, not serving yet: decode[0]" + tail
    )


def test_the_launcher_imports_no_torch():
    """Everything `epd serve` does before it spawns the services, in a fresh interpreter: parse,
    find the shipped default model, check it, build the children's command lines."""
    code = """
import sys
from epd.cli import serve
from epd.cli.parsers.root import build_parser
from epd.cli.stack_commands import stack_commands
from epd.model_runtime.loader import check_model_dir, resolve_model_path
args = build_parser().parse_args(["serve"])
args.model = resolve_model_path(args.model)
check_model_dir(args.model)
stack_commands(args)
print(args.model, sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    env = {k: v for k, v in child_env().items() if k not in ("EPD_MODEL", "EPD_DEFAULT_MODEL")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(demo_model_dir()), "[]"]


class _Process:
    """A child as the launcher sees it (`poll`, `pid`, `kill`, ...), that exits with `code` after
    being polled `polls` times: the supervision loop's processes, without starting any."""

    pids = iter(range(1000, 2000))

    def __init__(self, code: int | None = None, polls: int = 0) -> None:
        self.pid, self._code, self._polls, self.returncode = next(self.pids), code, polls, None

    def poll(self) -> int | None:
        if self.returncode is None and self._code is not None:
            self._polls -= 1
            if self._polls < 0:
                self.returncode = self._code
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9

    def send_signal(self, signum: int) -> None:
        self.returncode = -signum

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


@pytest.fixture
def health_servers():
    """Real grpc.health servers answering SERVING on free loopback ports: what the supervisor asks.
    `serve.peers[port]`: the client address (its connection's port) of each check it answered."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    servers = []
    pools = []

    class Servicer(health.HealthServicer):
        def __init__(self, peers: list[str]) -> None:
            super().__init__()
            self.peers = peers

        def Check(self, request, context):  # noqa: N802 (gRPC's name)
            self.peers.append(context.peer())
            return super().Check(request, context)

    def serve() -> int:
        pools.append(futures.ThreadPoolExecutor(max_workers=2))
        server = grpc.server(pools[-1])
        peers: list[str] = []
        servicer = Servicer(peers)
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        serve.peers[port] = peers  # type: ignore[attr-defined]
        return port

    serve.peers = {}  # type: ignore[attr-defined]

    yield serve
    for server in servers:
        server.stop(None)
    for pool in pools:  # the server's stop leaves its pool's threads to their owner
        pool.shutdown()


@pytest.fixture
def launcher_signals():
    import signal

    from epd.cli.launcher import _Signals

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signals = _Signals()
    # A supervisor that never decides is stopped as Ctrl-C would (and the test then fails on EXIT_OK).
    timer = threading.Timer(30.0, signals.stop.set)
    timer.start()
    yield signals
    timer.cancel()
    signal.signal(signal.SIGINT, handlers[0])
    signal.signal(signal.SIGTERM, handlers[1])


def _slots(serve, names: list[str], policy):
    import time

    from epd.cli.launcher import _Slot
    from epd.cli.supervisor import Replica

    return [
        _Slot(name, name.partition("[")[0], serve(), [], Replica(name, policy, time.monotonic()))
        for name in names
    ]


def test_crash_looping_replicas_are_given_up_and_the_stack_stops_with_its_last_one(
    health_servers, launcher_signals, capsys, monkeypatch
):
    from epd.cli import launcher
    from epd.cli.launcher import _supervise
    from epd.cli.process_exit import EXIT_FAILED
    from epd.cli.supervisor import RestartPolicy, State

    # These processes exit while their health servers keep listening: the launcher's look at a
    # port before a restart would find each taken (tests/integration/test_supervision.py has real ones).
    monkeypatch.setattr(launcher, "port_taken", lambda host, port: False)

    policy = RestartPolicy(backoff_initial_s=0.01, backoff_max_s=0.01, crash_loop_exits=2, start_timeout_s=30)
    slots = _slots(health_servers, ["gateway", "encoder[0]", "encoder[1]"], policy)
    started: list[str] = []

    def start(slot):
        started.append(slot.name)
        # The gateway runs; each encoder process dies (code 1) soon after it starts, encoder[0]'s later.
        return (
            _Process() if slot.role == "gateway" else _Process(1, polls=2 if slot.name == "encoder[1]" else 7)
        )

    for slot in slots:
        slot.proc = start(slot)
    assert _supervise(slots, start, launcher_signals, policy) == EXIT_FAILED
    err = capsys.readouterr().err.splitlines()
    exits = [line.split(") ", 1)[1] for line in err if line.startswith("epd: encoder[1] (pid ")]
    assert exits == [
        "exited with code 1; restarting in 0.01 s",
        "exited with code 1; crash-looping (2 exits in 60 s); giving up on it",
    ], err
    assert "epd: encoder[1] restarted (pid " in "\n".join(err)
    assert err[-1] == "epd: no encoder left; stopping the stack", err
    assert [s.replica.state for s in slots] == [State.SERVING, State.GIVEN_UP, State.GIVEN_UP]
    assert started.count("encoder[0]") == started.count("encoder[1]") == 2 and started.count("gateway") == 1


def test_a_replica_moved_to_a_free_port_that_never_binds_is_killed_at_the_start_timeout(
    health_servers, launcher_signals, capsys, tmp_path
):
    """encoder[0] exits while its port is held (here by its health server, which keeps listening):
    it is restarted on port 0 with a ports file, and its processes never write one. Its health is
    not asked until it binds, so the start timeout must end each; before, it stayed "starting" for
    ever (and this test ended on the fixture's stop, EXIT_OK)."""
    import re

    from epd.cli.launcher import _supervise
    from epd.cli.process_exit import EXIT_FAILED
    from epd.cli.supervisor import RestartPolicy, State

    policy = RestartPolicy(
        backoff_initial_s=0.01, backoff_max_s=0.01, crash_loop_exits=3, start_timeout_s=1.0
    )
    slots = _slots(health_servers, ["gateway", "encoder[0]"], policy)
    encoder = slots[1]
    encoder.command = ["epd", "serve", "encoder", "--port", str(encoder.port)]
    started: list[tuple[list[str], _Process]] = []

    def start(slot):
        # The gateway runs; the encoder's first process exits (code 1), the later ones never bind.
        proc = _Process() if slot.role == "gateway" or started else _Process(1, polls=2)
        if slot.role != "gateway":
            started.append((list(slot.command), proc))
        return proc

    for slot in slots:
        slot.proc = start(slot)
    replicas_file = str(tmp_path / "replicas.json")
    assert _supervise(slots, start, launcher_signals, policy, replicas_file=replicas_file) == EXIT_FAILED
    err = capsys.readouterr().err.splitlines()
    exits = [line.split(") ", 1)[1] for line in err if line.startswith("epd: encoder[0] (pid ")]
    assert len(exits) == 3 and exits[0] == "exited with code 1; restarting in 0.01 s", err
    killed = re.compile(r"had not bound a port after \d+ s; killed it; ")
    assert all(killed.match(line) for line in exits[1:]), err
    assert exits[1].endswith("restarting in 0.01 s") and exits[2].endswith("giving up on it"), err
    assert f"epd: encoder[0]: port {slots[1].port} is held by pid " in "\n".join(err)
    assert [s.replica.state for s in slots] == [State.SERVING, State.GIVEN_UP]
    moved = str(tmp_path / "encoder[0].ports.json")
    assert [command[-4:] for command, _ in started[1:]] == [["--port", "0", "--ports-file", moved]] * 2
    assert [proc.returncode for _, proc in started] == [1, -9, -9]


def test_the_supervisor_asks_each_service_process_over_one_connection(health_servers, launcher_signals):
    """Every second the launcher asks each service for its health: over the connection of its
    last check while the same process runs, where each check opened one (a TCP connection and an
    HTTP/2 handshake a second in the launcher and in every service, idle: docs/benchmarks.md)."""
    from epd.cli.launcher import _supervise
    from epd.cli.supervisor import RestartPolicy

    policy = RestartPolicy(start_timeout_s=30)
    slots = _slots(health_servers, ["gateway", "encoder[0]"], policy)
    for slot in slots:
        slot.proc = _Process()
    checks = [health_servers.peers[slot.port] for slot in slots]
    # Stopped as Ctrl-C would once each has been asked four times (about 3 s): the start-up's
    # check (every 0.2 s, on a fresh channel: one kept would wait out its reconnect backoff
    # while the service binds), then three supervising ones.
    watcher = threading.Thread(
        target=lambda: (
            _wait_for(lambda: all(len(peers) >= 4 for peers in checks)),
            launcher_signals.stop.set(),
        )
    )
    watcher.start()
    _supervise(slots, lambda slot: _Process(), launcher_signals, policy)
    watcher.join()
    assert all(len(peers) >= 4 for peers in checks), checks
    assert [len(set(peers[1:])) for peers in checks] == [1, 1], checks


def test_a_service_started_again_is_asked_over_a_channel_of_its_own():
    """`HealthChannels`: a channel per (address, pid), kept while that process is listed; one
    restarted (a new pid at the same address) or gone has its old channel closed."""
    from epd.cli.health import HealthChannels

    class Channel:
        def __init__(self, address: str) -> None:
            self.address, self.closed = address, False

        def close(self) -> None:
            self.closed = True

    opened: list[Channel] = []
    channels = HealthChannels(lambda address: opened.append(Channel(address)) or opened[-1])
    first = channels.channels([("a:1", 10), ("b:2", 20)])
    assert channels.channels([("a:1", 10), ("b:2", 20)]) == first and len(opened) == 2
    restarted = channels.channels([("a:1", 11), ("b:2", 20)])  # a:1 restarted
    assert restarted[1] is first[1] and restarted[0] is opened[2] and opened[2].address == "a:1"
    assert [c.closed for c in opened] == [True, False, False]
    channels.channels([("a:1", 11)])  # b:2 exited
    assert [c.closed for c in opened] == [True, True, False]
    channels.close()
    assert all(c.closed for c in opened)


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("code", [3, 2])  # EXIT_MODEL, EXIT_USAGE: a restart would fail the same way
def test_a_replica_that_cannot_load_its_model_stops_the_stack_without_a_restart(
    health_servers, launcher_signals, code
):
    from epd.cli.launcher import _supervise
    from epd.cli.supervisor import RestartPolicy

    policy = RestartPolicy(backoff_initial_s=0.01, start_timeout_s=30)
    slots = _slots(health_servers, ["gateway", "decode[0]"], policy)
    started: list[str] = []

    def start(slot):
        started.append(slot.name)
        return _Process() if slot.role == "gateway" else _Process(code, polls=3)

    for slot in slots:
        slot.proc = start(slot)
    assert _supervise(slots, start, launcher_signals, policy) == code
    assert started == ["gateway", "decode[0]"]


def test_a_max_model_len_above_the_checkpoints_context_stops_the_stack_before_anything_starts(
    tiny_models, capsys
):
    """Every prefill replica would refuse it once its model is loaded (exit 3); the launcher reads
    config.json first and says so in the same line, with nothing started."""
    model = tiny_models["qwen2_vl"]
    config = json.loads((model / "config.json").read_text())
    context = config.get("text_config", config)["max_position_embeddings"]
    args = build_parser().parse_args(["serve", "--model", str(model), "--max-model-len", str(context + 1)])
    assert serve_stack(args) == EXIT_MODEL
    assert capsys.readouterr().err == (
        f"epd: cannot load {model}: --max-model-len {context + 1} is more than this model's context of {context} "
        f"tokens (config.json's max_position_embeddings); it may only lower it: pass at most {context}, or leave "
        "it out\n"
    )
    check_max_model_len(str(model), context)  # the model's own context: served
    check_max_model_len("Qwen/Qwen2-VL-2B-Instruct", 10**9)  # a hub id: prefill checks it once loaded
