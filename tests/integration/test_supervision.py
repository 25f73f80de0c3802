"""`epd serve --encoders N ...`: one-host scale-out and supervision with real processes (issue #16
item 1). A replica (or the gateway) killed with SIGKILL, or stopped (SIGSTOP) so that it no
longer answers its health checks, is restarted, forked again from the zygote on its own port, while the others keep
serving; questions through the gateway get the same answer before and after; SIGTERM to the
launcher still stops everything. The restart bookkeeping itself (backoff, crash loops) is unit
tested in tests/unit/cli/test_supervisor.py."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
from pathlib import Path

import psutil

from epd.cli.health import is_serving
from epd.transport.affinity import rendezvous_order
from tests.local_http import post_json
from tests.stack import launch_stack, serving_pid, stop_launcher, wait_until

FRAMES = 4
TOKENS = 6
RESTART_WAIT_S = 90.0  # a deadline for a restart to be seen, not a timing assertion


def _chat_answer(http_port: int, url: str) -> tuple[int, dict]:
    """(HTTP status, the JSON answer) of a greedy chat request about the video at `url`."""
    body = {
        "model": "epd",
        "max_tokens": TOKENS,
        "temperature": 0,
        "media": {"num_frames": FRAMES},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": url}},
                    {"type": "text", "text": "what moves?"},
                ],
            }
        ],
    }
    return post_json(http_port, "/v1/chat/completions", body)


def _chat(http_port: int, url: str) -> list[int]:
    status, answer = _chat_answer(http_port, url)
    assert status == 200, answer  # the gateway's reason, in the report
    return answer["epd"]["token_ids"]


def _chat_once_back(http_port: int, url: str, launcher: subprocess.Popen, log: Path) -> list[int]:
    """The answer once the stack answers again (the gateway learns that a restarted stage serves at
    its next stage check; a restarted gateway opens its HTTP port after its gRPC one)."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while True:
        try:
            status, answer = _chat_answer(http_port, url)
            if status == 200:
                return answer["epd"]["token_ids"]
            assert status in (502, 503, 504), answer
        except urllib.error.URLError:  # connection refused: the HTTP API is not listening yet
            pass
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)


def _back(port: int, old_pid: int, launcher: subprocess.Popen, log: Path) -> int:
    """Wait for a new process to serve on `port`; its pid."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while True:
        pid = serving_pid(port)
        if pid not in (None, old_pid) and is_serving(f"127.0.0.1:{port}", timeout_s=1.0):
            return pid
        assert launcher.poll() is None, f"the stack stopped (exit {launcher.poll()}):\n{log.read_text()}"
        assert time.monotonic() < deadline, f"port {port} not served by a new process:\n{log.read_text()}"
        time.sleep(0.2)


def test_killed_and_silent_replicas_are_restarted_while_the_stack_serves(tiny_models, media_files, tmp_path):
    """Two encoders and two prefills (each prefill advertises its own port; decode's default
    allow-list admits every loopback port), one decode."""
    log, ports_file = tmp_path / "stack.log", tmp_path / "stack.ports.json"
    flags = ("--encoders", "2", "--prefills", "2", "--health-timeout", "2")
    launcher, ready = launch_stack(tiny_models["qwen2_vl"], log, ports_file, *flags)
    children: list[psutil.Process] = []
    try:
        bound = json.loads(ports_file.read_text())  # written before the line
        encoders, prefills = bound["encoder"], bound["prefill"]
        ports = {"gateway": bound["grpc"], "http": bound["http"], "decode": bound["decode"][0]}
        assert len(set(encoders + prefills + list(ports.values()))) == 7, bound  # each its own port
        assert f"gateway at 127.0.0.1:{ports['gateway']}; " in ready, ready
        assert f"encoder at 127.0.0.1:{encoders[0]},127.0.0.1:{encoders[1]}" in ready, ready
        addresses = f"127.0.0.1:{prefills[0]},127.0.0.1:{prefills[1]}"
        assert f"prefill at {addresses}; decode at 127.0.0.1:{ports['decode']}" in ready, ready
        video = media_files["mp4"].read_bytes()
        url = "data:video/mp4;base64," + base64.b64encode(video).decode()
        answer = _chat(ports["http"], url)

        # The encoder replica the video goes to dies: the gateway retries on the other one, and the
        # launcher forks the dead one again on its port.
        home = int(
            rendezvous_order(hashlib.sha256(video).hexdigest(), [f"127.0.0.1:{p}" for p in encoders])[
                0
            ].rsplit(":", 1)[1]
        )
        other = encoders[1 - encoders.index(home)]
        killed = encoder_killed = serving_pid(home)
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        assert _chat(ports["http"], url) == answer
        assert _back(home, killed, launcher, log) != killed
        assert _chat(ports["http"], url) == answer

        # The only decode dies: the stack cannot answer until it is back, then answers the same.
        killed = serving_pid(ports["decode"])
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        _back(ports["decode"], killed, launcher, log)
        assert _chat_once_back(ports["http"], url, launcher, log) == answer

        # A replica that stops answering (SIGSTOP) is killed after --health-timeout and restarted.
        # Known by its psutil handle (pid and start time), not by its pid: with pid_max 32768 and
        # the threads of parallel test runs, the pid could be another process's by the time it is
        # looked at (a check of the bare pid failed once under load). The launcher has reaped it
        # before the replica is restarted (it waits for the kill; the zygote reaps, then reports).
        stopped = serving_pid(other)
        assert stopped is not None
        stopped_process = psutil.Process(stopped)
        os.kill(stopped, signal.SIGSTOP)
        _back(other, stopped, launcher, log)
        assert not stopped_process.is_running(), stopped_process
        assert _chat(ports["http"], url) == answer

        # The gateway too (a plain process, started again by the launcher).
        killed = serving_pid(ports["gateway"])
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        _back(ports["gateway"], killed, launcher, log)
        assert _chat_once_back(ports["http"], url, launcher, log) == answer

        stderr_text = log.read_text()
        name = f"encoder[{encoders.index(home)}]"
        assert f"epd: {name} (pid {encoder_killed}) exited with code -9; restarting in 1 s" in stderr_text, (
            stderr_text
        )
        assert f"epd: {name} serving again at 127.0.0.1:{home}" in stderr_text, stderr_text
        stopped_name = f"encoder[{encoders.index(other)}]"
        assert f"epd: {stopped_name} (pid {stopped}) did not answer its health check for" in stderr_text, (
            stderr_text
        )
        assert "epd: decode[0] restarted" in stderr_text and "Traceback" not in stderr_text, stderr_text
        children = psutil.Process(launcher.pid).children(recursive=True)
    finally:
        code = stop_launcher(launcher)
    assert code == 0, log.read_text()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE], [c.cmdline()[:8] for c in alive]
    assert all(serving_pid(p) is None for p in [*encoders, *prefills, *ports.values()])


def _take_port(port: int) -> socket.socket:
    """A listening socket of this test process on loopback port `port`, once the service that had
    it is gone (SO_REUSEADDR: the connections it left in TIME_WAIT do not hold the port)."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while True:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
            return sock
        except OSError:
            sock.close()
            assert time.monotonic() < deadline, f"port {port} never came free"
            time.sleep(0.01)


def _killed_and_taken(port: int, launcher: subprocess.Popen) -> tuple[int, socket.socket]:
    """SIGKILL to the service on `port` and its port taken by this process before the launcher can
    restart it (the launcher is stopped meanwhile, so that no restart can come first): (its pid, the
    socket holding the port)."""
    pid = serving_pid(port)
    assert pid is not None
    os.kill(launcher.pid, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        sock = _take_port(port)
    finally:
        os.kill(launcher.pid, signal.SIGCONT)
    return pid, sock


def test_a_port_taken_while_its_service_was_down(tiny_models, media_files, tmp_path):
    """Another process takes a killed service's port before the launcher restarts it: a stage
    replica is restarted on a free port, which the gateway is told (its replica file) and the stack's
    ports file lists; the gateway, whose port its clients know, is not started (one line naming the
    port and its holder, then another look after a growing wait) until the port is free again.
    Before, the restart failed to bind, again and again, and the stack stopped as a crash loop."""
    log, ports_file = tmp_path / "stack.log", tmp_path / "stack.ports.json"
    launcher, _ = launch_stack(tiny_models["qwen2_vl"], log, ports_file)
    held: list[socket.socket] = []
    try:
        bound = json.loads(ports_file.read_text())
        url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
        answer = _chat(bound["http"], url)
        holder = f"pid {os.getpid()} ("

        encoder = bound["encoder"][0]
        killed, sock = _killed_and_taken(encoder, launcher)
        held.append(sock)
        wait_until(
            lambda: json.loads(ports_file.read_text())["encoder"] != [encoder] or launcher.poll() is not None,
            "the moved encoder in the stack's ports file",
            RESTART_WAIT_S,
        )
        moved = json.loads(ports_file.read_text())["encoder"][0]
        text = log.read_text()
        assert launcher.poll() is None, text
        assert f"epd: encoder[0] (pid {killed}) exited with code -9; restarting in 1 s" in text, text
        assert f"epd: encoder[0]: port {encoder} is held by {holder}" in text, text
        assert (
            "; restarting it on a free port" in text
            and f"epd: encoder[0] now listens on 127.0.0.1:{moved}" in text
        )
        assert moved != encoder and serving_pid(encoder) == os.getpid()
        assert _chat_once_back(bound["http"], url, launcher, log) == answer  # routed to the moved one
        assert (
            f"encoder replicas now 127.0.0.1:{moved} (added 127.0.0.1:{moved}, removed 127.0.0.1:{encoder})"
            in (log.read_text())
        )

        gateway = bound["grpc"]
        killed, sock = _killed_and_taken(gateway, launcher)
        held.append(sock)
        waiting = f"epd: cannot restart gateway: port {gateway} is held by {holder}"
        wait_until(
            lambda: log.read_text().count(waiting) >= 2 or launcher.poll() is not None,
            "two looks at the gateway's taken port",
            RESTART_WAIT_S,
        )
        text = log.read_text()
        assert launcher.poll() is None, text
        looks = [line for line in text.splitlines() if line.startswith(waiting)]
        assert [line.rsplit("; ", 1)[1] for line in looks[:2]] == [
            "trying again in 2 s",
            "trying again in 4 s",
        ]
        assert "epd: gateway restarted" not in text, text  # nothing started to fail on the port
        held.pop().close()  # the port is free again: the gateway comes back on it
        _back(gateway, killed, launcher, log)
        assert _chat_once_back(bound["http"], url, launcher, log) == answer
        assert "Traceback" not in log.read_text()
    finally:
        for sock in held:
            sock.close()
        code = stop_launcher(launcher)
    assert code == 0, log.read_text()
