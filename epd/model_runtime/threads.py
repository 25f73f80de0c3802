"""torch threads per model call that follow the load (`--num-threads auto`).

A stack's three model processes share the machine's cores. With one request in flight they take
turns (encode, then prefill, then decode): one thread per call leaves the other cores idle while
one stage works. With many in flight every process is busy, and more threads than cores only
make them fight over the cores (OpenMP threads spinning against each other). So each call takes
the cores divided by the number of the stack's processes inside a model call at that moment:

    threads = max(1, cores // (1 + other stages busy now))

Decode is the exception while the stages share a host (a board exists): its steps take one thread.
A decode step advances each running request by one token: a few small matrix products per layer,
bound by reading the weights, not by arithmetic. Measured on the 2-core bench machine (the 27M
Qwen2-VL, one request in flight, docs/benchmarks.md): a second thread left the step time as it was
(TPOT 14.0-14.4 ms with one thread, 14.5-16.2 ms with two) and doubled decode's CPU time per
request (443-476 ms against 862-1016 ms): cycles the next requests' encode and prefill need.

The stages learn who is busy from a tiny shared board: one byte per stage in a file the launcher
names (`EPD_THREADS_BOARD`, in /dev/shm), set while that stage is inside a model call. A service
started on its own (no board: compose, Kubernetes, its own machine) falls back to its own queue:
every core for a call that serves one request with nothing else waiting, one thread otherwise.
A fixed `--num-threads N` keeps N for every call.

One process whose model threads run several calls at once (`epd serve --colocate`, where a decode
step runs beside an encode or prefill step: `--concurrent-steps`) applies the same rule to its own
calls (`CallThreads`): each call takes the cores divided by the calls running when it starts, all
of them when it runs alone, except a decode step of a few rows (`ONE_THREAD_BELOW_ROWS`). Measured
on the 2-core bench machine at 16 in flight (docs/benchmarks.md, "Two steps at once"): against
every core for every call, the time per token fell by 40% in the 8-frame setting and by a seventh
in the 4-frame one, at the same or higher requests/s.

One OpenMP team per process: libgomp (torch's OpenMP on Linux) gives every OS thread that runs a
multi-threaded torch operation its own team of worker threads, kept for the thread's life, and once
a process holds more such threads than the machine has cores, every team's idle workers stop
spinning and sleep at once, whatever the wait policy (libgomp's "throttled" spin). Each later
parallel operation then wakes a sleeping worker first: ~40-80 us on the 2-core bench VM, paid by
each of the few hundred operations of a prefill or tower call. A second team came from threads
that only move tensors: the event loop's (the tensors of a request or a KV cache, copied in
parallel) and the encoder's per-request drivers (each frame group's preprocessing). So in a
serving process only the model threads run torch on more than one thread: every other thread is
pinned to one (`pin_torch_threads(1)`: the event loop's once the model is loaded, the drivers'
when they start), and of a colocated server's model threads only the first runs a call on more
than one (`CallThreads`; the model threads give a call to the first whenever it is idle). Measured
on the 2-core bench machine (docs/benchmarks.md, "One OpenMP team per process"): the colocated
server's first token at one request in flight 4-14% sooner, its requests/s at 16 in flight with 4
frames 8% higher; the stack's tower and prefill calls as fast as in a process of their own once
its workers may spin (`GOMP_SPINCOUNT`; its default stays passive, below).

Idle OpenMP threads: libgomp (torch's OpenMP on Linux) lets a team's threads spin for a while
after each parallel region (300,000 iterations unless told otherwise), waiting for the next
region. In one process that is cheap; in a stack's three model processes on the same cores it is
CPU taken from the other stages. So the loopback stack starts its services with
`OMP_WAIT_POLICY=PASSIVE` (idle threads sleep at once) unless the operator set the policy
(`shared_cores_environment`). Measured on the 2-core bench machine at 16 in flight
(docs/benchmarks.md, "Idle OpenMP threads"): prefill's CPU per request fell by a fifth and the
stack's requests/s rose 3-24% (11% on average); the colocated server (one process) showed no
difference (its several teams throttled every wait then, above). With one team per process, a short
spin (`GOMP_SPINCOUNT=20000`) takes a fifth off the stack's first token at one request in flight
with 4 frames but costs 2-6% of its requests/s at 16 in flight: passive waits stay its default.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

AUTO = 0
"""`ModelConfig.num_threads` value meaning "follow the load"."""

BOARD_ENV = "EPD_THREADS_BOARD"
"""Path of the busy board shared by one stack's services (set by `epd serve`)."""

STAGES = ("encoder", "prefill", "decode")

SHARED_HOST_MAX_THREADS = {"decode": 1}
"""Threads per call of a stage whatever the board says, while the stages share a host (above)."""

ONE_THREAD_BELOW_ROWS = {"decode": 4}
"""A colocated server's step of a stage with fewer rows than this runs on one thread: a second
thread took 6% off a one-row decode step and 9% off two rows, 26-30% off 8-16 rows
(`bench/bench_decode_batch.py`, docs/benchmarks.md "One OpenMP team per process"), and a team
spinning through every step at one request in flight doubled the server's CPU per request. Such a
step goes to the last idle model thread (`ModelThread.run_single`), leaving the first, the one that
runs calls on more than one thread, to the next encode or prefill step."""


OPENMP_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""What sets how idle OpenMP threads wait (libgomp reads them when it loads, with torch)."""


def shared_cores_environment(environ: dict[str, str]) -> dict[str, str]:
    """What to add to the environment of model processes that share the machine's cores (the
    loopback stack): passive OpenMP waits (see the module docstring), unless `environ` already
    sets how OpenMP threads wait."""
    if any(name in environ for name in OPENMP_WAIT_SETTINGS):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def pin_torch_threads(num_threads: int) -> None:
    """Set this OS thread's torch threads for good. torch sets a thread's count at the thread's
    first parallel operation from the count last set by any thread (`torch.set_num_threads` sets
    both), which would undo a count set earlier in this thread by another thread's later call:
    `get_num_threads()` makes torch take that first step now."""
    import torch

    torch.get_num_threads()
    torch.set_num_threads(num_threads)


def lower_cpu_priority(nice_increment: int) -> None:
    """Raise the nice value of every thread of this process by `nice_increment` (a lower CPU
    priority; threads started later inherit it). On Linux nice is per thread, so `os.nice` alone
    would leave the threads already running as they were. Why a service would: on a host whose
    cores the stack's stages share, a decode process at nice 5 lets the encode and prefill steps of
    the requests that wait go first (`epd serve --schedule ttft-first`)."""
    if nice_increment == 0:
        return
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: nice is per process there
        os.nice(nice_increment)
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice_increment)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


BOARD_PREFIX = "epd-threads-"
"""Boards are in `board_directory()`: a stack's is `stack_board_name(stack id)`; one named
`BOARD_PREFIX<launcher pid>.board` is an older launcher's (or a process's own, `new_board_path()`)."""


def board_directory() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def stack_board_name(stack_id: str) -> str:
    """The board of the stack whose files directory is `epd-stack-<stack id>` (`<pid>-<random>`):
    `epd-threads-of-<stack id>.board`. "of-": launchers of older versions swept every
    `epd-threads-<pid>-...` of a dead pid machine-wide, and leave this name alone."""
    return f"{BOARD_PREFIX}of-{stack_id}.board"


def new_board_path(stack_id: str = "") -> str:
    """A fresh board for one stack (the launcher's; removed by `remove_board`, or by the next
    launcher when this one was killed: epd/cli/leftovers.py). `stack_id`: the launcher's files
    directory's name after its prefix (`<pid>-<random>`), whose removal takes the board with it;
    default: this process's pid."""
    path = board_directory() / (
        stack_board_name(stack_id) if stack_id else f"{BOARD_PREFIX}{os.getpid()}.board"
    )
    path.write_bytes(bytes(len(STAGES)))
    return str(path)


def remove_board(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class BusyBoard:
    """One byte per stage: 1 while that stage's process is inside a model call."""

    def __init__(self, path: str, stage: str) -> None:
        self.slot = STAGES.index(stage)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), len(STAGES))

    def set_busy(self, busy: bool) -> None:
        self._map[self.slot] = 1 if busy else 0

    def others_busy(self) -> int:
        return sum(1 for i, b in enumerate(self._map[: len(STAGES)]) if b and i != self.slot)


class StepThreads:
    """Sets torch's intra-op threads before each batched step (on the model thread)."""

    def __init__(self, num_threads: int, stage: str | None = None, board_path: str | None = None) -> None:
        self.auto = num_threads == AUTO
        self.fixed = num_threads
        self.cores = num_cores()
        self.current: int | None = None
        self.board: BusyBoard | None = None
        self.max_shared: int | None = SHARED_HOST_MAX_THREADS.get(stage or "")
        board_path = board_path if board_path is not None else os.environ.get(BOARD_ENV)
        if self.auto and stage in STAGES and board_path:
            try:
                self.board = BusyBoard(board_path, stage)
            except (OSError, ValueError) as exc:
                log.warning(
                    "no shared threads board at %s (%s); threads follow this stage's queue only",
                    board_path,
                    exc,
                )

    def for_step(self, num_in_step: int, num_waiting: int) -> int:
        if not self.auto:
            return self.fixed
        if self.board is not None:
            share = max(1, self.cores // (1 + self.board.others_busy()))
            return share if self.max_shared is None else min(share, self.max_shared)
        return self.cores if num_in_step <= 1 and num_waiting == 0 else 1

    def apply(self, num_in_step: int, num_waiting: int) -> None:
        """Before a step: choose and set the threads, and say this stage is busy."""
        if self.board is not None:
            self.board.set_busy(True)
        n = self.for_step(num_in_step, num_waiting)
        if n != self.current:
            import torch

            torch.set_num_threads(n)
            self.current = n

    def done(self) -> None:
        """After the step: this stage is no longer busy."""
        if self.board is not None:
            self.board.set_busy(False)

    def worker_started(self, index: int) -> None:
        """On the model thread, before its first call: torch's count for this thread is taken now
        (`pin_torch_threads`), so the steps' own counts are the ones that hold."""
        pin_torch_threads(self.fixed or self.cores)


class CallThreads:
    """torch threads for the calls of one process's model threads: cores // calls running, on the
    first model thread; one on the others, so that the process keeps one OpenMP team (the module
    docstring). The model threads give a call to the first whenever it is idle, so a call that
    runs alone runs there."""

    def __init__(self, cores: int | None = None) -> None:
        self.cores = cores or num_cores()
        self._running = 0
        self._lock = threading.Lock()

    def for_call(self, num_running: int) -> int:
        return max(1, self.cores // max(1, num_running))

    def enter(self, worker: int = 0) -> int:
        """Before a call, on model thread `worker`: count it and set its threads (returned). Set on
        every call: MKL's count is process-wide, and another thread's call may have changed it."""
        import torch

        with self._lock:
            self._running += 1
            n = self.for_call(self._running) if worker == 0 else 1
        torch.set_num_threads(n)
        return n

    def exit(self) -> None:
        with self._lock:
            self._running -= 1

    @staticmethod
    def narrows(lane: str, num_rows: int) -> bool:
        """Whether a step of `lane` (its stage) with `num_rows` rows runs on one thread
        (`ONE_THREAD_BELOW_ROWS`)."""
        return num_rows < ONE_THREAD_BELOW_ROWS.get(lane, 0)

    def narrow_step(self, lane: str, num_rows: int) -> None:
        """Inside a call, on its model thread: a step that `narrows` runs on one thread, on any
        model thread it landed on (the next call's `enter` sets its own)."""
        if self.narrows(lane, num_rows):
            import torch

            torch.set_num_threads(1)

    def worker_started(self, index: int) -> None:
        """On model thread `index`, before its first call (`StepThreads.worker_started`)."""
        pin_torch_threads(self.cores if index == 0 else 1)
