"""The gateway's replica file (`epd.gateway.replica_list`): parsed from JSON or YAML, refused as a
whole with a message saying what to change, and applied to the replica pools when it changes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from epd.gateway.config import GatewayConfig
from epd.gateway.engine_load import refresh_routing_loads
from epd.gateway.readiness import StageHealth
from epd.gateway.replica_list import ReplicaFileError, ReplicaListWatcher, ReplicaUpdater, parse_replicas
from epd.gateway.server import stage_addresses
from epd.stages.server_config import ServerConfig
from epd.transport.ports_file import free_port
from epd.transport.replica_pool import ReplicaPool
from epd.transport.server import create_server


def test_json_and_yaml_lists_parse_and_a_stage_left_out_is_absent():
    assert parse_replicas('{"encoder": ["a:1", "b:1", "a:1"], "decode": "c:3, d:3"}') == {
        "encoder": ("a:1", "b:1"), "decode": ("c:3", "d:3")}  # fmt: skip
    assert parse_replicas("prefill:\n  - p:2\n  - dns:///prefill-headless:50052\n") == {
        "prefill": ("p:2", "dns:///prefill-headless:50052")}  # fmt: skip
    assert parse_replicas("") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"encoder": [', "not valid JSON or YAML"),
        ('["a:1"]', "must be a mapping"),
        ('{"encoders": ["a:1"]}', "unknown stage 'encoders'"),
        ('{"encoder": [1, 2]}', 'list of "HOST:PORT" strings'),
        ('{"encoder": []}', "needs at least one address"),
    ],
)
def test_an_unusable_file_says_what_to_change(text, message):
    with pytest.raises(ReplicaFileError, match=message):
        parse_replicas(text)


def test_the_file_replaces_the_flags_for_the_stages_it_names(tmp_path):
    path = tmp_path / "replicas.json"
    path.write_text(json.dumps({"encoder": ["e1:1", "e2:1"]}))
    config = GatewayConfig(replicas_file=str(path), prefill_addresses=("p:2",))
    assert stage_addresses(config) == {"encoder": ("e1:1", "e2:1"), "prefill": ("p:2",),
                                       "decode": GatewayConfig().decode_addresses}  # fmt: skip
    with pytest.raises(ReplicaFileError, match="cannot read the replica file"):
        stage_addresses(GatewayConfig(replicas_file=str(tmp_path / "missing.json")))


def test_the_watcher_applies_changes_and_keeps_routing_on_a_bad_file(tmp_path):
    path = tmp_path / "replicas.yaml"
    path.write_text("encoder: [e1:1]\n")

    async def scenario():
        pools = {"encoder": ReplicaPool(["e1:1"]), "decode": ReplicaPool(["d1:3"])}
        watcher = ReplicaListWatcher(path, ReplicaUpdater(pools), poll_interval_s=0.05)
        try:
            assert await watcher.reload() and not watcher.changed()
            task = asyncio.ensure_future(watcher.run(install_sighup=False))
            path.write_text("encoder: [e1:1, e2:1]\ndecode: [d2:3]\n")
            os.utime(path, ns=(1, 10**18))  # a new mtime even on a coarse clock
            for _ in range(100):
                if pools["decode"].addresses == ["d2:3"]:
                    break
                await asyncio.sleep(0.05)
            assert pools["encoder"].addresses == ["e1:1", "e2:1"] and pools["decode"].addresses == ["d2:3"]
            path.write_text("encoder: []\n")
            os.utime(path, ns=(1, 2 * 10**18))
            await asyncio.sleep(0.3)
            assert not watcher.changed()  # seen, refused, not retried until it changes again
            assert pools["encoder"].addresses == ["e1:1", "e2:1"]
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            for pool in pools.values():
                await pool.close()

    asyncio.run(scenario())


_SIGHUP_AFTER_THE_WATCHER = """
import asyncio, os, signal, sys
from epd.gateway.replica_list import ReplicaListWatcher, ReplicaUpdater
from epd.transport.replica_pool import ReplicaPool

async def main():
    pool = ReplicaPool(["e1:1"])
    watcher = ReplicaListWatcher(sys.argv[1], ReplicaUpdater({"encoder": pool}), poll_interval_s=0.05)
    task = asyncio.ensure_future(watcher.run())
    await asyncio.sleep(0.2)
    task.cancel()  # the gateway's stop begins: its background tasks end, the drain goes on
    await asyncio.gather(task, return_exceptions=True)
    os.kill(os.getpid(), signal.SIGHUP)  # a closed terminal during the drain
    await asyncio.sleep(0.3)
    await pool.close()
    print("drained")

asyncio.run(main())
"""


def test_a_sighup_after_the_watcher_stopped_does_not_kill_the_gateway(tmp_path):
    """The watcher gave SIGHUP back to its default when it ended, at the start of the gateway's
    drain: a SIGHUP then (a closed terminal, a reload sent during a stop) killed the gateway on the
    spot, cutting every answer in flight. Run in a process of its own: the default kills it."""
    import subprocess
    import sys

    path = tmp_path / "replicas.yaml"
    path.write_text("encoder: [e1:1]\n")
    done = subprocess.run([sys.executable, "-c", _SIGHUP_AFTER_THE_WATCHER, str(path)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, "drained"), (done.returncode, done.stderr[-2000:])


def test_a_file_caught_half_written_is_not_applied(tmp_path):
    """A poll that read the file while it was being written (cut at a line: still valid YAML, a
    shorter list) applied that list until the next poll, taking replicas out of routing. A changed
    file is applied once it is the same at two polls in a row."""
    path = tmp_path / "replicas.yaml"
    path.write_text("encoder: [e1:1, e2:1, e3:1]\n")

    async def scenario():
        pool = ReplicaPool(["e1:1", "e2:1", "e3:1"])
        applied: list[list[str]] = []
        set_addresses = pool.set_addresses

        def recording(addresses, server_names=None):
            applied.append(list(addresses))
            return set_addresses(addresses, server_names)

        pool.set_addresses = recording  # type: ignore[method-assign]
        watcher = ReplicaListWatcher(path, ReplicaUpdater({"encoder": pool}), poll_interval_s=0.2)
        try:
            await watcher.reload()
            applied.clear()
            task = asyncio.ensure_future(watcher.run(install_sighup=False))
            path.write_text("encoder: [e1:1]\n")  # the writer has written its first line so far
            os.utime(path, ns=(1, 10**18))
            await asyncio.sleep(0.3)  # a poll sees it
            path.write_text("encoder: [e1:1, e2:1, e3:1, e4:1]\n")
            os.utime(path, ns=(1, 2 * 10**18))
            for _ in range(50):
                if pool.addresses == ["e1:1", "e2:1", "e3:1", "e4:1"]:
                    break
                await asyncio.sleep(0.1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return applied, pool.addresses
        finally:
            await pool.close()

    applied, final = asyncio.run(scenario())
    assert final == ["e1:1", "e2:1", "e3:1", "e4:1"]
    assert ["e1:1"] not in applied, applied


@contextlib.contextmanager
def silent_replica() -> Iterator[tuple[str, threading.Event]]:
    """A replica that accepts connections and never answers (a pod gone mid-check, a hung one):
    a health check or load read on it stays in flight until its timeout. (address, set once it
    has accepted a connection)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])
                accepted.set()

    acceptor = threading.Thread(target=accept, name="silent-replica", daemon=True)
    acceptor.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone leaves it waiting)
        listener.close()
        acceptor.join()
        for conn in held:
            conn.close()


def test_a_replica_removed_while_its_check_or_load_read_is_in_flight_leaves_the_watches_running():
    """The pool closes a removed replica's channel (no call of its own open), which makes grpc.aio
    cancel the health check or load read still waiting on it. That cancel used to escape as the
    task's own: the gateway's health watch ended for good (found at start-up, where the first DNS
    lookup lands while the first checks wait on the names as written: NOT_SERVING forever)."""
    config = GatewayConfig(encoder_addresses=("unused:1",), prefill_addresses=("unused:2",),
                           decode_addresses=("unused:3",))  # fmt: skip

    async def scenario(address: str, accepted: threading.Event) -> tuple[list[str], list[str]]:
        server = await create_server(ServerConfig(port=0), lambda s: None, [])
        await server.set_serving()
        serving = f"127.0.0.1:{server.port}"
        pools = {stage: ReplicaPool([address, serving] if stage == "encoder" else [serving])
                 for stage in ("encoder", "prefill", "decode")}  # fmt: skip
        health = StageHealth(config, timeout_s=60, pools=pools)
        try:
            check = asyncio.ensure_future(health.status())
            loads = asyncio.ensure_future(refresh_routing_loads(pools, timeout_s=60))
            assert await asyncio.to_thread(accepted.wait, 30)  # the check is waiting on the silent one
            await asyncio.sleep(0.1)  # (and the load read: both went out at once)
            pools["encoder"].set_addresses([serving])
            await asyncio.wait_for(loads, 30)  # a deadline, not a timing assertion: returns, not cancelled
            return await asyncio.wait_for(check, 30)
        finally:
            await health.close()
            for pool in pools.values():
                await pool.close()
            await server.stop(0)

    with silent_replica() as (address, accepted):
        stages_down, down = asyncio.run(scenario(address, accepted))
    assert stages_down == [] and down == [f"encoder {address}"]


def test_a_replica_removed_before_its_load_read_starts_leaves_the_watch_running():
    """As for the model info (test_model_info.py): a replica removed between the routing-load
    refresh listing the replicas and its read starting answers none, not a KeyError that ended
    the watch."""

    async def scenario() -> None:
        kept = f"127.0.0.1:{free_port()}"
        pool = ReplicaPool([f"127.0.0.1:{free_port()}", kept])  # two: a lone replica's load is not read
        try:
            loads = asyncio.ensure_future(refresh_routing_loads({"encoder": pool}, timeout_s=1.0))
            await asyncio.sleep(0)  # the refresh has listed the replicas; their reads have not started
            pool.set_addresses([kept, f"127.0.0.1:{free_port()}"])
            return await asyncio.wait_for(loads, 30)  # a deadline, not a timing assertion: it returns
        finally:
            await pool.close()

    assert asyncio.run(scenario()) is None  # (it raised KeyError)


def test_a_stop_as_a_sighup_lands_ends_the_watcher(tmp_path):
    """The gateway's stop cancels the watcher; with a SIGHUP in the same loop turn, Python 3.11's
    asyncio.wait_for returned from the wait and lost the cancel: the watcher re-read the file and
    polled on through the drain (its SIGHUP handler still installed) until the loop closed."""
    path = tmp_path / "replicas.yaml"
    path.write_text("encoder: [e1:1]\n")

    async def scenario() -> tuple[bool, bool]:
        pool = ReplicaPool(["e1:1"])
        watcher = ReplicaListWatcher(path, ReplicaUpdater({"encoder": pool}), poll_interval_s=60)
        try:
            task = asyncio.ensure_future(watcher.run(install_sighup=False))
            for _ in range(3):
                await asyncio.sleep(0)  # the watcher waits for SIGHUP or its next poll
            watcher._hup.set()  # SIGHUP: the wait completes ...
            await asyncio.sleep(0)
            task.cancel()  # ... as the stop cancels the watcher
            await asyncio.wait([task], timeout=10)  # a deadline, not a timing assertion
            ended = task.done()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return ended, task.cancelled()
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == (True, True)
