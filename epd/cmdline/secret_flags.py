"""Secrets given as flags (an API key), hidden from the process's command line as `ps` shows it:
`epd`'s commands (`epd.cli.main`) and the bench suites run as modules that take a key
(`python -m epd.bench.serve --api-key KEY`), which may not import `epd.cli`."""

from __future__ import annotations

import sys

from epd.cmdline.flexible import dashed_flags

SECRET_FLAGS = ("--api-key",)
"""Flags whose value is a secret: hidden from this process's command line as `ps` shows it."""


def hide_secrets(argv: list[str]) -> list[str] | None:
    """`argv` with every SECRET_FLAGS value replaced by ***, or None when it holds none."""
    shown, hidden = list(argv), False
    for i, word in enumerate(dashed_flags(argv)):  # --api_key too
        name, eq, _ = word.partition("=")
        if name in SECRET_FLAGS and eq:
            shown[i], hidden = f"{name}=***", True
        elif name in SECRET_FLAGS and i + 1 < len(argv):
            shown[i + 1], hidden = "***", True
    return shown if hidden else None


def hide_secrets_from_ps(program: str = "epd") -> None:
    """Every local user reads a process's command line (`ps`, /proc/PID/cmdline): an API key given
    as `--api-key KEY` showed there for as long as the gateway (or `epd serve`, `epd ask`, a bench
    run as a module) ran. Rewritten as soon as the flags are parsed, as `program` and the flags;
    $EPD_API_KEY or --api-key-file never show at all."""
    shown = hide_secrets(sys.argv[1:])
    if shown is None:
        return
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join([program, *shown]))
