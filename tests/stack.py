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
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from epd.cli.health import is_serving
from epd.cli.zygote import ServiceProcess, Zygote, preload_modules
from epd.model_runtime.loader import _FAMILIES
from epd.model_runtime.shared_weights import SharedWeights
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
STAGES = ("encoder", "prefill", "decode")


def serving_pid(port: int) -> int | None:
    """The pid of the process listening on loopback port `port` (a stopped one too: it still holds
    the socket; a dead one does not). By the socket, not the command line: a service started with
    `--port 0` has 0 there."""
    import psutil

    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid is not None:
            return conn.pid
    return None


def bound_ports(ports_file: Path, proc, what: str, timeout_s: float = 180.0) -> dict:
    """The ports a service started with `--port 0 --ports-file PORTS_FILE` bound, once it has
    written them; RuntimeError if `proc` exits first or `timeout_s` passes (a deadline for a
    start-up, not a timing assertion)."""
    from epd.transport.ports_file import read_ports_file

    deadline = time.monotonic() + timeout_s
    while (ports := read_ports_file(str(ports_file))) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not bind its ports (exit {proc.poll()})")
        time.sleep(0.05)
    return ports


def epd_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "epd.cli.main", *args]


TEST_INTERNAL_SECRET = secrets.token_hex(32)
"""An internal secret for tests that start services with it (`child_env(internal_secret=True)`):
the gateway presents it to the stages, decode to prefill; the test presents it with
`INTERNAL_AUTH_METADATA` when it calls a stage itself."""
INTERNAL_AUTH_METADATA = (("x-epd-internal-auth", TEST_INTERNAL_SECRET),)
INSECURE_STAGE = ("--insecure-no-internal-auth",)
"""What a stage started alone without the secret needs (tests call such stages directly)."""
QUICK_CLOSE = ("--close-timeout-s", "1")
"""For the stages of a test that leaves slow structured-output compiles running on purpose: after
the drain their close waits for those threads up to --close-timeout-s (30 s by default), longer
than a Stack waits for an exit (20 s, then SIGKILL); a test that does not test the close need not
wait for them."""


def child_env(internal_secret: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    if internal_secret:
        env["EPD_INTERNAL_SECRET"] = TEST_INTERNAL_SECRET
    return env


_zygote: Zygote | None = None
_zygote_weights: SharedWeights | None = None


def share_weights_of(model: Path) -> bool:
    """Have the session's zygote preload `model`'s weights (float32) for the services it forks to
    share, as `epd serve` does (epd/model_runtime/shared_weights.py): the stacks of the tests on it
    then run with shared weights. Only before the zygote starts (False after: the first model
    named wins; the others load their own)."""
    global _zygote_weights
    if _zygote is not None or _zygote_weights is not None:
        return False
    _zygote_weights = SharedWeights(str(model), "float32")
    return True


def zygote() -> Zygote:
    """The session's zygote, preloaded for every family the tests serve (and the weights of the
    model `share_weights_of` named before it started)."""
    global _zygote
    if _zygote is None:
        modules: dict[str, None] = {}
        for model_type, (module, _) in sorted(_FAMILIES.items()):
            modules.update(dict.fromkeys(preload_modules(model_type, module)))
        _zygote = Zygote(list(modules), _zygote_weights)
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
    loopback port the kernel picks, without the internal secret like a Stack's stages, with `flags`;
    its log `ROLE-2.log`): (address, process), stopped with SIGTERM on exit. It has bound its port,
    but may still be loading: `wait_until_serving`."""
    ports_file = log_dir / f"{role}-2.ports.json"
    ports_file.unlink(missing_ok=True)
    argv = ["serve", role, "--port", "0", "--ports-file", str(ports_file), "--model", str(model)]
    proc = zygote().start(
        f"{role}-2", [*argv, *INSECURE_STAGE, *flags], child_env(), str(log_dir / f"{role}-2.log")
    )
    try:
        yield f"127.0.0.1:{bound_ports(ports_file, proc, f'{role}-2')['grpc']}", proc
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


GatewayFlags = list[str] | Callable[["Stack"], list[str]]
"""The gateway's own flags in `Stack.extra`: a list, or a function of the stack for flags that name
the stages' addresses (`stack.address("prefill")`), known once the stages have bound their ports."""


class Stack:
    """Context manager; `.gateway` is the front door's address. Every service binds a port the
    kernel picks (`--port 0`, `--http-port auto` with `http=True`) and writes it to its ports file
    (`--ports-file`), which the stack reads: no port is picked here, closed, and passed on for
    another process to take in between (a parallel run did). The stages start first; the gateway,
    once they have bound, is given their addresses."""

    def __init__(
        self,
        model: Path,
        log_dir: Path,
        extra: Mapping[str, GatewayFlags] | None = None,
        internal_secret: bool = False,
        gateway_env: dict[str, str] | None = None,
        http: bool = False,
        stages: Stack | None = None,
    ) -> None:
        """gateway_env: variables set in the gateway's environment alone (over the stages' own).
        http: the gateway serves the HTTP API too, on `.http_port`.
        stages: another Stack, entered, whose encoder, prefill and decode this one's gateway calls
        instead of starting its own (`gateway_over`)."""
        self.stages = stages
        self.model = str(model)
        self.log_dir = log_dir
        self.extra: dict[str, GatewayFlags] = dict(extra or {})
        self.env = child_env(internal_secret)  # with the secret: see TEST_INTERNAL_SECRET
        self.internal_secret = internal_secret
        self.gateway_env = {**self.env, **(gateway_env or {})}
        self.http = http
        self.ports: dict[str, int] = {}
        """Each service's gRPC port, once it has bound it (in `__enter__`)."""
        self.http_port: int | None = None
        self.procs: dict[str, subprocess.Popen | ServiceProcess] = {}

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.ports['gateway']}"

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def ports_file(self, name: str) -> Path:
        return self.log_dir / f"{name}.ports.json"

    def command(self, name: str) -> list[str]:
        """`name`'s command line: on port 0 (--http-port auto) at first; once it has bound, on the
        ports it bound, so that a service a test restarts listens where the others were told."""
        extra = self.extra.get(name, [])
        own = extra(self) if callable(extra) else extra
        ports = ["--port", str(self.ports.get(name, 0)), "--ports-file", str(self.ports_file(name))]
        if name == "gateway":
            stages = [f"--{stage}={self.address(stage)}" for stage in STAGES]
            http = ["--http-port", str(self.http_port or "auto")] if self.http else []
            args = ["serve", "gateway", *ports, *stages, *http]
        else:
            args = ["serve", name, *ports, "--model", self.model]
            if not self.internal_secret and not {"--tls-client-ca", "--internal-secret-file"} & set(own):
                args += INSECURE_STAGE
        return epd_command(*args, *own)

    def __enter__(self) -> Stack:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        groups: tuple[tuple[str, ...], ...] = (STAGES, ("gateway",))
        if self.stages is not None:
            self.ports.update({name: self.stages.ports[name] for name in STAGES})
            groups = (("gateway",),)
        try:
            for group in groups:
                for name in group:
                    self._start(name)
                for name in group:
                    bound = bound_ports(self.ports_file(name), self.procs[name], name)
                    self.ports[name] = bound["grpc"]
                    if name == "gateway" and self.http:
                        self.http_port = bound["http"]
            deadline = time.monotonic() + 180
            for name in self.procs:
                while not is_serving(self.address(name), ROLE_SERVICES[name], timeout_s=1.0):
                    if self.procs[name].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{name} did not start")
                    time.sleep(0.2)
        except RuntimeError as exc:
            self.__exit__(None, None, None)
            name = str(exc).split()[0]
            log = (self.log_dir / f"{name}.log").read_text()[-3000:]
            raise RuntimeError(f"{exc}:\n{log}") from None
        return self

    def _start(self, name: str) -> None:
        log_path = self.log_dir / f"{name}.log"
        self.ports_file(name).unlink(missing_ok=True)  # a file left by an earlier stack in this directory
        if name == "gateway":  # no model, no torch: a plain interpreter, as `epd serve` starts it
            with open(log_path, "w") as log:
                self.procs[name] = subprocess.Popen(
                    self.command(name), stdout=log, stderr=subprocess.STDOUT, env=self.gateway_env, cwd=ROOT
                )
        else:
            log_path.write_text("")
            self.procs[name] = zygote().start(name, self.command(name)[3:], self.env, str(log_path))

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
        own = all(p.poll() is None for p in self.procs.values())
        return own and (self.stages is None or self.stages.alive())


def gateway_over(
    stages: Stack, log_dir: Path, gateway_flags: GatewayFlags, http: bool = False, **kwargs
) -> Stack:
    """A Stack that starts only a gateway, with its own flags (`gateway_flags`), over `stages`'s
    encoder, prefill and decode (an entered Stack: the session's `shared_stack`, or a module's).
    For tests of what the gateway's own flags do: a gateway starts in a plain interpreter in a
    second or two, the three model services take most of a stack's ~10-15 s on two cores. The
    stages are shared, so their caches may hold earlier tests' media and prompts: a test that
    counts encodes, cache hits or a stage's log lines starts a Stack of its own."""
    return Stack(
        Path(stages.model),
        log_dir,
        extra={"gateway": gateway_flags},
        internal_secret=stages.internal_secret,
        http=http,
        stages=stages,
        **kwargs,
    )


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


def replica_file_stack(model: Path, tmp_path: Path, stage: str, *gateway_flags: str) -> tuple[Stack, Path]:
    """A Stack (logs in tmp_path/logs) whose gateway takes `stage`'s replicas from a replica file
    (`--replicas-file`, at first the stack's own replica, written once it has bound) and serves
    HTTP (`.http_port`): (the stack, the file)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    replicas_file = tmp_path / "replicas.json"

    def flags(stack: Stack) -> list[str]:
        replicas_file.write_text(json.dumps({stage: [stack.address(stage)]}))
        return ["--replicas-file", str(replicas_file), *gateway_flags]

    return Stack(model, logs, extra={"gateway": flags}, http=True), replicas_file


def launch_stack(
    model: Path, log: Path, ports_file: Path, *flags: str, log_level: str = "WARNING"
) -> tuple[subprocess.Popen, str]:
    """`epd --log-level LOG_LEVEL serve` with `flags`, every port one the kernel picks, read from
    --ports-file (the launcher reads each service's, gives the gateway the stages' and restarts each
    on its own), its stderr (and its services') in `log`: (the launcher, its "stack ready" line),
    once ready."""
    ports = ("--encoder-port", "0", "--prefill-port", "0", "--decode-port", "0", "--gateway-port", "0")
    command = epd_command("--log-level", log_level, "serve", "--model", str(model), *ports, "--http-port",
                          "auto", "--ports-file", str(ports_file), *flags)  # fmt: skip
    with open(log, "w") as stderr:
        launcher = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=child_env(), cwd=ROOT
        )
    ready = launcher.stdout.readline() if launcher.stdout else ""
    if "stack ready" not in ready:
        launcher.kill()
        launcher.wait()
        raise AssertionError(f"exit {launcher.poll()}: {ready!r}\n{log.read_text()}")
    return launcher, ready


def stop_launcher(launcher: subprocess.Popen) -> int | None:
    """SIGTERM to the launcher (SIGKILL if it has not stopped within 60 s): its exit code."""
    launcher.send_signal(signal.SIGTERM)
    try:
        return launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
