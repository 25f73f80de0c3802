"""Finds the test that leaves a gRPC channel open, a gRPC server serving, or a child process running.

Why: gRPC shares subchannels process-wide between channels with the same address and arguments.
A channel left open to a server since stopped keeps that address's subchannel in reconnect
backoff, and a later test whose server got the same port-0 port (the kernel hands them out again)
is then called through it: its first calls fail UNAVAILABLE "Connection refused", a flake far
from its cause. A leak in epd's own objects (a close() that misses a channel) hides the same way.

How: the constructors of grpc's four classes (channel and server, sync and asyncio) are wrapped
when tests/conftest.py imports this module, so every one made in this process, by a test or by
epd, gets a record that close() or stop() marks; nothing is kept alive by it. After each test,
its function-scoped fixtures torn down, `check_test` names what the test made and left open (a
channel neither closed nor used as a context manager, a server started and never stopped, a
child process still running) and closes the channels, stops the sync servers and kills the
processes, so that later tests start clean (an asyncio server needs its event loop, gone by
then). What a module or session fixture made, at its set-up or through its object during a test
(an SDK client opens its channel at its first call), is that fixture's to close: checked when the
run ends (`leftovers`). A channel dropped without close() counts as left open: grpc closes an
asyncio one when it is collected, whenever a reference cycle lets that happen, and a sync one's
`__del__` does not close it.

EPD_LEAK_CHECK=off turns it off (e.g. to bisect something else); =report prints the leaks at the
end of the run without failing the tests.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing.process
import os
import signal
import subprocess
import sysconfig
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc._channel
import grpc._server
import grpc.aio._channel
import grpc.aio._server

MODE = os.environ.get("EPD_LEAK_CHECK", "fail")
"""fail (default): a test that leaks fails at teardown; report: listed at the end; off."""

PROCESS_EXIT_WAIT_S = 2.0
"""How long a child process the test signalled but did not wait for gets to finish exiting."""

_SESSION_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Child processes Python starts once for the whole run (made by whichever test first needs them)."""

# Frames shown where a thing was made: the project's own (tests and epd), not the standard
# library's, grpc's, pytest's or this file's.
_NOT_OURS = tuple(
    {
        str(Path(p))
        for name in ("stdlib", "platstdlib", "purelib", "platlib")
        for p in (sysconfig.get_paths()[name], Path(sysconfig.get_paths()[name]).resolve())
    }
    | {
        str(Path(grpc.__file__).resolve().parent.parent),
        str(Path(__file__)),
        str(Path(__file__).resolve()),
        "<frozen ",
    }
)


@dataclass
class Opened:
    serial: int
    kind: str  # "grpc channel", "grpc.aio channel", "grpc server", "grpc.aio server"
    target: str  # a channel's address, a server's ports
    made_at: str  # the innermost frames outside grpc that made it
    ref: weakref.ref
    done: bool = False  # closed (channel) or stopped (server)
    started: bool = False  # servers only: a server never started holds no port
    ports: list[int] = field(default_factory=list)

    def is_open(self) -> bool:
        return not self.done and (self.started or "channel" in self.kind)

    def describe(self) -> str:
        where = f" to {self.target}" if "channel" in self.kind else f" on port(s) {self.ports or '?'}"
        return f"{self.kind}{where}, not {'closed' if 'channel' in self.kind else 'stopped'}; made at\n{self.made_at}"


_serial = itertools.count()
_records: dict[int, Opened] = {}  # not yet checked, by serial


def _made_at() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if not f.filename.startswith(_NOT_OURS)]
    shown = frames[-6:]
    in_tests = [f for f in frames if f"{os.sep}tests{os.sep}" in f.filename]
    if in_tests and in_tests[-1] not in shown:  # the test's own line, however deep in epd it was made
        shown = [in_tests[-1], *shown]
    return "".join(traceback.format_list(shown)).rstrip()


def _record(obj: Any, kind: str, target: str) -> None:
    rec = Opened(next(_serial), kind, target, _made_at(), weakref.ref(obj))
    obj._leak_check_record = rec
    _records[rec.serial] = rec


def _mark(obj: Any, **flags: bool) -> None:
    rec = getattr(obj, "_leak_check_record", None)
    if rec is not None:
        for name, value in flags.items():
            setattr(rec, name, value)


def _wrap(cls: type, name: str, **flags: bool) -> None:
    original = getattr(cls, name)
    if getattr(original, "_leak_check", False):
        return

    if name in ("start", "stop", "_close") and cls in (grpc.aio._channel.Channel, grpc.aio._server.Server):

        async def wrapper(self, *args, **kwargs):  # asyncio: marked when called, as the closing begins
            _mark(self, **flags)
            return await original(self, *args, **kwargs)
    else:

        def wrapper(self, *args, **kwargs):  # type: ignore[misc]
            _mark(self, **flags)
            return original(self, *args, **kwargs)

    wrapper._leak_check = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def _wrap_init(cls: type, kind: str, channel: bool) -> None:
    original = cls.__init__
    if getattr(original, "_leak_check", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        target = args[0] if channel and args else kwargs.get("target", "?")
        _record(self, kind, target if isinstance(target, str) else repr(target))

    __init__._leak_check = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]


def _wrap_add_port(cls: type, name: str) -> None:
    original = getattr(cls, name)
    if getattr(original, "_leak_check", False):
        return

    def wrapper(self, *args, **kwargs):
        port = original(self, *args, **kwargs)
        rec = getattr(self, "_leak_check_record", None)
        if rec is not None:
            rec.ports.append(port)
        return port

    wrapper._leak_check = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def install() -> None:
    if MODE == "off":
        return
    _wrap_init(grpc._channel.Channel, "grpc channel", channel=True)
    _wrap_init(grpc.aio._channel.Channel, "grpc.aio channel", channel=True)
    _wrap_init(grpc._server._Server, "grpc server", channel=False)
    _wrap_init(grpc.aio._server.Server, "grpc.aio server", channel=False)
    _wrap(grpc._channel.Channel, "_close", done=True)  # close() and __exit__
    _wrap(grpc.aio._channel.Channel, "_close", done=True)  # close() and __aexit__
    for cls in (grpc._server._Server, grpc.aio._server.Server):
        _wrap(cls, "start", started=True)
        _wrap(cls, "stop", done=True)
        _wrap_add_port(cls, "add_insecure_port")
        _wrap_add_port(cls, "add_secure_port")


def _shut(rec: Opened) -> None:
    """Close a leaked channel or stop a leaked server, so that later tests are not hit by it."""
    obj = rec.ref()
    if obj is None:
        return
    try:
        if rec.kind == "grpc channel":
            obj.close()
        elif rec.kind == "grpc.aio channel":
            obj._channel.close()  # the Cython channel closes synchronously; no event loop needed
        elif rec.kind == "grpc server":
            obj.stop(None)
    except Exception:  # noqa: BLE001 - best effort: the leak is reported either way
        pass


# --- child processes ------------------------------------------------------------------------


def child_pids() -> set[int]:
    """This process's children, running (zombies, exited but not yet reaped, hold nothing).

    Read twice per test, one file per thread of the test process (a child is listed under the
    thread that started it), and that process holds hundreds of threads by the middle of the
    suite: plain os.open/os.read, a third of Path.read_text's cost there (~3 ms a test saved)."""
    pids: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for tid in tasks:
        try:
            fd = os.open(f"/proc/self/task/{tid}/children", os.O_RDONLY)
        except OSError:  # the thread has ended
            continue
        try:
            listed = os.read(fd, 1 << 16)
        except OSError:
            continue
        finally:
            os.close(fd)
        pids.update(int(p) for p in listed.split())
    return {pid for pid in pids if _running(pid)}


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _new_children(before: set[int]) -> set[int]:
    return {pid for pid in child_pids() - before if not any(h in _cmdline(pid) for h in _SESSION_HELPERS)}


def _still_running(pids: set[int]) -> dict[int, str]:
    """Those of `pids` still running after PROCESS_EXIT_WAIT_S, with their command lines."""
    deadline = time.monotonic() + PROCESS_EXIT_WAIT_S
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = {pid for pid in pids if _running(pid)}
    return {pid: _cmdline(pid) for pid in pids}


# --- threads ---------------------------------------------------------------------------------


def threads_left(before: set[threading.Thread]) -> list[str]:
    """The names of the threads started since `before` (a `set(threading.enumerate())`) and still
    running after PROCESS_EXIT_WAIT_S: for a test of a close() that must end the threads its object
    started (nothing checks threads after every test: the test process keeps a few that are
    Python's or gRPC's own, started once)."""
    deadline = time.monotonic() + PROCESS_EXIT_WAIT_S
    started = [t for t in threading.enumerate() if t not in before]
    while (alive := [t for t in started if t.is_alive()]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(t.name for t in alive)


# --- per test and per run -------------------------------------------------------------------


@dataclass
class TestScope:
    first_serial: int
    children: set[int]


def begin_test() -> TestScope:
    return TestScope(next(_serial), child_pids())


def check_test(scope: TestScope, wider_fixtures: Callable[[], list[Any]]) -> list[str]:
    """What the test made since `begin_test` and left open (closed or killed now, in fail mode: a
    report run leaves it); [] when nothing. What a module or session fixture's object made during
    the test (an SDK client's channel opens at its first call; a stack restarts a process) is
    that fixture's: found from `wider_fixtures()`, the values of the test's module and session
    fixtures, it is checked at the end of the run instead."""
    open_records = []
    # list(): a snapshot taken under the GIL, as another thread may make a channel meanwhile
    for serial in [s for s in list(_records) if s > scope.first_serial]:
        rec = _records.pop(serial)
        if rec.is_open():
            open_records.append(rec)
    children = _new_children(scope.children)
    if not (open_records or children):
        return []
    owned_objects, owned_pids = _reachable(
        wider_fixtures(), {id(o) for r in open_records if (o := r.ref())}, children
    )
    leaks: list[str] = []
    for rec in open_records:
        obj = rec.ref()
        if obj is not None and id(obj) in owned_objects:
            _records[rec.serial] = rec  # the fixture's: it must close it by the end of the run
            continue
        leaks.append(rec.describe())
        if MODE == "fail":
            _shut(rec)
    for pid, cmdline in _still_running(children - owned_pids).items():
        leaks.append(f"child process {pid} still running: {cmdline[:300]}")
        if MODE == "fail":
            _kill(pid)
    return leaks


_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.CodeType, types.FrameType, str, bytes)
MAX_WALKED_OBJECTS = 200_000
"""Bound of the walk from the fixtures' values (done only when a test left something open)."""


def _reachable(roots: list[Any], object_ids: set[int], pids: set[int]) -> tuple[set[int], set[int]]:
    """Which of `object_ids`, and of the processes `pids` (by their Popen or multiprocessing
    Process object), the objects `roots` reach by references."""
    found_objects: set[int] = set()
    found_pids: set[int] = set()
    seen: set[int] = set()
    todo = list(roots)
    while todo and len(seen) < MAX_WALKED_OBJECTS:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _NOT_WALKED):
            continue
        seen.add(id(obj))
        if id(obj) in object_ids:
            found_objects.add(id(obj))
        if isinstance(obj, (subprocess.Popen, multiprocessing.process.BaseProcess)) and obj.pid in pids:
            found_pids.add(obj.pid)
        todo.extend(gc.get_referents(obj))
    return found_objects, found_pids


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass


def leftovers() -> list[str]:
    """What module and session fixtures (made outside any test) left open at the end of the run."""
    return [rec.describe() for rec in list(_records.values()) if rec.is_open()]
