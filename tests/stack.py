"""A real epd stack on loopback for tests: encoder, prefill, decode and gateway, each its own
process running the same `epd serve ROLE` command a user or compose runs.

As `epd serve` does, the three model services are forked from a zygote that imported torch and the
families' modules (epd/cli/zygote.py): one per test session, so a stack starts in the time its
services take to load their weights, not to import torch three times on two cores."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from epd.cli.health import is_serving
from epd.cli.zygote import ServiceProcess, Zygote, preload_modules
from epd.model_runtime.loader import _FAMILIES
from epd.v1 import decode_pb2, encoder_pb2, gateway_pb2, prefill_pb2

ROLE_SERVICES = {
    role: module.DESCRIPTOR.services_by_name[service].full_name
    for role, module, service in (
        ("encoder", encoder_pb2, "EncoderService"),
        ("prefill", prefill_pb2, "PrefillService"),
        ("decode", decode_pb2, "DecodeService"),
        ("gateway", gateway_pb2, "GatewayService"),
    )
}
"""Each role's gRPC service: the readiness check asks for it by name, so another server on the port
(whatever it is) never counts as the role serving."""

ROOT = Path(__file__).resolve().parent.parent


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before in this test process: two stack
    services given the same port (the kernel hands a released port out again) made the second
    fail to bind while the first answered in its place."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_with_replicas(count: int, taken: set[int]) -> int:
    """A free port p with p + REPLICA_PORT_STEP * i free too, for i < count (`epd serve --encoders N`
    puts replica i there); the ports are added to `taken`."""
    from epd.cli.parsers.serve import REPLICA_PORT_STEP

    while True:
        port = free_port()
        wanted = [port + REPLICA_PORT_STEP * i for i in range(count)]
        if (
            taken.isdisjoint(wanted)
            and _handed_out.isdisjoint(wanted[1:])
            and all(port_is_free(p) for p in wanted)
        ):
            taken.update(wanted)
            _handed_out.update(wanted)  # free_port() hands none of them out later
            return port


def serving_pid(port: int) -> int | None:
    """The pid of the live process whose command line serves `--port PORT`."""
    import psutil

    for proc in psutil.process_iter(["cmdline", "status"]):
        words = " ".join(proc.info["cmdline"] or []).split()
        serves = "serve" in words and any(pair == ("--port", str(port)) for pair in zip(words, words[1:]))
        if serves and proc.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return proc.pid
    return None


def epd_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "epd.cli.main", *args]


TEST_INTERNAL_SECRET = secrets.token_hex(32)
"""An internal secret for tests that start services with it (`child_env(internal_secret=True)`):
the gateway presents it to the stages, decode to prefill; the test presents it with
`INTERNAL_AUTH_METADATA` when it calls a stage itself."""
INTERNAL_AUTH_METADATA = (("x-epd-internal-auth", TEST_INTERNAL_SECRET),)
INSECURE_STAGE = ("--insecure-no-internal-auth",)
"""What a stage started alone without the secret needs (tests call such stages directly)."""


def child_env(internal_secret: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    if internal_secret:
        env["EPD_INTERNAL_SECRET"] = TEST_INTERNAL_SECRET
    return env


_zygote: Zygote | None = None


def zygote() -> Zygote:
    """The session's zygote, preloaded for every family the tests serve."""
    global _zygote
    if _zygote is None:
        modules: dict[str, None] = {}
        for model_type, (module, _) in sorted(_FAMILIES.items()):
            modules.update(dict.fromkeys(preload_modules(model_type, module)))
        _zygote = Zygote(list(modules))
    return _zygote


def run_epd_forked(*args: str, stdin: str = "", timeout_s: float = 180.0) -> subprocess.CompletedProcess:
    """`epd ARGS` forked from the session's zygote (stdin `stdin`; stdout and stderr captured apart,
    as text), as `subprocess.run` reports a fresh `python -m epd.cli.main ARGS`: the same `main`,
    without importing torch and transformers again (~3 s of CPU each on two cores). For tests of
    what a command does and prints; a test of a command's own start-up (its imports, what it does
    before `main`) starts a fresh interpreter (`epd_command`)."""
    import multiprocessing
    import tempfile

    zygote()  # the fork server below is the session's: preloaded for every family
    with tempfile.TemporaryDirectory(prefix="epd-forked-") as tmp:
        paths = [os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")]
        Path(paths[0]).write_text(stdin)
        proc = multiprocessing.get_context("forkserver").Process(
            target=_run_epd_captured, args=(list(args), child_env(), *paths), name="epd-forked", daemon=False
        )
        proc.start()
        proc.join(timeout_s)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["epd", *args], timeout_s)
        stdout, stderr = (Path(path).read_text() for path in paths[1:])
    return subprocess.CompletedProcess(["epd", *args], proc.exitcode, stdout, stderr)


def _run_epd_captured(
    argv: list[str], env: dict[str, str], stdin_path: str, stdout_path: str, stderr_path: str
) -> None:
    """In the forked child: `epd ARGV` with its standard streams on the given files."""
    from epd.cli.zygote_signals import INHERITED

    for signum, handler in INHERITED.items():  # the zygote ignores them; the command does not
        signal.signal(signum, handler)
    for fd, path, flags in (
        (0, stdin_path, os.O_RDONLY),
        (1, stdout_path, os.O_WRONLY | os.O_TRUNC),
        (2, stderr_path, os.O_WRONLY | os.O_TRUNC),
    ):
        opened = os.open(path, flags | (os.O_CREAT if fd else 0), 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - fd 0 outlives this object
    os.environ.clear()
    os.environ.update(env)
    from epd.cli.main import main

    raise SystemExit(main(argv))


@contextlib.contextmanager
def stage_replica(role: str, model: Path, log_dir: Path, *flags: str) -> Iterator[tuple[str, ServiceProcess]]:
    """One more `role` replica beside a Stack's, or alone (forked from the session's zygote, on a
    loopback port of its own, without the internal secret like a Stack's stages, with `flags`; its
    log `ROLE-2.log`): (address, process), stopped with SIGTERM on exit. It may still be loading:
    `wait_until_serving`."""
    port = free_port()
    argv = ["serve", role, "--port", str(port), "--model", str(model), *INSECURE_STAGE, *flags]
    proc = zygote().start(f"{role}-2", argv, child_env(), str(log_dir / f"{role}-2.log"))
    try:
        yield f"127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def wait_until_serving(address: str, proc: ServiceProcess, timeout_s: float = 120.0) -> None:
    """Until the replica at `address` answers SERVING; fails if it exits or takes `timeout_s`
    (a deadline for a start-up, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not is_serving(address, timeout_s=1.0):
        assert proc.poll() is None and time.monotonic() < deadline, f"the replica at {address} did not start"
        time.sleep(0.2)


class Stack:
    """Context manager; `.gateway` is the front door's address."""

    def __init__(
        self,
        model: Path,
        log_dir: Path,
        extra: dict[str, list[str]] | None = None,
        internal_secret: bool = False,
        gateway_env: dict[str, str] | None = None,
    ) -> None:
        """gateway_env: variables set in the gateway's environment alone (over the stages' own)."""
        self.model = str(model)
        self.log_dir = log_dir
        self.extra = extra or {}
        self.env = child_env(internal_secret)  # with the secret: see TEST_INTERNAL_SECRET
        self.internal_secret = internal_secret
        self.gateway_env = {**self.env, **(gateway_env or {})}
        self.ports = {name: free_port() for name in ("encoder", "prefill", "decode", "gateway")}
        self.procs: dict[str, subprocess.Popen | ServiceProcess] = {}

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.ports['gateway']}"

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def command(self, name: str) -> list[str]:
        p = self.ports
        if name == "gateway":
            args = [
                "serve",
                "gateway",
                "--port",
                str(p["gateway"]),
                "--encoder",
                self.address("encoder"),
                "--prefill",
                self.address("prefill"),
                "--decode",
                self.address("decode"),
            ]
        else:
            args = ["serve", name, "--port", str(p[name]), "--model", self.model]
            if not self.internal_secret and not {"--tls-client-ca", "--internal-secret-file"} & set(
                self.extra.get(name, [])
            ):
                args += INSECURE_STAGE
        return epd_command(*args, *self.extra.get(name, []))

    def __enter__(self) -> Stack:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name in self.ports:
            log_path = self.log_dir / f"{name}.log"
            if name == "gateway":  # no model, no torch: a plain interpreter, as `epd serve` starts it
                with open(log_path, "w") as log:
                    self.procs[name] = subprocess.Popen(
                        self.command(name),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=self.gateway_env,
                        cwd=ROOT,
                    )
            else:
                log_path.write_text("")
                self.procs[name] = zygote().start(name, self.command(name)[3:], self.env, str(log_path))
        deadline = time.monotonic() + 180
        for name in self.ports:
            while not is_serving(self.address(name), ROLE_SERVICES[name], timeout_s=1.0):
                if self.procs[name].poll() is not None or time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    log = (self.log_dir / f"{name}.log").read_text()[-3000:]
                    raise RuntimeError(f"{name} did not start:\n{log}")
                time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())


class VerboseStack(Stack):
    """A Stack whose services log at INFO, where RPC ends, cancellations and KV handovers are
    reported, for tests that read the services' logs."""

    def command(self, name: str) -> list[str]:
        cmd = super().command(name)
        at = cmd.index("serve")
        return [*cmd[:at], "--log-level", "INFO", *cmd[at:]]


def wait_until(predicate, what: str, timeout_s: float = 120.0) -> None:
    """Poll `predicate` until it holds; the test fails, saying `what` did not happen, after
    `timeout_s` (a guard against a broken build hanging, not a timing assertion)."""
    import pytest

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.05)


def replica_file_stack(
    model: Path, tmp_path: Path, stage: str, *gateway_flags: str
) -> tuple[Stack, Path, int]:
    """A Stack (logs in tmp_path/logs) whose gateway takes `stage`'s replicas from a replica file
    (`--replicas-file`, at first the stack's own replica) and serves HTTP: (the stack, the file,
    the HTTP port)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    http_port = free_port()
    stack = Stack(model, logs)
    replicas_file = tmp_path / "replicas.json"
    replicas_file.write_text(json.dumps({stage: [stack.address(stage)]}))
    stack.extra["gateway"] = [
        "--replicas-file",
        str(replicas_file),
        "--http-port",
        str(http_port),
        *gateway_flags,
    ]
    return stack, replicas_file, http_port
