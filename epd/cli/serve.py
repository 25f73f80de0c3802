"""`epd serve [ROLE]`: one service in this process, or the whole stack as child processes.

Exit codes (the launcher passes a child's on): 0 stopped by SIGTERM/SIGINT, after draining;
1 a service failed or could not start (port in use, ...), or every replica of a stage was given
up on; 2 a bad flag value; 3 the model cannot be loaded. Every failure to start is one line on
stderr saying why (tracebacks go to the log, at DEBUG). The launcher checks the model directory
before it starts any service and imports no torch: only the services load the model.

The stack (`epd serve [--encoders N --prefills N --decodes N]`) is supervised once it has come
up: a service that exits, or stops answering its gRPC health for --health-timeout, is restarted
with backoff while the others keep serving, and one that crash-loops is given up on
(epd/cli/supervisor.py); only SIGTERM/SIGINT stops the stack. Before it has come up, and at any
time for exit codes 2 and 3 (a restart would fail the same way), a service that exits stops it.
Its services share an internal secret the launcher makes (`stack_security_flags`): the stages
refuse calls without it; with --tls-cert every port is TLS and the stages take only the stack's
own certificate (docs/security.md).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from epd.cli.health import health_answer, is_serving
from epd.cli.process_exit import exit_now
from epd.cli.supervisor import Replica, RestartPolicy, State, stage_lost

if TYPE_CHECKING:
    from epd.cli.configs import ColocatedStages
    from epd.cli.zygote import ServiceProcess

    Service = subprocess.Popen | ServiceProcess

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MODEL = 0, 1, 2, 3
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
out, as their modules load torch, which the launcher does not; tests/unit/cli/test_serve.py adds
the code's bounds up (and tests/unit/deploy gives the manifests as much)."""
_EXIT_MARGIN_S = 5.0
# The gateway first: its requests in flight still need the stages to finish.
_STOP_ORDER = (("gateway",), ("encoder", "prefill", "decode"))
_PR_SET_PDEATHSIG = 1
_LAUNCHER_ENV = "EPD_LAUNCHER_PID"  # set for the stack's gateway: the pid it must not outlive
MODEL_ROLES = ("encoder", "prefill", "decode")
_COMMAND_PREFIX = 3  # python -m epd.cli.main
# Supervision (epd/cli/supervisor.py): how often the launcher looks at its children's exits, and
# asks each for its gRPC health (each check waits this long for an answer).
_POLL_S = 0.2
_HEALTH_INTERVAL_S = 1.0
_HEALTH_CHECK_TIMEOUT_S = 2.0
_GATEWAY_STAGE_CHECK_S = 1.0


def stop_wait_s(grace_period_s: float, close_timeout_s: float) -> float:
    """How long the launcher waits for a service from its SIGTERM to its exit before SIGKILL: its
    drain, what it does after it (a stage: `_BEFORE_CLOSE_S`, then its close; the gateway:
    `_GATEWAY_AFTER_DRAIN_S`), and the exit itself."""
    after_drain_s = max(_GATEWAY_AFTER_DRAIN_S, _BEFORE_CLOSE_S + close_timeout_s)
    return grace_period_s + after_drain_s + _EXIT_MARGIN_S


def run_serve(args: argparse.Namespace) -> int:
    if args.role is None and not args.colocate:
        return serve_stack(args)
    if _LAUNCHER_ENV in os.environ:  # the stack's gateway: end with the launcher
        _die_with_parent(int(os.environ.pop(_LAUNCHER_ENV)))
    code = serve_role(args)
    _log_threads_left()
    exit_now(code)  # the service has drained and stopped (`epd.cli.process_exit`)


def serve_role(args: argparse.Namespace) -> int:
    """One service until SIGTERM/SIGINT. Its own handlers are installed before the model loads
    (`epd.transport.server.run_service`); until then SIGTERM stops it like Ctrl-C, quietly."""
    from epd.model_runtime.loader import ModelLoadError
    from epd.transport.aio_cancel import shield_grpc_batches

    name = args.role or "colocated"

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        try:
            _secure_transport(args)
            # Calls cut mid-operation (clients gone, deadlines) leak grpcio's native memory otherwise.
            shield_grpc_batches()
            service = _service(args)  # imports torch: seconds in which a signal may come
        except ValueError as exc:  # a config's own check of a flag value
            print(f"epd serve {name}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        asyncio.run(service)
    except KeyboardInterrupt:
        return EXIT_OK
    except ModelLoadError as exc:
        log.debug("%s: loading the model failed", name, exc_info=exc)
        print(f"epd: {name} {exc}", file=sys.stderr)
        return EXIT_MODEL
    except OSError as exc:  # e.g. the port is taken
        log.debug("%s: start-up failed", name, exc_info=exc)
        print(f"epd: {name}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _secure_transport(args: argparse.Namespace) -> None:
    """TLS and the internal secret of this process's channels to stages, before any is opened;
    ValueError (exit 2) for an unusable file, or a stage that would serve anyone on the network
    (`configs.internal_auth_problem`)."""
    from epd.cli import configs
    from epd.transport import security

    transport = configs.transport_security(args)
    if (problem := configs.internal_auth_problem(args, transport)) is not None:
        raise ValueError(problem)
    security.configure(transport)


STACK_DIR_PREFIX = "epd-stack-"


class _StackFiles:
    """What the launcher hands its services in files rather than on command lines or in the
    environment (so no grandchild or `ps` sees it): a fresh internal secret, the API keys, and
    the gateway's client-CA bundle. One 0700 directory of 0600 files, removed with the stack (or,
    when the launcher was killed, by the next one of this temp directory: its pid is in the name,
    epd/cli/leftovers.py)."""

    def __init__(self) -> None:
        import tempfile

        self.dir = tempfile.mkdtemp(prefix=f"{STACK_DIR_PREFIX}{os.getpid()}-")
        self.stack_id = os.path.basename(self.dir)[len(STACK_DIR_PREFIX) :]
        """`<pid>-<random>`: the threads board is named after it, to be removed with it."""

    def write(self, name: str, data: bytes) -> str:
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def stack_security_flags(args: argparse.Namespace, files: _StackFiles) -> dict[str, list[str]]:
    """The flags each kind of service of the stack gets ("stage", "gateway") for the internal
    secret, the API keys, the per-key limit and TLS. ValueError: an unusable combination or file.

    With --tls-cert every port serves TLS; the stages require client certificates of --tls-ca
    (mTLS: only the stack's gateway and decoders, which present --tls-cert, get in); the gateway
    requires them of --tls-client-ca when given, trusting --tls-ca too so that the launcher's own
    health checks (which present --tls-cert) still reach it."""
    import secrets

    from epd.cli import configs
    from epd.transport import security

    stage: list[str] = []
    gateway: list[str] = []
    if not args.internal_secret_env:  # else the services read $EPD_INTERNAL_SECRET themselves
        secret = files.write("internal-secret", secrets.token_hex(32).encode())
        followed = [
            "--internal-secret-file",
            secret,
            "--secret-check-interval-s",
            repr(args.secret_check_interval_s),
        ]
        stage += followed
        gateway += followed
    if keys := configs.api_keys(args):
        gateway += ["--api-key-file", files.write("api-keys", "\n".join(keys).encode() + b"\n")]
    if args.max_requests_per_api_key:
        gateway += ["--max-requests-per-api-key", str(args.max_requests_per_api_key)]
    tls = stack_transport(args)
    if tls.tls_cert:
        security.check_files(replace(tls, tls_client_ca=args.tls_client_ca))
        own = ["--tls-cert", tls.tls_cert, "--tls-key", tls.tls_key, "--tls-ca", tls.tls_ca]
        stage += [*own, "--tls-client-ca", tls.tls_ca]
        gateway += own
        if args.tls_client_ca:
            bundle = security.read_pem(args.tls_client_ca, "--tls-client-ca").rstrip(b"\n") + b"\n"
            bundle += security.read_pem(tls.tls_ca, "--tls-ca")
            gateway += ["--tls-client-ca", files.write("gateway-client-ca.pem", bundle)]
    return {"stage": stage, "gateway": gateway}


API_KEY_ENV = "EPD_API_KEY"


def services_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment the stack's services start with: the launcher's, less $EPD_API_KEY. The
    gateway gets the stack's keys in its file (`stack_security_flags`); left in its environment,
    it also took $EPD_API_KEY as a key when `epd serve --api-key NEW` had replaced it (an old key
    exported in the shell kept working), and every model service could read it."""
    return {name: value for name, value in environ.items() if name != API_KEY_ENV}


def stack_transport(args: argparse.Namespace):
    """The launcher's own channels (its health checks): TLS with the stack's certificate as the
    client certificate when --tls-cert is given. ValueError for flags that do not go together."""
    from epd.stages.server_config import TransportSecurity

    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert, --tls-key and --tls-ca: mTLS is TLS first")
    if args.tls_cert and not args.tls_ca:
        raise ValueError(
            "--tls-cert needs --tls-ca, the CA that signed it (the stack's services verify each "
            "other with it; for a self-signed certificate, pass the certificate itself)"
        )
    if args.tls_ca and not args.tls_cert:
        raise ValueError("--tls-ca without --tls-cert: pass the certificate and key the stack serves too")

    def absolute(path: str) -> str:  # the services may not share the launcher's directory
        return os.path.abspath(path) if path else ""

    return TransportSecurity(
        tls_cert=absolute(args.tls_cert), tls_key=absolute(args.tls_key), tls_ca=absolute(args.tls_ca)
    )


def _service(args: argparse.Namespace):
    """The role's `main(config)` coroutine (the config built first, so a bad value fails here)."""
    from epd.cli import configs

    if args.role == "encoder":
        from epd.encoder_svc import server as encoder

        return encoder.main(configs.encoder_config(args))
    if args.role == "prefill":
        from epd.prefill_svc import server as prefill

        return prefill.main(configs.prefill_config(args))
    if args.role == "decode":
        from epd.decode_svc import server as decode

        return decode.main(configs.decode_config(args))
    from epd.gateway import server as gateway

    if args.role is None:  # --colocate: the front door and the three stages in this process
        # Configs first (a bad flag value: ValueError, a usage error before anything starts).
        return _colocated(configs.colocated_gateway_config(args), configs.colocated_stages(args))
    return gateway.main(configs.gateway_config(args))


async def _colocated(config, stages: ColocatedStages) -> None:
    """`epd serve --colocate`: one process, one model (vision + language), the three stages local
    and sharing its cores (their model calls go through one queue to `--concurrent-steps` model
    threads, in the order `--schedule` sets), the same gRPC and HTTP front door on the same ports."""
    from epd.gateway import server as gateway
    from epd.gateway.embedded import build_embedded_pipeline

    await gateway.main(
        config,
        local=build_embedded_pipeline(
            stages.model,
            encoder=stages.encoder,
            prefill=stages.prefill,
            decode=stages.decode,
            schedule=stages.schedule,
            close_timeout_s=config.server.close_timeout_s,
        ),
    )


_NOT_OURS = ("_poll_wrapper", "tqdm_monitor")
"""Threads of libraries that live as long as the library and run no torch call, left out of
`_log_threads_left`: gRPC's completion-queue poller (grpc.aio), and tqdm's monitor (started by the
weights' loading bar, asleep in a pure-Python wait)."""


def _log_threads_left() -> None:
    """After the service stopped: name the threads of ours still running (its closers,
    `HealthyServer.closers`, should have ended them). Harmless under `os._exit`, but an exit through
    the interpreter's teardown with a daemon thread inside a torch call aborts the process
    ("terminate called without an active exception", `epd.stages.model_thread`)."""
    left = sorted(
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and t.is_alive() and not any(n in t.name for n in _NOT_OURS)
    )
    if left:
        log.warning("threads still running after the service stopped: %s", ", ".join(left))


def _die_with_parent(launcher_pid: int) -> None:
    """In a child of the launcher: get SIGTERM if `epd serve` dies, so no service outlives it. Armed
    here, not in a `preexec_fn`: the launcher runs threads (gRPC, the health checks) by the time it
    restarts a child, and code run between fork and exec in a threaded process can deadlock."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if os.getppid() != launcher_pid:  # the launcher died before PDEATHSIG was armed: nobody will signal us
        os._exit(EXIT_FAILED)


def replica_ports(args: argparse.Namespace) -> dict[str, list[int]]:
    """Each stage's replicas' ports: replica i on the stage's port + REPLICA_PORT_STEP * i (so with
    one replica, the stage's port)."""
    from epd.cli.parsers.serve import REPLICA_PORT_STEP

    return {
        role: [
            getattr(args, f"{role}_port") + REPLICA_PORT_STEP * i for i in range(getattr(args, f"{role}s"))
        ]
        for role in MODEL_ROLES
    }


def replica_name(role: str, index: int) -> str:
    return f"{role}[{index}]"


def port_clash(args: argparse.Namespace) -> str | None:
    """Why the stack's ports cannot all be bound as asked (two services on one port, one beyond
    65535), or None."""
    from epd.cli.parsers.serve import REPLICA_PORT_STEP

    taken: dict[int, str] = {args.gateway_port: "gateway"}
    if args.http_port:
        if args.http_port in taken:
            return f"--http-port {args.http_port} is also --gateway-port"
        taken[args.http_port] = "the gateway's HTTP API"
    for role, ports in replica_ports(args).items():
        for i, port in enumerate(ports):
            name = replica_name(role, i)
            if port > 65535:
                return f"{name} would listen on port {port} (--{role}-port + {REPLICA_PORT_STEP} * {i}), beyond 65535"
            if port in taken:
                return (
                    f"{name} would listen on port {port}, which {taken[port]} uses (replica i listens on "
                    f"--{role}-port + {REPLICA_PORT_STEP} * i): choose other ports or fewer replicas"
                )
            taken[port] = name
    return None


def stage_flag_problem(args: argparse.Namespace) -> str | None:
    """Why the stack's stages or its gateway would refuse their flags (`--kv-budget-bytes 0`, a
    chunk above the step budget, `--max-requests-per-client 0`, ...), in the words `epd serve ROLE`
    uses, or None. Checked by the launcher before anything starts: else every replica imported
    torch, then one exited 2 and stopped the stack."""
    from epd.cli import configs

    try:
        configs.colocated_stages(args)  # every stage's config from the flags its replicas get, no torch
        configs.colocated_gateway_config(args)  # and the front door's (`GATEWAY_FLAGS`: a bad media domain)
    except ValueError as exc:
        return str(exc)
    return None


def stack_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The command line of each service of the loopback stack, by name ("gateway", "encoder[0]",
    "encoder[1]", ...; the model services' are run forked, without their first `_COMMAND_PREFIX`
    words)."""
    from epd.cli.flags.media import add_sampling_flags
    from epd.cli.flags.model import COMPILING_ROLES
    from epd.decode_svc.config import TTFT_FIRST_DECODE_NICE

    log_format = [] if args.log_format == "text" else ["--log-format", args.log_format]  # text: the default
    base = [sys.executable, "-m", "epd.cli.main", "--log-level", args.log_level, *log_format, "serve"]
    threads = [] if args.num_threads is None else ["--num-threads", str(args.num_threads or "auto")]
    model = [
        "--model",
        args.model,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        *threads,
        "--linear-kernel",
        args.linear_kernel,
    ]
    grace = ["--grace-period", str(args.grace_period), "--close-timeout-s", str(args.close_timeout_s)]
    own = {role: stage_flags(args, role) for role in MODEL_ROLES}
    for role in COMPILING_ROLES:  # the encoder compiles no structured output
        own[role] += ["--structured-compile-timeout-s", str(args.structured_compile_timeout_s)]
    if args.schedule == "ttft-first":
        own["decode"] += ["--nice", str(TTFT_FIRST_DECODE_NICE)]
    ports = replica_ports(args)
    commands = {
        replica_name(role, i): [*base, role, "--port", str(port), *grace, *model, *own[role]]
        for role in MODEL_ROLES
        for i, port in enumerate(ports[role])
    }
    # Every replica's address: the gateway routes among the healthy ones (by media affinity). Decode
    # needs no list of prefills: its default --allow-kv-from admits every loopback port.
    stages = [
        flag
        for role in MODEL_ROLES
        for flag in (f"--{role}", ",".join(f"127.0.0.1:{port}" for port in ports[role]))
    ]
    # Stage checks every second (cheap on loopback): a restarted replica is back in routing within
    # a second of serving again.
    commands["gateway"] = [
        *base,
        "gateway",
        "--port",
        str(args.gateway_port),
        *grace,
        *stages,
        "--stage-check-interval",
        str(_GATEWAY_STAGE_CHECK_S),
        *gateway_flags(args),
        "--http-port",
        str(args.http_port),
        "--max-upload-bytes",
        str(args.max_upload_bytes),
        "--demo-max-concurrent-decodes",
        str(args.demo_max_concurrent_decodes),
        *decode_limit_flags(args),  # the web demo decodes under the encoders' limits
        # The requests' frame sampling defaults: the gateway fills in every field a
        # request leaves unset, so the encoders' own defaults never apply to them.
        *flag_words(args, (add_sampling_flags,)),
    ]
    return commands


def decode_limit_flags(args: argparse.Namespace) -> list[str]:
    """The stack's `add_decode_limit_flags` values as command-line words."""
    return [
        "--max-source-pixels",
        str(args.max_source_pixels),
        "--max-decoded-pixels",
        str(args.max_decoded_pixels),
        "--max-duration-s",
        repr(args.max_duration_s),
        "--max-demux-s",
        repr(args.max_demux_s),
        "--max-decode-s",
        repr(args.max_decode_s),
    ]


def stage_flags(args: argparse.Namespace, role: str) -> list[str]:
    """The stack's flags of a stage role as that role's command line: every flag its `STAGE_FLAGS`
    functions define (the encoder's and frame sampling; prefill's KV store, prefix cache,
    scheduler and max_tokens limit; decode's KV memory, batch and queue) and every stage's
    (`SHARED_STAGE_FLAGS`: --scheduling-policy), with the value the stack was given."""
    from epd.cli.flags.stages import SHARED_STAGE_FLAGS, STAGE_FLAGS

    return flag_words(args, (*STAGE_FLAGS[role], *SHARED_STAGE_FLAGS))


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The stack's `GATEWAY_FLAGS` (admission, routing, the HTTP API's model name, media and body
    flags) as the gateway's command line, with the value the stack was given."""
    from epd.cli.flags.gateway import GATEWAY_FLAGS

    return flag_words(args, GATEWAY_FLAGS)


def flag_words(args: argparse.Namespace, adders) -> list[str]:
    """Every flag the `adders` define, with its value in `args`, as command-line words."""
    own = argparse.ArgumentParser(add_help=False)
    for add_flags in adders:
        add_flags(own)
    words = []
    for action in own._actions:
        value = getattr(args, action.dest)
        flag = action.option_strings[0]
        if value is None:  # unset (--fps): the service's own default is the same
            continue
        if isinstance(action, argparse.BooleanOptionalAction):  # --flag / --no-flag
            words.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true and the like: the flag alone, when set
            words += [flag] if value != action.default else []
        else:
            # tuple: --allowed-media-domains
            text = ",".join(value) if isinstance(value, tuple) else str(value)
            # One word when the value starts with "-" (a --served-model-name): else read as a flag.
            words += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    return words


@dataclass
class _Slot:
    """One process of the stack (the gateway, or one replica of a stage) and its restart bookkeeping."""

    name: str
    role: str
    port: int
    command: list[str]
    replica: Replica
    proc: Service | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


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


def check_max_model_len(model: str, max_model_len: int | None) -> None:
    """ModelLoadError, as every prefill replica would raise once its model is loaded, when
    `--max-model-len` is above the local checkpoint's context (config.json): the stack says so in
    one line before any service starts, not after a replica has loaded the weights."""
    from epd.model_runtime.loader import ModelLoadError, configured_context_tokens
    from epd.prefill_svc.config import PrefillConfig

    if max_model_len is None:
        return
    try:
        PrefillConfig(max_model_len=max_model_len).served_context(configured_context_tokens(model))
    except ValueError as exc:
        raise ModelLoadError(model, str(exc)) from None


def serve_stack(args: argparse.Namespace, ready_timeout_s: float = 600.0) -> int:
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
    policy = RestartPolicy(health_timeout_s=args.health_timeout, start_timeout_s=ready_timeout_s)
    # The stages refuse calls without the stack's own secret: any local user could otherwise call
    # them directly, past the gateway's API key and limits. One given to `epd serve`
    # ($EPD_INTERNAL_SECRET, inherited by the services) is used instead: a tool can present it.
    files = _StackFiles()
    try:
        flags = stack_security_flags(args, files)
        security.configure(stack_transport(args))  # the health checks below speak TLS when the stack does
    except ValueError as exc:
        files.remove()
        print(f"epd serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    commands = {
        name: [*command, *flags["gateway" if name == "gateway" else "stage"]]
        for name, command in stack_commands(args).items()
    }
    ports = {"gateway": args.gateway_port} | {
        replica_name(role, i): port
        for role, role_ports in replica_ports(args).items()
        for i, port in enumerate(role_ports)
    }
    now = time.monotonic()
    slots = [
        _Slot(name, name.partition("[")[0], ports[name], commands[name], Replica(name, policy, now))
        for name in ["gateway", *(n for n in commands if n != "gateway")]
    ]
    # The stages' shared busy board: with --num-threads auto, a model call takes the cores the
    # other stages are not using at that moment (epd/model_runtime/threads.py).
    board = new_board_path(files.stack_id)
    # Here, not only in `env`: the zygote is started with the launcher's environment and loads
    # torch's OpenMP (which reads its settings once) before it forks the services.
    os.environ.update(shared_cores_environment(dict(os.environ)))
    env = {**services_environment(os.environ), BOARD_ENV: board}
    # The model services are forked from one process that imported torch and the family's modules
    # once (epd/cli/zygote.py): they share those pages and skip those imports.
    zygote = Zygote(preload_modules(model_type, family_module(model_type)))

    def start(slot: _Slot) -> Service:
        # Own process group: a terminal's Ctrl-C reaches only this launcher, which stops the
        # services in order (_STOP_ORDER); PDEATHSIG still ends them if it is killed (the gateway
        # arms it itself, told the launcher's pid). The gateway holds no model, so it is a plain
        # interpreter (no torch).
        if slot.role == "gateway":
            return subprocess.Popen(
                slot.command, process_group=0, env={**env, _LAUNCHER_ENV: str(os.getpid())}
            )
        return zygote.start(slot.name, slot.command[_COMMAND_PREFIX:], env)

    # With one replica per stage the gateway is started first: it comes up while the zygote imports,
    # and turns SERVING when every stage does. With more, it would turn SERVING once one replica of
    # each stage serves, and route to the others only from its next stage check: it is started
    # once they all serve (`_wait_ready`), so that "ready" means every replica is in routing.
    staggered = max(args.encoders, args.prefills, args.decodes) > 1
    try:
        for slot in slots:
            if not (staggered and slot.role == "gateway"):
                slot.proc = start(slot)
        return _supervise(slots, start, signals, policy, ready_timeout_s)
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
    ready_timeout_s: float,
) -> int:
    """Wait for every service to serve (one that exits meanwhile stops the stack: a bad port or
    flag would only fail again), then keep them running until a signal (epd/cli/supervisor.py):
    restart what exits or stops answering, give up on what crash-loops."""
    if (code := _wait_ready(slots, start, signals, ready_timeout_s)) is not None or signals.stop.is_set():
        return code or EXIT_OK
    by_role: dict[str, list[str]] = {}
    for slot in slots:
        by_role.setdefault(slot.role, []).append(slot.address)
    print(
        "epd: stack ready; "
        + "; ".join(f"{role} at {','.join(addresses)}" for role, addresses in by_role.items()),
        flush=True,
    )
    checks: dict[int, Future[bool | None]] = {}  # slot index -> its health check in flight
    next_check_at = 0.0
    # Not waited for on the way out: a check of a silent service would hold a signal up.
    pool = ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix="epd-health")
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
                checks = {
                    i: pool.submit(health_answer, s.address, timeout_s=_HEALTH_CHECK_TIMEOUT_S)
                    for i, s in enumerate(slots)
                    if s.replica.running
                }
            if checks and all(f.done() for f in checks.values()):
                if (stop := _on_health(slots, checks, time.monotonic())) is not None:
                    return stop
                checks = {}
            for slot in slots:
                if slot.replica.restart_due(now):
                    slot.proc = start(slot)
                    slot.replica.restarted(now)
                    print(
                        f"epd: {slot.name} restarted (pid {slot.proc.pid}, restart {slot.replica.restarts})",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return EXIT_OK


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
            if is_serving(slot.address, timeout_s=1.0):
                slot.replica.answered(time.monotonic(), serving=True)
                pending.remove(slot)
        if time.monotonic() > deadline:
            print(
                f"epd: not ready after {ready_timeout_s:.0f} s: {[s.name for s in pending]}", file=sys.stderr
            )
            return EXIT_FAILED
        signals.stop.wait(0.2)
    return None


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
        assert slot.proc is not None
        pid = slot.proc.pid
        slot.proc.kill()  # SIGKILL: also ends a stopped (SIGSTOP) or hung process
        slot.proc.wait()
        why = "did not answer its health check for" if not was_starting else "was not serving after"
        if (stop := _on_exit(slot, slots, f"{why} {silent_s:.0f} s; killed it", now, pid)) is not None:
            return stop
    return None


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
