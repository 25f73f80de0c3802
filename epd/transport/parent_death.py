"""A child process that ends with the process that started it, even one killed by SIGKILL (no
handler of the parent runs then): Linux's prctl(PR_SET_PDEATHSIG) has the kernel send the child
SIGTERM when its parent dies, kept across exec, and the child stops as on any SIGTERM.

Armed by `epd serve`'s children (the stack's gateway; each model service forked from the zygote)
and by every server a bench starts (bench/common.py `start_server`, in the child before exec), so
nothing outlives what started it. The kernel sends the signal when the *thread* that forked the
child ends, not the process: children are started from the main thread."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@functools.cache
def libc_prctl() -> Callable[..., int] | None:
    """libc's prctl; None off Linux, where there is no parent-death signal. Resolved in the parent
    before a fork, so a `preexec_fn` runs no library lookup between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent_pid: int, exit_code: int, prctl: Callable[..., int] | None = None) -> None:
    """In a child of `parent_pid`: SIGTERM when it dies; when it died before the call (nobody will
    signal us), exit now with `exit_code`. `prctl`: `libc_prctl()`, looked up by the parent when
    this runs between fork and exec."""
    prctl = prctl or libc_prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(exit_code)
