"""`epd serve` with no role: the launcher, which starts the stack's services as child processes
(the gateway a plain interpreter, the model services forked from one zygote, epd/cli/zygote.py),
waits for them to serve, supervises them and stops them in order.

The stack (`epd serve [--encoders N --prefills N --decodes N]`) is supervised once it has come
up: a service that exits, or stops answering its gRPC health for --health-timeout, is restarted
with backoff while the others keep serving, and one that crash-loops is given up on
(epd/cli/supervisor.py); only SIGTERM/SIGINT stops the stack. Before it has come up, and at any
time for exit codes 2 and 3 (a restart would fail the same way), a service that exits stops it;
so does one not serving --start-timeout after the launch (a restarted one is killed and restarted).
Its services share an internal secret the launcher makes (`stack_security_flags`,
epd/cli/stack_security.py): the stages refuse calls without it; with --tls-cert every port is TLS
and the stages take only the stack's own certificate (docs/security.md). Their command lines:
epd/cli/stack_commands.py.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epd.cli.flags.arg_types import ANY_FREE_PORT
from epd.cli.health import HealthChannels, answer_on, is_serving
from epd.cli.port_holder import port_holder, port_taken
from epd.cli.process_exit import EXIT_FAILED, EXIT_MODEL, EXIT_OK, EXIT_USAGE
from epd.cli.stack_commands import (
    COMMAND_PREFIX_WORDS,
    MODEL_ROLES,
    check_max_model_len,
    port_clash,
    replica_name,
    replica_ports,
    stack_commands,
    stage_flag_problem,
)
from epd.cli.stack_security import (
    STACK_DIR_PREFIX,
    StackFiles,
    services_environment,
    stack_security_flags,
    stack_transport,
)
from epd.cli.supervisor import Replica, RestartPolicy, State, stage_lost
from epd.transport.ports_file import read_ports_file, write_ports_file

if TYPE_CHECKING:
    from epd.cli.zygote import ServiceProcess
    from epd.model_runtime.shared_weights import SharedWeights

    Service = subprocess.Popen | ServiceProcess


log = logging.getLogger(__name__)

# After its grace period, how long the launcher still waits for a service before SIGKILL
# (`stop_wait_s`): what it does after its drain (a stage: `_BEFORE_CLOSE_S`, then its threads' one
# deadline, --close-timeout-s), then its exit. 5 s in all cut a stage's close short, whose threads
# get 30 s by default (a stuck model step or prompt render).
_BEFORE_CLOSE_S = 2.0
"""The longest a stage spends after its drain before it closes its threads: decode's receipts to
prefill (`CONFIRM_WAIT_S`, 2 s)."""
_GATEWAY_AFTER_DRAIN_S = 7.0
"""The longest the stack's gateway spends after its drain: the statuses of the calls it cut
(`CUT_MARGIN_S`, 2 s), then the KV releases still running (`RELEASES_WAIT_S`, 5 s). Both written
out, as their modules load torch, which the launcher does not; tests/unit/cli/test_launcher.py adds
the code's bounds up (and tests/unit/deploy gives the manifests as much)."""
_EXIT_MARGIN_S = 5.0
# The gateway first: its requests in flight still need the stages to finish.
_STOP_ORDER = (("gateway",), ("encoder", "prefill", "decode"))
LAUNCHER_PID_ENV = "EPD_LAUNCHER_PID"  # set for the stack's gateway: the pid it must not outlive
# Supervision (epd/cli/supervisor.py): how often the launcher looks at its children's exits, and
# asks each for its gRPC health (each check waits this long for an answer).
_POLL_S = 0.2
_HEALTH_INTERVAL_S = 1.0
_HEALTH_CHECK_TIMEOUT_S = 2.0
LOOPBACK = "127.0.0.1"  # the stack's services' interface (`_Slot.address`)


def stop_wait_s(grace_period_s: float, close_timeout_s: float) -> float:
    """How long the launcher waits for a service from its SIGTERM to its exit before SIGKILL: its
    drain, what it does after it (a stage: `_BEFORE_CLOSE_S`, then its close; the gateway:
    `_GATEWAY_AFTER_DRAIN_S`), and the exit itself."""
    after_drain_s = max(_GATEWAY_AFTER_DRAIN_S, _BEFORE_CLOSE_S + close_timeout_s)
    return grace_period_s + after_drain_s + _EXIT_MARGIN_S


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    """The stack's supervision from its flags: --start-timeout bounds the start-up and every restart
    alike (a model slower to load than the one would be killed at each of the other)."""
    return RestartPolicy(health_timeout_s=args.health_timeout, start_timeout_s=args.start_timeout)


def shared_weights(args: argparse.Namespace) -> SharedWeights | None:
    """What the zygote loads once for every model service to share (--share-weights, the default),
    or None: each loads its own (--no-share-weights; a GPU, or --linear-kernel onednn, whose
    services would not use the shared copy as it is). Says which at INFO."""
    from epd.model_runtime.shared_weights import SharedWeights

    why_not = (
        "--no-share-weights"
        if not args.share_weights
        else f"--device {args.device}"
        if args.device != "cpu"
        else "--linear-kernel onednn"
        if args.linear_kernel != "torch"
        else None
    )
    if why_not is not None:
        log.info("weights: each model service loads its own copy (%s)", why_not)
        return None
    log.info(
        "weights: loaded once (%s) by the zygote and shared, copy on write, by every model service "
        "(--no-share-weights: each loads its own)",
        args.dtype,
    )
    return SharedWeights(args.model, args.dtype)


def serve_stack(args: argparse.Namespace) -> int:
    import tempfile

    from epd.cli.leftovers import remove_dead_stacks
    from epd.cli.zygote import Zygote, preload_modules
    from epd.model_runtime.loader import ModelLoadError, check_model_dir, family_module, resolve_model_path
    from epd.model_runtime.threads import (
        BOARD_ENV,
        BOARD_PREFIX,
        board_directory,
        new_board_path,
        remove_board,
        shared_cores_environment,
        stack_board_name,
    )
    from epd.transport import security

    signals = _Signals()
    remove_dead_stacks(
        tempfile.gettempdir(), STACK_DIR_PREFIX, str(board_directory()), stack_board_name, BOARD_PREFIX
    )
    if (problem := port_clash(args) or stage_flag_problem(args)) is not None:
        print(f"epd serve: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        # Once here, not in each child: the default model is built (if it must be) once, not three
        # times racing; and a broken checkpoint is one line now, not four processes failing.
        args.model = resolve_model_path(args.model)
        model_type = check_model_dir(args.model)
        check_max_model_len(args.model, args.max_model_len)
    except ModelLoadError as exc:
        print(f"epd: {exc}", file=sys.stderr)
        return EXIT_MODEL
    policy = restart_policy(args)
    # The stages refuse calls without the stack's own secret: any local user could otherwise call
    # them directly, past the gateway's API key and limits. One given to `epd serve`
    # ($EPD_INTERNAL_SECRET, inherited by the services) is used instead: a tool can present it.
    files = StackFiles()
    try:
        flags = stack_security_flags(args, files)
        security.configure(stack_transport(args))  # the health checks below speak TLS when the stack does
    except ValueError as exc:
        files.remove()
        print(f"epd serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    ports = {"gateway": args.gateway_port} | {
        replica_name(role, i): port
        for role, role_ports in replica_ports(args).items()
        for i, port in enumerate(role_ports)
    }
    now = time.monotonic()
    slots = [
        _Slot(name, name.partition("[")[0], ports[name], [], Replica(name, policy, now))
        for name in ["gateway", *(n for n in ports if n != "gateway")]
    ]
    for slot in slots:
        # Port 0 (--http-port auto): the service binds a free port and names it in its ports file,
        # read before the launcher dials it; restarts get the command with the port it bound.
        if slot.port == 0 or (slot.role == "gateway" and args.http_port == ANY_FREE_PORT):
            slot.ports_file = os.path.join(files.dir, f"{slot.name}.ports.json")
    if isinstance(args.http_port, int) and args.http_port:
        slots[0].http_port = args.http_port

    # The gateway routes over the replicas this file lists, re-read when it changes: a replica
    # restarted on another port (its own was taken while it was down) is routed to there.
    replicas_file = os.path.join(files.dir, "replicas.json")

    def command(slot: _Slot) -> list[str]:
        """Its command line, the gateway's with the stages' bound ports (`stack_commands`) and the
        replica file that lists them."""
        bound = {role: [s.port for s in slots if s.role == role] for role in MODEL_ROLES}
        words = [
            *stack_commands(args, bound)[slot.name],
            *flags["gateway" if slot.role == "gateway" else "stage"],
        ]
        if slot.role == "gateway":
            _write_replicas(replicas_file, slots)
            words += ["--replicas-file", replicas_file]
        return [*words, "--ports-file", slot.ports_file] if slot.ports_file else words

    # The stages' shared busy board: with --num-threads auto, a model call takes the cores the
    # other stages are not using at that moment (epd/model_runtime/threads.py).
    board = new_board_path(files.stack_id)
    # Here, not only in `env`: the zygote is started with the launcher's environment and loads
    # torch's OpenMP (which reads its settings once) before it forks the services.
    os.environ.update(shared_cores_environment(dict(os.environ)))
    env = {**services_environment(os.environ), BOARD_ENV: board}
    # The model services are forked from one process that imported torch and the family's modules
    # once (epd/cli/zygote.py): they share those pages and skip those imports, and the weights it
    # loaded once (epd/model_runtime/shared_weights.py).
    zygote = Zygote(preload_modules(model_type, family_module(model_type)), shared_weights(args))

    def start(slot: _Slot) -> Service:
        if not slot.command:  # the first start: the stages it needs bound (`_wait_ready`)
            slot.command = command(slot)
        # Own process group: a terminal's Ctrl-C reaches only this launcher, which stops the
        # services in order (_STOP_ORDER); PDEATHSIG still ends them if it is killed (the gateway
        # arms it itself, told the launcher's pid). The gateway holds no model, so it is a plain
        # interpreter (no torch).
        if slot.role == "gateway":
            return subprocess.Popen(
                slot.command, process_group=0, env={**env, LAUNCHER_PID_ENV: str(os.getpid())}
            )
        return zygote.start(slot.name, slot.command[COMMAND_PREFIX_WORDS:], env)

    # With one replica per stage the gateway is started first: it comes up while the zygote imports,
    # and turns SERVING when every stage does. With more, it would turn SERVING once one replica of
    # each stage serves, and route to the others only from its next stage check: it is started
    # once they all serve (`_wait_ready`), so that "ready" means every replica is in routing.
    # So is it when a stage binds a free port: the gateway is given the port it bound.
    staggered = max(args.encoders, args.prefills, args.decodes) > 1 or any(
        s.port == 0 for s in slots if s.role != "gateway"
    )
    try:
        for slot in slots:
            if not (staggered and slot.role == "gateway"):
                slot.proc = start(slot)
        return _supervise(slots, start, signals, policy, args.ports_file, replicas_file)
    finally:
        _stop_all(slots, stop_wait_s(args.grace_period, args.close_timeout_s), signals)
        zygote.stop()
        remove_board(board)
        files.remove()


def _supervise(
    slots: list[_Slot],
    start: Callable[[_Slot], Service],
    signals: _Signals,
    policy: RestartPolicy,
    ports_file: str = "",
    replicas_file: str = "",
) -> int:
    """Wait for every service to serve (one that exits meanwhile stops the stack: a bad port or
    flag would only fail again), then keep them running until a signal (epd/cli/supervisor.py):
    restart what exits or stops answering, give up on what crash-loops. `replicas_file`: the
    gateway's, where a stage replica restarted on another port is listed (`_restart`)."""
    if (
        code := _wait_ready(slots, start, signals, policy.start_timeout_s)
    ) is not None or signals.stop.is_set():
        return code or EXIT_OK
    by_role: dict[str, list[str]] = {}
    for slot in slots:
        by_role.setdefault(slot.role, []).append(slot.address)
    if ports_file:
        _write_stack_ports(ports_file, slots)
    print(
        "epd: stack ready; "
        + "; ".join(f"{role} at {','.join(addresses)}" for role, addresses in by_role.items()),
        flush=True,
    )
    checks: dict[int, Future[bool | None]] = {}  # slot index -> its health check in flight
    next_check_at = 0.0
    # Not waited for on the way out: a check of a silent service would hold a signal up.
    pool = ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix="epd-health")
    channels = HealthChannels()  # one per service process, kept from one check to the next
    try:
        while not signals.stop.wait(_POLL_S):
            now = time.monotonic()
            for slot in slots:
                if slot.replica.running and slot.proc is not None and (code := slot.proc.poll()) is not None:
                    if code in (EXIT_MODEL, EXIT_USAGE):  # the model or a flag: a restart fails the same way
                        return _exited(slot.name, code)
                    if (stop := _on_exit(slot, slots, f"exited with code {code}", now)) is not None:
                        return stop
            if not checks and now >= next_check_at:
                next_check_at = now + _HEALTH_INTERVAL_S
                # Not one moved that has not bound yet: its old port is another's.
                asked = [i for i, s in enumerate(slots) if s.replica.running and not s.ports_file]
                processes = [(slots[i].address, _pid(slots[i])) for i in asked]
                checks = {
                    i: pool.submit(answer_on, channel, _HEALTH_CHECK_TIMEOUT_S)
                    for i, channel in zip(asked, channels.channels(processes))
                }
            if checks and all(f.done() for f in checks.values()):
                if (stop := _on_health(slots, checks, time.monotonic())) is not None:
                    return stop
                checks = {}
            for slot in slots:
                if slot.replica.restart_due(now):
                    _restart(slot, start, now, replicas_file)
                elif not (slot.ports_file and slot.replica.running):
                    continue
                elif slot.read_ports_file():
                    # A replica moved to a free port has bound it: route to it, tell whoever reads ours.
                    _write_replicas(replicas_file, slots)
                    if ports_file:
                        _write_stack_ports(ports_file, slots)
                    print(f"epd: {slot.name} now listens on {slot.address}", file=sys.stderr, flush=True)
                elif (waited_s := slot.replica.unresponsive_s(now)) is not None:
                    # Its health is asked only once it has bound (its old port is another's), so the
                    # start timeout is enforced here until then: else one hung before binding (stages
                    # bind before they load) would stay "starting" for ever.
                    why = f"had not bound a port after {waited_s:.0f} s"
                    if (stop := _kill(slot, slots, why, now)) is not None:
                        return stop
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        channels.close()  # a check still in flight ends CANCELLED: no answer, read by no one
    return EXIT_OK


def _pid(slot: _Slot) -> int:
    assert slot.proc is not None  # running
    return slot.proc.pid


def _restart(slot: _Slot, start: Callable[[_Slot], Service], now: float, replicas_file: str) -> None:
    """Start `slot` again, on the port it had unless another process took it while it was down
    (binding it would fail, and then again at every restart: a crash loop). A stage replica then
    moves to a free port the kernel picks (`_Slot.move_to_free_port`; once it has bound, the
    supervision loop lists it in the gateway's `replicas_file`). The gateway cannot move (its clients
    know its ports): no start, one line naming the port and its holder, another look after a backoff
    (`Replica.port_taken`). The look races another process binding the port just after it: the
    restart then fails to bind and exits, and the next restart looks again."""
    if not slot.ports_file:  # one that moved and never bound is started on port 0 again
        taken = [port for port in (slot.port, slot.http_port) if port and port_taken(LOOPBACK, port)]
        if taken:
            held = "; ".join(
                f"port {port} is held by {port_holder(port) or 'another process'}" for port in taken
            )
            if slot.role == "gateway" or not replicas_file:
                delay_s = slot.replica.port_taken(now)
                print(
                    f"epd: cannot restart {slot.name}: {held}; trying again in {delay_s:g} s",
                    file=sys.stderr,
                    flush=True,
                )
                return
            print(f"epd: {slot.name}: {held}; restarting it on a free port", file=sys.stderr, flush=True)
            slot.move_to_free_port(os.path.join(os.path.dirname(replicas_file), f"{slot.name}.ports.json"))
    if slot.ports_file:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot.ports_file)  # an earlier start's: the port that one bound is gone
    slot.proc = start(slot)
    slot.replica.restarted(now)
    print(
        f"epd: {slot.name} restarted (pid {slot.proc.pid}, restart {slot.replica.restarts})",
        file=sys.stderr,
        flush=True,
    )


def _write_replicas(path: str, slots: list[_Slot]) -> None:
    """The gateway's replica file (`--replicas-file`): each stage's replicas' addresses, as now,
    replaced whole as a ports file is (the gateway never reads half of it)."""
    write_ports_file(path, {role: [s.address for s in slots if s.role == role] for role in MODEL_ROLES})


def _write_stack_ports(path: str, slots: list[_Slot]) -> None:
    """`epd serve --ports-file`: the gateway's ports and each stage's replicas' ports, as now."""
    gateway, stages = slots[0], slots[1:]
    bound = {role: [s.port for s in stages if s.role == role] for role in MODEL_ROLES}
    http = {} if gateway.http_port is None else {"http": gateway.http_port}
    write_ports_file(path, {"grpc": gateway.port, **http, **bound})


def _wait_ready(
    slots: list[_Slot], start: Callable[[_Slot], Service], signals: _Signals, ready_timeout_s: float
) -> int | None:
    """None once every service serves (or a signal came); else the stack's exit code. A service not
    started yet (the gateway, with replicas) is started once all the others serve."""
    deadline = time.monotonic() + ready_timeout_s
    pending = list(slots)
    while pending and not signals.stop.is_set():
        if all(slot.proc is None for slot in pending):
            for slot in pending:
                slot.proc = start(slot)
        for slot in list(pending):
            if slot.proc is None:
                continue
            if (code := slot.proc.poll()) is not None:
                return _exited(slot.name, code)
            if slot.ports_file and not slot.read_ports_file():  # not bound yet
                continue
            if is_serving(slot.address, timeout_s=1.0):
                slot.replica.answered(time.monotonic(), serving=True)
                pending.remove(slot)
        if time.monotonic() > deadline:
            not_serving = [slot.name for slot in pending if slot.proc is not None]
            not_started = [slot.name for slot in pending if slot.proc is None]
            print(not_ready_message(ready_timeout_s, not_serving, not_started), file=sys.stderr)
            return EXIT_FAILED
        signals.stop.wait(0.2)
    return None


def not_ready_message(ready_timeout_s: float, not_serving: list[str], not_started: list[str]) -> str:
    """The line the launcher exits with when the stack is not ready after `ready_timeout_s`: the
    services it started that do not serve yet apart from those it never started (the gateway, with
    every stage on port 0, starts only once the stages serve: it waited, it did not fail)."""
    parts = []
    if not_serving:
        parts.append(f"started, not serving yet: {', '.join(not_serving)}")
    if not_started:
        parts.append(f"not started (waiting for the others to serve): {', '.join(not_started)}")
    return (
        f"epd: not ready after {ready_timeout_s:g} s: {'; '.join(parts)} "
        "(a model slower to load needs a longer --start-timeout)"
    )


def _on_health(slots: list[_Slot], checks: dict[int, Future[bool | None]], now: float) -> int | None:
    """Record the health answers; kill a service silent for too long (it is restarted like one that
    exited). The stack's exit code if that lost a stage, else None."""
    for i, check in checks.items():
        slot, answer = slots[i], check.result()
        if not slot.replica.running:  # it exited while its check was in flight
            continue
        was_starting = slot.replica.state is State.STARTING
        if answer is not None:
            slot.replica.answered(now, serving=answer)
            if was_starting and slot.replica.state is State.SERVING:
                print(f"epd: {slot.name} serving again at {slot.address}", file=sys.stderr, flush=True)
        if (silent_s := slot.replica.unresponsive_s(now)) is None:
            continue
        why = "did not answer its health check for" if not was_starting else "was not serving after"
        if (stop := _kill(slot, slots, f"{why} {silent_s:.0f} s", now)) is not None:
            return stop
    return None


def _kill(slot: _Slot, slots: list[_Slot], why: str, now: float) -> int | None:
    """Kill a service past its health or start timeout (`why` says which); it is then restarted
    like one that exited (`_on_exit`, whose result this is)."""
    assert slot.proc is not None
    pid = slot.proc.pid
    slot.proc.kill()  # SIGKILL: also ends a stopped (SIGSTOP) or hung process
    slot.proc.wait()
    return _on_exit(slot, slots, f"{why}; killed it", now, pid)


def _on_exit(slot: _Slot, slots: list[_Slot], why: str, now: float, pid: int | None = None) -> int | None:
    """One line on stderr about a service that went away, and its restart or crash loop; the stack's
    exit code if none of its role is left, else None."""
    assert slot.proc is not None
    pid = slot.proc.pid if pid is None else pid
    decision = slot.replica.exited(now)
    if not decision.given_up:
        print(
            f"epd: {slot.name} (pid {pid}) {why}; restarting in {decision.delay_s:g} s",
            file=sys.stderr,
            flush=True,
        )
        return None
    window_s = slot.replica.policy.crash_loop_window_s
    print(
        f"epd: {slot.name} (pid {pid}) {why}; crash-looping ({decision.recent_exits} exits in {window_s:.0f} s); "
        "giving up on it",
        file=sys.stderr,
        flush=True,
    )
    if stage_lost([s.replica for s in slots if s.role == slot.role]):
        print(f"epd: no {slot.role} left; stopping the stack", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return None


def _exited(name: str, code: int) -> int:
    if code == EXIT_MODEL:
        return EXIT_MODEL  # it said why, in one line, on the stderr we share
    print(f"epd: {name} exited with code {code}; stopping the stack", file=sys.stderr)
    return EXIT_USAGE if code == EXIT_USAGE else EXIT_FAILED


def _stop_all(slots: list[_Slot], timeout_s: float, signals: _Signals) -> None:
    """SIGTERM group by group (_STOP_ORDER), each given `timeout_s` to drain and exit, then SIGKILL.
    A further signal to the launcher is passed on at once."""
    for group in _STOP_ORDER:
        running = [s.proc for s in slots if s.role in group and s.proc is not None and s.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        passed_on = min(signals.count, 1)  # our SIGTERM stands for the first (graceful) one
        deadline = time.monotonic() + timeout_s
        while any(proc.poll() is None for proc in running) and time.monotonic() < deadline:
            time.sleep(0.02)  # also keeps two SIGTERMs apart, so that the kernel does not merge them
            if signals.count > passed_on:
                passed_on = signals.count
                for proc in running:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@dataclass
class _Slot:
    """One process of the stack (the gateway, or one replica of a stage) and its restart bookkeeping."""

    name: str
    role: str
    port: int
    command: list[str]
    """Built at its first start (the gateway's needs the stages' bound ports)."""
    replica: Replica
    proc: Service | None = None
    ports_file: str = ""
    """Where it writes the ports it bound, when one is 0 (`--ports-file`); "" once read."""
    http_port: int | None = None
    """The gateway's HTTP API's port (None: off, or not known yet)."""

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def read_ports_file(self) -> bool:
        """Whether it has bound: its ports read from its ports file, and put in its command line in
        place of 0 and auto (a restart listens where the gateway and clients were told it does)."""
        if (bound := read_ports_file(self.ports_file)) is None:
            return False
        self.port, self.http_port = bound["grpc"], bound.get("http")
        for flag, port in (("--port", self.port), ("--http-port", self.http_port)):
            if port is not None and flag in self.command:
                self.command[self.command.index(flag) + 1] = str(port)
        self.ports_file = ""
        return True

    def move_to_free_port(self, ports_file: str) -> None:
        """Its next start binds a free port the kernel picks and names it in `ports_file`, read
        as at its first start (`read_ports_file`), which puts it in the command line again."""
        self.ports_file = ports_file
        self.command[self.command.index("--port") + 1] = "0"
        if "--ports-file" in self.command:
            self.command[self.command.index("--ports-file") + 1] = ports_file
        else:
            self.command += ["--ports-file", ports_file]


class _Signals:
    """`stop_signals()` (SIGINT, SIGTERM, SIGHUP) in the launcher: the first stops the stack
    gracefully, a later one is passed on, which makes the services cut their calls in flight short."""

    def __init__(self) -> None:
        from epd.transport.server import stop_signals

        self.stop = threading.Event()
        self.count = 0
        for sig in stop_signals():
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.count += 1
        self.stop.set()
