"""The stack's model services forked from one process that imported torch once (a zygote).

`import torch` alone is ~500 MB of resident memory in the CUDA build of torch, most of it private
to the process that imported it (relocated library data, Python objects), and transformers'
modelling imports add more and take seconds. Three model services that each import them hold
three copies; forked from one process that imported them already, they share those pages copy on
write (measured: three separate interpreters 1,558 MiB PSS, a parent and three forked children
748 MiB), and each skips the imports at start-up.

The zygote is Python's `multiprocessing` fork server: the launcher (which imports no torch) starts
it with the modules to preload, and each service is a `multiprocessing` process forked from it
that runs `epd serve ROLE ...` as if started on its own (same argv, same exit codes). The fork
server runs no thread of its own when it forks (torch starts its OpenMP threads at the first
parallel op, not at import), so no child inherits a lock held by a thread that does not exist in
it: that is what makes forking after importing torch safe. The one exception is numpy's OpenBLAS,
which starts idle worker threads at import when OMP_NUM_THREADS is unset; it shuts them down
around a fork itself (its pthread_atfork handlers), so a child starts its own. gRPC is not
imported before the fork (it is not fork-safe once initialised).

Asked to (`Zygote(weights=...)`, `epd serve --share-weights`, the default), the zygote also reads the
checkpoint's tensors once after its imports (epd/cli/zygote_weights.py), and each model service it
forks takes them as its parameters instead of reading its own copy: one copy of the weights for the
whole stack, shared copy on write (epd/model_runtime/shared_weights.py). It reads them on its own
thread, as everything else it runs before a fork.

Lifetimes: the launcher owns the fork server (it ends when the launcher's end of its pipe
closes), and each service gets SIGTERM when the fork server ends (PR_SET_PDEATHSIG), so killing
the launcher, even with SIGKILL, leaves nothing running.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import multiprocessing
import multiprocessing.forkserver
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

from epd.model_runtime.shared_weights import WEIGHTS_ENV, SharedWeights
from epd.transport.parent_death import die_with_parent

_MAIN_SWAP = threading.Lock()
"""Held while `sys.modules["__main__"]` is swapped for a child's start (`_no_main_for_the_child`):
two threads starting services at once would otherwise interleave the swaps, and the one that
restored last would put back the other's bare module for good."""

# Imported by the zygote before any fork, whatever the model: torch and what every model service
# imports with it. The family's own modules are added by `preload_modules`.
_COMMON_PRELOAD = (
    "epd.cli.zygote_signals",  # first: the zygote outlives signals meant for the launcher's group
    "torch",
    "torchvision",
    "numpy",
    "PIL.Image",
    "av",
    "safetensors.torch",
    "tokenizers",
    "transformers",
    "transformers.modeling_utils",
    "transformers.processing_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.processing_auto",
    "epd.model_runtime.loader",
    "epd.model_runtime.hf_loading",
    "epd.model_runtime.hf_text",
    # What every service imports after the fork before it serves, gRPC-free (the command line, the
    # stages' configs, aiohttp for media URLs): ~0.4 s of CPU each service (and each command a test
    # forks, tests/stack.py) skips. Those that import grpc (epd.cli.serve, epd.cli.configs, the
    # servers) stay after the fork; test_zygote checks that none of these brings grpc in.
    "aiohttp",
    "epd.cli.main",
    "epd.cli.ask",
    "epd.encoder_svc.config",
    "epd.prefill_svc.config",
    "epd.decode_svc.config",
    "epd.gateway.config",
)
_TRIM = "epd.cli.zygote_trim"
"""Imported by the zygote after every preload (`Zygote`): see its docstring."""
_WEIGHTS = "epd.cli.zygote_weights"
"""Imported by the zygote after the modules, before `_TRIM`, when it preloads the weights."""
# transformers' per-family files that loading a checkpoint of that model_type imports (those the
# installed transformers has).
_FAMILY_FILES = (
    "configuration",
    "modeling",
    "processing",
    "video_processing",
    "image_processing",
    "image_processing_pil",
    "tokenization",
)
# Families whose processor lives under another family's folder.
_PROCESSOR_FAMILY = {"qwen2_5_vl": "qwen2_vl", "qwen3_5": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl"}


def preload_modules(model_type: str | None, family_module: str | None) -> list[str]:
    """What the zygote imports before forking for a checkpoint of `model_type` (None: a hub id,
    known only once loaded; then the common part)."""
    modules = list(_COMMON_PRELOAD)
    spec = importlib.util.find_spec("transformers")  # where it is, without importing it (or torch)
    if model_type and spec is not None and spec.origin is not None:
        models = Path(spec.origin).parent / "models"
        for folder in dict.fromkeys((model_type, _PROCESSOR_FAMILY.get(model_type, model_type))):
            modules += [
                f"transformers.models.{folder}.{kind}_{folder}"
                for kind in _FAMILY_FILES
                if (models / folder / f"{kind}_{folder}.py").is_file()
            ]
    if family_module:
        modules.append(f"epd.model_runtime.{family_module}")
    return modules


class ServiceProcess:
    """One forked service, with the part of `subprocess.Popen` the launcher uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            # Another thread (the launcher's supervision polls) may reap it between the check and
            # the kill: nothing is left to signal. ProcessLookupError crashed the launcher's stop
            # (exit 1); subprocess.Popen.send_signal ignores it too.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; `subprocess.TimeoutExpired` if it is still running after `timeout` s."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout or 0.0)
        return self._process.exitcode


class Zygote:
    """The fork server of one launcher: `start(argv)` runs `epd ARGV` in a process forked from it."""

    def __init__(self, preload: list[str], weights: SharedWeights | None = None) -> None:
        """`weights`: the checkpoint the zygote loads once, after its imports, for the services it
        forks to share (epd/model_runtime/shared_weights.py); None: each loads its own."""
        self._context: ForkServerContext = multiprocessing.get_context("forkserver")  # type: ignore[assignment]
        self._weights = weights
        # Last, after every import: the zygote unmaps the file pages they touched (zygote_trim.py).
        self._context.set_forkserver_preload([*preload, *([_WEIGHTS] if weights else []), _TRIM])

    def start(
        self, name: str, argv: list[str], env: dict[str, str], log_path: str | None = None
    ) -> ServiceProcess:
        """Fork `epd ARGV` (its environment `env`; its stdout and stderr appended to `log_path`, or
        the launcher's). The first call starts the zygote and waits for its imports (seconds); the
        later ones fork at once."""
        process = self._context.Process(
            target=_run_service, args=(argv, env, log_path), name=f"epd-{name}", daemon=False
        )
        with _no_main_for_the_child(), self._weights_named():
            process.start()
        return ServiceProcess(process)

    @contextlib.contextmanager
    def _weights_named(self) -> Iterator[None]:
        """$EPD_ZYGOTE_WEIGHTS set while a start may start the fork server, which takes this
        process's environment (`epd.cli.zygote_weights` reads it there); unset again after, so
        that nothing else this process starts inherits it."""
        if self._weights is None:
            yield
            return
        before = os.environ.get(WEIGHTS_ENV)
        os.environ[WEIGHTS_ENV] = self._weights.env_value()
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(WEIGHTS_ENV, None)
            else:
                os.environ[WEIGHTS_ENV] = before

    def stop(self) -> None:
        """End the fork server (the services it forked are stopped by the launcher first)."""
        server = _fork_server()
        pid = server._forkserver_pid
        if pid is None:
            return
        # Not its own `_stop()`: that waits for the fork server to notice, which it does only after
        # its imports (seconds, when the stack is stopped while starting). SIGKILL: it ignores
        # SIGTERM (epd/cli/zygote_signals.py), and what it forked has stopped already.
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)
        server._forkserver_pid = None


@contextlib.contextmanager
def _no_main_for_the_child() -> Iterator[None]:
    """`multiprocessing` has each child run the parent's `__main__` again (as `__mp_main__`, for
    targets defined there). Ours is `_run_service`, here, so a service needs none: with the launcher
    run as `python -m epd.cli.main` every service executed epd/cli/main.py a second time, beside the
    copy the zygote preloaded, and runpy warned of it ("'epd.cli.main' found in sys.modules ...";
    the `epd` script's file was run again the same way, without the warning). A bare `__main__`
    while the child's start-up data is taken leaves it nothing to run. Starts from several threads
    (none today: the launcher starts and restarts services from its own) take turns (`_MAIN_SWAP`),
    so each puts back the real module; nothing of ours looks `__main__` up meanwhile."""
    with _MAIN_SWAP:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


def _run_service(argv: list[str], env: dict[str, str], log_path: str | None) -> None:
    """In the forked child: become a service as if started as `epd ARGV`."""
    from epd.cli.zygote_signals import INHERITED

    for signum, handler in INHERITED.items():  # the zygote ignores them; a service stops on them
        signal.signal(signum, handler)
    zygote_pid = os.getppid()
    if log_path is not None:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    # The fork server lets its children keep it alive (they hold its "alive" pipe); ours must not,
    # or a killed launcher would leave the fork server and, through it, the services running.
    server = _fork_server()
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    # The preloaded objects never die: keep the collector off their pages, or its first full pass
    # writes to every one of them and the shared pages become private copies.
    gc.freeze()
    _set_title(argv)  # before the environment changes: setproctitle borrows the space after argv
    os.environ.clear()
    os.environ.update(env)
    # its own process group, as the launcher's other children: Ctrl-C reaches only the launcher
    os.setpgid(0, 0)
    die_with_parent(zygote_pid, 1)  # SIGTERM when the zygote ends
    from epd.cli.main import main

    raise SystemExit(main(argv))


_MADV_DONTNEED = 4
_VMA_START = re.compile(r"\n(?=[0-9a-f]+-[0-9a-f]+ )")  # each mapping's block of /proc/PID/smaps


def smaps_mappings(smaps: str) -> list[tuple[int, int, str, str, dict[str, int]]]:
    """(start, end, permissions, path, {field: kB}) of each mapping in `smaps` (the text of
    /proc/PID/smaps); path "" for an anonymous one."""
    out = []
    for block in _VMA_START.split(smaps.strip()):
        header, *lines = block.splitlines()
        span, perms, *rest = header.split(maxsplit=5)
        start, end = (int(x, 16) for x in span.split("-"))
        fields = {
            key: int(value.split()[0])
            for key, _, value in (line.partition(":") for line in lines)
            if value.endswith("kB")
        }
        out.append((start, end, perms, rest[3] if len(rest) > 3 else "", fields))
    return out


def clean_file_mappings(smaps: str) -> list[tuple[int, int]]:
    """(start, length) of each read-only private mapping of a regular file in `smaps` with resident
    pages and no anonymous (copy-on-write) one: those a MADV_DONTNEED leaves reading as they did.
    Read-only, because no thread can write there between the read of smaps and the madvise (a
    written page of a writable one would be lost); special files (/dev/...) and anonymous mappings
    ([heap], [stack], ...) are never listed."""
    return [
        (start, end - start)
        for start, end, perms, path, fields in smaps_mappings(smaps)
        if perms[1] == "-"
        and perms[3] == "p"
        and path.startswith("/")
        and not path.startswith("/dev/")
        and fields.get("Rss", 0) > 0
        and fields.get("Anonymous", 0) == 0
    ]


def drop_clean_file_pages() -> None:
    """Drop this process's page-table entries of its clean read-only file mappings
    (`clean_file_mappings`). For a process that runs little of what it mapped (the zygote: its
    fork loop; numpy's OpenBLAS may have started an idle thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for start, length in clean_file_mappings(Path("/proc/self/smaps").read_text()):
        libc.madvise(start, length, _MADV_DONTNEED)  # a mapping it refuses (locked) keeps its pages


def _fork_server() -> Any:
    """This process's `multiprocessing` fork server record. Its alive pipe and pid are private to
    `multiprocessing` (3.9-3.14 keep them under these names); `test_lifecycle` fails if they move."""
    return multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]


def _set_title(argv: list[str]) -> None:
    """`ps` shows `epd serve encoder --port ...`, not the fork server's command line."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join(["epd", *argv]))
