"""Finds the test that leaves a gRPC channel open, a gRPC server serving, a child process or a thread running.

Why: gRPC shares subchannels process-wide between channels with the same address and arguments.
A channel left open to a server since stopped keeps that address's subchannel in reconnect
backoff, and a later test whose server got the same port-0 port (the kernel hands them out again)
is then called through it: its first calls fail UNAVAILABLE "Connection refused", a flake far
from its cause. A leak in epd's own objects (a close() that misses a channel) hides the same way.
A thread left running (an engine's decode workers, a stage's model thread, a pool never shut
down) is the same kind of leak: nothing fails, and the test process held 376 threads by the end
of the integration tests before each test's were checked.

How: the constructors of grpc's four classes (channel and server, sync and asyncio) are wrapped
when tests/conftest.py imports this module, so every one made in this process, by a test or by
epd, gets a record that close() or stop() marks; nothing is kept alive by it. `Thread.start` is
wrapped too, to note where each thread was started. After each test, its function-scoped
fixtures torn down, `check_test` names what the test made and left open (a channel neither
closed nor used as a context manager, a server started and never stopped, a child process still
running, a thread started during the test, Python's or a native one, still running after
THREAD_END_WAIT_S) and closes the channels, stops the sync servers and kills the processes, so
that later tests start clean (an asyncio server needs its event loop, gone by then; a thread
cannot be stopped from outside). The threads compared are those running when the test's own
fixtures are set up, after its module and session fixtures, so a wider fixture's threads are
never the test's; the few that run once per process by design are listed in ALLOWED_THREADS.
What a module or session fixture made or started, at its set-up or through its object during a
test (an SDK client opens its channel at its first call), or a thread that one of its threads
started during a test (a server's event loop starting its default executor), is that fixture's
to close: checked when the run ends (`leftovers`). A channel dropped without close() counts as left open: grpc
closes an asyncio one when it is collected, whenever a reference cycle lets that happen, and a
sync one's `__del__` does not close it.

EPD_LEAK_CHECK=off turns it off (e.g. to bisect something else); =report prints the leaks at the
end of the run without failing the tests.
"""

from __future__ import annotations

import gc
import itertools
import logging
import multiprocessing.process
import os
import signal
import subprocess
import sys
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


Frames = tuple[tuple[str, int, str], ...]
"""A stack as (file, line, function) from the outermost frame in: taken where a thing is made or a
thread started (cheap: no source lines read, no frame kept alive), formatted only for a report."""


def _stack(skip: int) -> Frames:
    frames = []
    frame: types.FrameType | None = sys._getframe(skip + 1)
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(reversed(frames))


def _format(stack: Frames) -> str:
    """The innermost frames outside grpc, the standard library, pytest and this file, and the test's own line."""
    frames = [traceback.FrameSummary(*f) for f in stack if not f[0].startswith(_NOT_OURS)]
    shown = frames[-6:]
    in_tests = [f for f in frames if f"{os.sep}tests{os.sep}" in f.filename]
    if in_tests and in_tests[-1] not in shown:  # the test's own line, however deep in epd it was made
        shown = [in_tests[-1], *shown]
    return "".join(traceback.format_list(shown)).rstrip() or "    (no frame of the project's)"


def _made_at() -> str:
    return _format(_stack(skip=1))


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
    _install_thread_start()
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

THREAD_END_WAIT_S = 2.0
"""How long the threads a test started get to end after it (a pool shut down without waiting, a
thread told to stop and not joined). Python threads are joined, so one that ends at once costs
nothing; native ones are polled."""

COLLECT_AFTER_S = 0.1
"""When the garbage is collected, if threads the test started are still running (see `_threads_still_running`)."""


@dataclass(frozen=True)
class Allowed:
    """A library's own thread, once per process by design: started by whichever test first needs
    it, and ended (if ever) by the library, not by anything a test closes."""

    name: str  # in a Python thread's name, or the start of a native thread's OS name (comm)
    started_in: str  # Python threads: in the file of the innermost frame that started it
    why: str


ALLOWED_THREADS = (
    # gRPC core's own native threads, started by the process's first channel or server and kept
    # (the EventEngine's pool grows and shrinks with the work; its lifeguard watches the pool).
    Allowed("grpc_global_tim", "", "gRPC core's timer manager"),
    Allowed("event_engine", "", "gRPC core's EventEngine worker pool"),
    Allowed("lifeguard", "", "gRPC core's EventEngine pool's watcher"),
    # grpc.aio's completion-queue poller: runs while any grpc.aio channel or server object exists,
    # however long until the last is collected (Cython objects, some in cycles): the records above
    # already fail a test that leaves one open.
    Allowed("(_poll_wrapper)", f"{os.sep}grpc{os.sep}aio{os.sep}", "grpc.aio's poller"),
    # tqdm's monitor: started by the first bar shown (transformers' weight-loading bar), ended
    # when the last bar is closed or collected.
    Allowed("tqdm_monitor", f"{os.sep}tqdm{os.sep}", "tqdm's monitor"),
)


def _install_thread_start() -> None:
    """Every thread's start records where it was started (on the Thread object: nothing kept alive)."""
    original = threading.Thread.start
    if getattr(original, "_leak_check", False):
        return

    def start(self):
        # a thread started by a thread: where that one was started too, back to the test
        parent = threading.current_thread()
        self._leak_check_started_at = getattr(parent, "_leak_check_started_at", ()) + _stack(skip=1)
        self._leak_check_parent = weakref.ref(parent)
        return original(self)

    start._leak_check = True  # type: ignore[attr-defined]
    threading.Thread.start = start  # type: ignore[method-assign]


def _started_in(thread: threading.Thread) -> str:
    """The file of the innermost frame that started `thread`, outside threading.py and this file."""
    for filename, _, _ in reversed(getattr(thread, "_leak_check_started_at", ())):
        if filename not in (threading.__file__, __file__):
            return filename
    return ""


def _allowed(thread: threading.Thread) -> bool:
    started_in = _started_in(thread)
    return any(a.started_in and a.name in thread.name and a.started_in in started_in for a in ALLOWED_THREADS)


def _allowed_native(comm: str) -> bool:
    return any(not a.started_in and comm.startswith(a.name) for a in ALLOWED_THREADS)


def _tasks() -> set[int]:
    """The OS threads of this process (Python's and native ones)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _comm(tid: int) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def _python_threads() -> list[threading.Thread]:
    """Threads started by Python; a C thread that called into Python (a `_DummyThread`, never
    removed from `threading.enumerate()` in 3.11) counts as native, by its OS thread."""
    return [t for t in threading.enumerate() if not isinstance(t, threading._DummyThread)]


def _native_threads(before: set[int]) -> set[int]:
    """OS threads started since `before` that are not a Python thread's, nor allowed."""
    ours = {t.native_id for t in _python_threads()}
    return {tid for tid in _tasks() - before - ours if _checked_native(_comm(tid))}


def _checked_native(comm: str) -> bool:
    """A native thread that names itself (FFmpeg's codec threads: "av:h264:df0") and is not allowed.
    An unnamed one keeps the process's name and cannot be told apart: torch's OpenMP pool, which
    grows once a test raises torch's thread count and is kept by design, or swscale's (a converter's,
    on a decode thread that the Python threads' check names)."""
    return bool(comm) and comm != _PROCESS_NAME and not _allowed_native(comm)


_PROCESS_NAME = _comm(os.getpid())


def _threads_still_running(
    started: list[threading.Thread], native: set[int]
) -> tuple[list[threading.Thread], set[int]]:
    """Those of `started` and of the OS threads `native` still running after THREAD_END_WAIT_S.
    Past COLLECT_AFTER_S the garbage is collected once: a thread whose owner was dropped but waits
    in a reference cycle ends when it is collected (an unreferenced `ThreadPoolExecutor`'s workers,
    grpc.aio's poller, which runs while any asyncio channel or server exists)."""
    started, native = _wait_threads(started, native, COLLECT_AFTER_S)
    if started or native:
        gc.collect()
        started, native = _wait_threads(started, native, THREAD_END_WAIT_S - COLLECT_AFTER_S)
    # a native thread names itself once running: one new a moment ago may have named itself since
    return started, {tid for tid in native if _checked_native(_comm(tid))}


def _wait_threads(
    started: list[threading.Thread], native: set[int], wait_s: float
) -> tuple[list[threading.Thread], set[int]]:
    deadline = time.monotonic() + wait_s
    for thread in started:
        thread.join(max(0.0, deadline - time.monotonic()))
    while native and time.monotonic() < deadline:
        time.sleep(0.01)
        native &= _tasks()
    return [t for t in started if t.is_alive()], native & _tasks() if native else native


def threads_left(before: set[threading.Thread]) -> list[str]:
    """The names of the Python threads started since `before` (a `set(threading.enumerate())`) and
    still running after THREAD_END_WAIT_S: for a test of a close() that must end the threads its
    object started, checked inside the test (every test's threads are also checked after it)."""
    alive, _ = _threads_still_running(
        [t for t in _python_threads() if t not in before and not _allowed(t)], set()
    )
    return sorted(t.name for t in alive)


def _started_by_older(thread: threading.Thread, before: set[threading.Thread]) -> bool:
    """Whether `thread` was started, itself or through the threads that started it, by a thread
    (not the main one) already running before the test: a wider fixture's thread, as a server's
    event loop whose default executor starts its threads at the first call, in some test."""
    parent_ref = getattr(thread, "_leak_check_parent", None)
    while parent_ref is not None and (parent := parent_ref()) is not None:
        if parent is threading.main_thread():
            return False
        if parent in before:
            return True
        parent_ref = getattr(parent, "_leak_check_parent", None)
    return False


def _runs_method_of(thread: threading.Thread) -> object | None:
    """The object whose bound method `thread` runs (its target's `__self__`), if any."""
    return getattr(getattr(thread, "_target", None), "__self__", None)


def _describe_thread(thread: threading.Thread) -> str:
    target = getattr(thread, "_target", None)
    runs = (
        f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
        if target is not None
        else f"{type(thread).__module__}.{type(thread).__qualname__}.run"
    )
    started_at = _format(getattr(thread, "_leak_check_started_at", ()))
    return f"thread {thread.name!r} running {runs}, still running; started at\n{started_at}"


def _describe_native(tid: int) -> str:
    return (
        f"native thread {tid} ({_comm(tid) or 'ended'}), no Python thread's, still running "
        "(a library's: FFmpeg's, swscale's, xgrammar's...; see which object the test left unclosed)"
    )


def release_logged_errors(records: list[logging.LogRecord]) -> None:
    """Clear the frames of the tracebacks that the test's log records carry (an exception in a
    record's args or exc_info, and those it chains). pytest's log capture keeps a test's records
    until its teardown has ended, and a traceback's frames keep their locals alive: a decoder's
    codec context and its FFmpeg threads, after a logged decode failure, were named as this
    test's. The messages stay (a record's text needs no frame)."""
    for record in records:
        args = record.args.values() if isinstance(record.args, dict) else record.args or ()
        errors = [a for a in args if isinstance(a, BaseException)]
        if record.exc_info and record.exc_info[1] is not None:
            errors.append(record.exc_info[1])
        seen: set[int] = set()
        while errors:
            error = errors.pop()
            if id(error) in seen:
                continue
            seen.add(id(error))
            if error.__traceback__ is not None:
                traceback.clear_frames(error.__traceback__)
            errors.extend(e for e in (error.__cause__, error.__context__) if e is not None)


_fixture_threads: list[tuple[weakref.ref, str]] = []
"""Threads a module or session fixture's object started during a test: that fixture's to end."""


# --- per test and per run -------------------------------------------------------------------


@dataclass
class TestScope:
    first_serial: int
    children: set[int]
    threads: set[threading.Thread]
    tasks: set[int]


def begin_test() -> TestScope:
    return TestScope(next(_serial), child_pids(), set(threading.enumerate()), _tasks())


def check_test(scope: TestScope, wider_fixtures: Callable[[], list[Any]]) -> list[str]:
    """What the test made since `begin_test` and left open (channels closed, servers stopped and
    processes killed now, in fail mode: a report run leaves them; a thread cannot be stopped from
    outside); [] when nothing. What a module or session fixture's object made or started during
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
    threads, native = _threads_still_running(
        [t for t in _python_threads() if t not in scope.threads and not _allowed(t)],
        _native_threads(scope.tasks),
    )
    if not (open_records or children or threads):
        return [_describe_native(tid) for tid in sorted(native)]
    # a thread is a fixture's when its object reaches the thread, or the object whose method it runs
    thread_roots = {id(t) for t in threads} | {
        id(o) for t in threads if (o := _runs_method_of(t)) is not None
    }
    owned_objects, owned_pids = _reachable(
        wider_fixtures(), {id(o) for r in open_records if (o := r.ref())} | thread_roots, children
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
    for thread in threads:
        owner = _runs_method_of(thread)
        owned = id(thread) in owned_objects or (owner is not None and id(owner) in owned_objects)
        if owned or _started_by_older(thread, scope.threads):
            # the fixture's: it must end it by the end of the run
            _fixture_threads.append((weakref.ref(thread), _describe_thread(thread)))
        else:
            leaks.append(_describe_thread(thread))
    return leaks + [_describe_native(tid) for tid in sorted(native)]


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
    """What module and session fixtures (made outside any test) left open or running at the end of the run."""
    threads, _ = _threads_still_running([t for ref, _ in _fixture_threads if (t := ref()) is not None], set())
    return [rec.describe() for rec in list(_records.values()) if rec.is_open()] + [
        description for ref, description in _fixture_threads if ref() in threads
    ]
