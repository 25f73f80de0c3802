"""`epd serve [ROLE]`: one service in this process, or the whole stack as child processes
(`epd/cli/launcher.py`).

Exit codes (the launcher passes a child's on; `epd.cli.process_exit`): 0 stopped by SIGTERM/SIGINT,
after draining; 1 a service failed or could not start (port in use, ...), or every replica of a
stage was given up on; 2 a bad flag value; 3 the model cannot be loaded. Every failure to start is
one line on stderr saying why (tracebacks go to the log, at DEBUG). The launcher checks the model
directory before it starts any service and imports no torch: only the services load the model.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from epd.cli.launcher import LAUNCHER_PID_ENV, serve_stack
from epd.cli.process_exit import EXIT_FAILED, EXIT_MODEL, EXIT_OK, EXIT_USAGE, exit_now
from epd.transport.parent_death import die_with_parent

if TYPE_CHECKING:
    from epd.cli.configs import ColocatedStages

log = logging.getLogger(__name__)


def run_serve(args: argparse.Namespace) -> int:
    if args.role is None and not args.colocate:
        return serve_stack(args)
    if LAUNCHER_PID_ENV in os.environ:  # the stack's gateway: end with the launcher
        # Armed here, not in a `preexec_fn`: the launcher runs threads (gRPC, the health checks) by
        # the time it restarts a child, and code run between fork and exec there can deadlock.
        die_with_parent(int(os.environ.pop(LAUNCHER_PID_ENV)), EXIT_FAILED)
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
    from epd.model_runtime.generation_defaults import announce_at_start

    if args.role is None:  # --colocate: the front door and the three stages in this process
        # Configs first (a bad flag value: ValueError, a usage error before anything starts).
        config = configs.colocated_gateway_config(args)
        announce_at_start(config.generation)
        return _colocated(config, configs.colocated_stages(args))
    config = configs.gateway_config(args)
    announce_at_start(config.generation)
    return gateway.main(config)


async def _colocated(config, stages: ColocatedStages) -> None:
    """`epd serve --colocate`: one process, one model (vision + language), the three stages local
    and sharing its cores (their model calls go through one queue to `--concurrent-steps` model
    threads, in the order `--schedule` sets), the same gRPC and HTTP front door on the same ports."""
    from epd.gateway import server as gateway
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.model_runtime.hf_loading import hide_transformers_bars

    hide_transformers_bars()  # as the stack's services: log lines in the log, no bar
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
`_log_threads_left`: gRPC's completion-queue poller (grpc.aio), and tqdm's monitor (started by a
hub download's bar, asleep in a pure-Python wait)."""


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
