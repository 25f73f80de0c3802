"""`epd serve [ROLE]`: one service in this process, or the whole stack as child processes.

Exit codes (the launcher passes a child's on): 0 stopped by SIGTERM/SIGINT, after draining;
1 a service failed or could not start (port in use, ...); 2 a bad flag value; 3 the model cannot
be loaded. Every failure to start is one line on stderr saying why (tracebacks go to the log, at
DEBUG). The launcher checks the model directory before it starts any service and imports no
torch: only the services load the model.
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
from dataclasses import replace
from typing import TYPE_CHECKING, NoReturn

from epd.cli.health import is_serving

if TYPE_CHECKING:
    from epd.cli.zygote import ServiceProcess

    Service = subprocess.Popen | ServiceProcess

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MODEL = 0, 1, 2, 3
# After its grace period, how long the launcher still waits for a service before SIGKILL.
_EXIT_MARGIN_S = 5.0
# The gateway first: its requests in flight still need the stages to finish.
_STOP_ORDER = (("gateway",), ("encoder", "prefill", "decode"))
_PR_SET_PDEATHSIG = 1
MODEL_ROLES = ("encoder", "prefill", "decode")
_COMMAND_PREFIX = 3  # python -m epd.cli.main


def run_serve(args: argparse.Namespace) -> int:
    if args.role is None and not args.colocate:
        return serve_stack(args)
    _exit_now(serve_role(args))


def serve_role(args: argparse.Namespace) -> int:
    """One service until SIGTERM/SIGINT. Its own handlers are installed before the model loads
    (`epd.transport.server.run_service`); until then SIGTERM stops it like Ctrl-C, quietly."""
    from epd.model_runtime.loader import ModelLoadError

    name = args.role or "colocated"

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        try:
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
        return _colocated(args, configs.colocated_gateway_config(args))
    return gateway.main(configs.gateway_config(args))


async def _colocated(args: argparse.Namespace, config) -> None:
    """`epd serve --colocate`: one process, one model (vision + language), the three stages local
    and sharing its cores (their model calls take turns on one model thread: the decode batch
    steps between encode and prefill calls, as in vLLM's single engine), the same gRPC and HTTP
    front door on the same ports."""
    from epd.cli import configs
    from epd.gateway import server as gateway
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.model_runtime.threads import AUTO
    from epd.prefill_svc.config import PrefillConfig

    model = configs.model_config(args)
    if args.num_threads is None:  # one model call at a time: every call may use every core
        model = replace(model, num_threads=AUTO)
    prefill = PrefillConfig(model=model, prefix_cache_bytes=args.prefix_cache_bytes,
                            prefix_cache_ttl_s=args.prefix_cache_ttl)
    await gateway.main(config, local=build_embedded_pipeline(model, prefill=prefill))


def _exit_now(code: int) -> NoReturn:
    """Leave without the interpreter's teardown. The service has drained and stopped; tearing
    down torch and gRPC after that took 2.5-3.5 s per idle service (in C code, after atexit),
    and would also wait for a model load still running on the model thread after a signal."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with_parent() -> None:
    """In the child: get SIGTERM if `epd serve` dies, so no service outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def stack_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The command line of each service of the loopback stack (the model services' are run forked,
    without their first `_COMMAND_PREFIX` words)."""
    base = [sys.executable, "-m", "epd.cli.main", "--log-level", args.log_level, "serve"]
    threads = [] if args.num_threads is None else ["--num-threads", str(args.num_threads or "auto")]
    model = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, *threads]
    grace = ["--grace-period", str(args.grace_period)]
    e, p, d = args.encoder_port, args.prefill_port, args.decode_port
    return {
        "encoder": [*base, "encoder", "--port", str(e), *grace, *model],
        "prefill": [*base, "prefill", "--port", str(p), *grace, *model, "--prefix-cache-bytes",
                    str(args.prefix_cache_bytes), "--prefix-cache-ttl", str(args.prefix_cache_ttl)],
        "decode": [*base, "decode", "--port", str(d), *grace, *model],
        "gateway": [*base, "gateway", "--port", str(args.gateway_port), *grace, "--encoder", f"127.0.0.1:{e}",
                    "--prefill", f"127.0.0.1:{p}", "--decode", f"127.0.0.1:{d}",
                    "--http-port", str(args.http_port), "--max-requests-per-client", str(args.max_requests_per_client)],
    }


class _Signals:
    """SIGINT/SIGTERM in the launcher: the first stops the stack gracefully, a later one is passed
    on, which makes the services cut their calls in flight short."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.count = 0
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.count += 1
        self.stop.set()


def serve_stack(args: argparse.Namespace, ready_timeout_s: float = 600.0) -> int:
    from epd.cli.zygote import Zygote, preload_modules
    from epd.model_runtime.loader import ModelLoadError, check_model_dir, family_module, resolve_model_path
    from epd.model_runtime.threads import BOARD_ENV, new_board_path, remove_board

    signals = _Signals()
    try:
        # Once here, not in each child: the default model is built (if it must be) once, not three
        # times racing; and a broken checkpoint is one line now, not four processes failing.
        args.model = resolve_model_path(args.model)
        model_type = check_model_dir(args.model)
    except ModelLoadError as exc:
        print(f"epd: {exc}", file=sys.stderr)
        return EXIT_MODEL
    procs: dict[str, Service] = {}
    # The stages' shared busy board: with --num-threads auto, a model call takes the cores the
    # other stages are not using at that moment (epd/model_runtime/threads.py).
    board = new_board_path()
    env = {**os.environ, BOARD_ENV: board}
    # The model services are forked from one process that imported torch and the family's modules
    # once (epd/cli/zygote.py): they share those pages and skip those imports.
    zygote = Zygote(preload_modules(model_type, family_module(model_type)))
    try:
        commands = stack_commands(args)
        # Own process group: a terminal's Ctrl-C reaches only this launcher, which stops the
        # services in order (_STOP_ORDER); PDEATHSIG still ends them if it is killed. The gateway
        # holds no model, so it is a plain interpreter (no torch), started first: it comes up
        # while the zygote imports.
        procs["gateway"] = subprocess.Popen(commands["gateway"], preexec_fn=_die_with_parent, process_group=0,
                                            env=env)
        for name in MODEL_ROLES:
            procs[name] = zygote.start(name, commands[name][_COMMAND_PREFIX:], env)
        return _supervise(args, procs, signals, ready_timeout_s)
    finally:
        _stop_all(procs, args.grace_period + _EXIT_MARGIN_S, signals)
        zygote.stop()
        remove_board(board)


def _supervise(args: argparse.Namespace, procs: dict[str, Service], signals: _Signals,
               ready_timeout_s: float) -> int:
    """Wait for every service to serve, then until a signal or a service exits."""
    ports = {"encoder": args.encoder_port, "prefill": args.prefill_port, "decode": args.decode_port,
             "gateway": args.gateway_port}
    deadline = time.monotonic() + ready_timeout_s
    pending = set(procs)
    while pending and not signals.stop.is_set():
        for name in sorted(pending):
            if (code := procs[name].poll()) is not None:
                return _exited(name, code)
            if is_serving(f"127.0.0.1:{ports[name]}", timeout_s=1.0):
                pending.discard(name)
        if time.monotonic() > deadline:
            print(f"epd: not ready after {ready_timeout_s:.0f} s: {sorted(pending)}", file=sys.stderr)
            return EXIT_FAILED
        signals.stop.wait(0.2)
    if not signals.stop.is_set():
        print(f"epd: stack ready; gateway at 127.0.0.1:{args.gateway_port}", flush=True)
    while not signals.stop.wait(0.2):
        for name, proc in procs.items():
            if (code := proc.poll()) is not None:
                return _exited(name, code)
    return EXIT_OK


def _exited(name: str, code: int) -> int:
    if code == EXIT_MODEL:
        return EXIT_MODEL  # it said why, in one line, on the stderr we share
    print(f"epd: {name} exited with code {code}; stopping the stack", file=sys.stderr)
    return EXIT_FAILED


def _stop_all(procs: dict[str, Service], timeout_s: float, signals: _Signals) -> None:
    """SIGTERM group by group (_STOP_ORDER), each given `timeout_s` to drain and exit, then SIGKILL.
    A further signal to the launcher is passed on at once."""
    for group in _STOP_ORDER:
        running = [procs[name] for name in group if name in procs and procs[name].poll() is None]
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
