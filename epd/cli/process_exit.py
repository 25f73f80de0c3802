"""How an `epd` command's own process leaves once its work is done: `os._exit`, without the
interpreter's teardown (`epd serve ROLE`, `epd serve --colocate`, and `epd ask` run as the console
script or `python -m epd.cli.main`).

Why: after the work, the teardown only costs. Tearing down torch and gRPC took 2.5-3.5 s per idle
service (in C code, after atexit), and would wait for a model load still running on the model
thread after a signal. And it can abort: a daemon thread still inside a torch call, or a grammar
compile, when the interpreter finalizes is ended by pthread_exit as the call returns, and the
unwinding through C++ frames aborts the process ("terminate called without an active exception",
SIGABRT; `epd.stages.model_thread`). The caller has closed what it opened by then (a service its
closers, `epd ask` its pipeline), so the threads left are only those a close gave up on, named in
its log. What the teardown would still have done that matters is done here: the log handlers
closed, stdout and stderr flushed.

Only a command's own process: `main(argv)` called with a list (tests, the test zygote, a
notebook) returns its exit code instead, and the caller's process goes on."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

# `epd serve`'s exit codes (epd/cli/serve.py says what each means; the launcher passes a service's on).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MODEL = 0, 1, 2, 3


def exit_now(code: int) -> NoReturn:
    """Flush the logs, stdout and stderr, then `os._exit(code)`."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # its reader has gone (BrokenPipeError), or it was closed
            pass
    os._exit(code)
