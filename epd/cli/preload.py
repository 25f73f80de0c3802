"""The first step of a command that runs the model (`epd serve`, `epd ask` embedded): the libraries
its model processes must preload, put in place by running the process again (`os.execve`: same pid,
same command line) with them in LD_PRELOAD.

Two flags ask for one: `--allocator` (tcmalloc, `epd.cli.allocator`) and `--mkl-dispatch`
(MKL's kernels by instruction set, `epd.cli.mkl_dispatch`). Both are planned first and carried out
in one exec, so the process starts again at most once. Only the command line's own `main()` does
this (`argv` None): a test or the zygote calling `main(argv)` in its process is never replaced;
the stack's services inherit LD_PRELOAD from their launcher. `epd ask --endpoint` runs no model,
so it has neither flag's effect (it refuses them, `epd.cli.parsers.ask`).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys

from epd.cli.allocator import find_tcmalloc, plan_allocator
from epd.cli.mkl_dispatch import mkl_library, plan_mkl_dispatch
from epd.cli.preload_plan import PreloadPlan, mapped_libraries

log = logging.getLogger(__name__)


def plan_preloads(allocator: PreloadPlan, mkl: PreloadPlan) -> tuple[dict[str, str] | None, str | None]:
    """(the environment to run again with, or None; the first error, or None) of the two plans,
    `mkl` planned on `allocator`'s environment."""
    error = allocator.error or mkl.error
    if error is not None:
        return None, error
    return mkl.exec_env or allocator.exec_env, None


def preload_choices(args: argparse.Namespace) -> tuple[str, str] | None:
    """(--allocator, --mkl-dispatch) of a command whose process loads the model (`epd serve
    --colocate` or a model role, `epd ask` embedded) or starts those that do (the stack's launcher:
    they inherit its LD_PRELOAD); None for the others (`epd ask --endpoint`, `epd serve gateway`,
    `epd health`, `epd bench`), which never run themselves again."""
    if args.command == "ask" and args.endpoint:
        return None
    allocator = getattr(args, "allocator", None)
    return None if allocator is None else (allocator, args.mkl_dispatch)


def ensure_preloads(allocator_choice: str, mkl_choice: str) -> str | None:
    """At the start of `epd serve` or `epd ask` (embedded) run from the command line: may not
    return (the process runs again with its libraries). Returns the error line for exit 2, or None
    to go on. A no-op off Linux (no /proc, no LD_PRELOAD)."""
    if not sys.platform.startswith("linux"):
        return None
    mapped = mapped_libraries()
    allocator = plan_allocator(
        allocator_choice, os.environ, mapped, None if allocator_choice == "system" else find_tcmalloc()
    )
    environ = allocator.exec_env or dict(os.environ)
    library, build_error = mkl_library(mkl_choice)
    mkl = plan_mkl_dispatch(mkl_choice, environ, mapped, platform.machine(), library, build_error)
    for note in (allocator.note, mkl.note):
        if note:
            log.info("%s", note)
    exec_env, error = plan_preloads(allocator, mkl)
    if exec_env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        # sys.orig_argv: the interpreter's own command line, options included (`python -m
        # epd.cli.main ...` or the `epd` script's), so the process is the same one again.
        os.execve(sys.executable, sys.orig_argv, exec_env)
    return error
