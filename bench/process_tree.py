"""What a server's process tree uses, read with psutil from outside it (the load client's side):
PSS summed over the processes (`tree_pss`, sampled for its peak by `PeakPss`), how many map
tcmalloc, CPU seconds by role (`tree_cpu_s`; `cpu_by_role` of two snapshots), and where the PSS
is, per process and kind (`tree_memory`: anonymous, file-backed, shared memory, from
/proc/PID/smaps_rollup; `PeakPss` keeps the one of its peak sample), and the tree's PSS as if
nothing outside it mapped its pages (`tree_pss_alone`: on a busy machine, other processes that
map the same library files take their share of those pages' PSS, so `tree_pss` reads lower than
the same tree on a quiet one). `settled` reads a value (the tree's PSS) until it stops moving: after a
load, once the services' idle release has given their free memory back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

MiB = 1 << 20


def tree_pss(pid: int) -> tuple[int, int]:
    """(PSS bytes summed over the process and its descendants, number of processes)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    total = count = 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
            count += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total, count


SETTLE_INTERVAL_S = 0.5
SETTLE_WINDOW_READS = 3
"""Reads in a row that must agree: 3 reads 0.5 s apart span 1 s, the longest a service waits after
its last request before its idle release (its first idle 0.5 s tick, epd/transport/idle_memory.py),
so two equal reads taken before the release do not end the wait."""
SETTLE_TOLERANCE_RATIO = 0.01
SETTLE_MAX_READS = 12
"""The bound on the wait: 12 reads, 5.5 s."""


def settled(
    read: Callable[[], int],
    interval_s: float = SETTLE_INTERVAL_S,
    window_reads: int = SETTLE_WINDOW_READS,
    tolerance_ratio: float = SETTLE_TOLERANCE_RATIO,
    max_reads: int = SETTLE_MAX_READS,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[int, bool]:
    """`read()` every `interval_s` until its last `window_reads` values agree within
    `tolerance_ratio` of the largest, at most `max_reads` times: (the last value, whether they
    agreed). After a load, `settled(lambda: tree_pss(pid)[0])` is the tree's PSS once its services
    are idle and have given their free memory back, not a read taken before their idle release."""
    values: list[int] = []
    while True:
        values.append(read())
        window = values[-window_reads:]
        if len(window) == window_reads and max(window) - min(window) <= tolerance_ratio * max(window):
            return values[-1], True
        if len(values) >= max_reads:
            return values[-1], False
        sleep(interval_s)


def tree_on_tcmalloc(pid: int) -> int:
    """How many of the process and its descendants map tcmalloc (epd serve's --allocator)."""
    import psutil

    count = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        try:
            count += any("libtcmalloc" in m.path for m in p.memory_maps())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return count


def tree_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the process and each descendant, by role: the
    epd service a process runs (`serve encoder`, ... from its command line) or the first words of
    its command line. Differences of two of these give where a level's core-seconds went."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            role = role_of(p.cmdline())
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out[f"{role} ({p.pid})"] = t.user + t.system
    return out


def role_of(cmdline: list[str]) -> str:
    """The epd service a process runs (`epd encoder`, ... from its command line), `epd launcher`,
    `transformers serve`, or the name of its program."""
    words = " ".join(cmdline).split()  # a forked service's title is one string (setproctitle)
    role = next(
        (
            f"epd {w}"
            for w, prev in zip(words[1:], words)
            if prev == "serve" and w in ("encoder", "prefill", "decode", "gateway")
        ),
        "",
    )
    if role:
        return role
    if "serve" in words and ("epd.cli.main" in words or any(Path(w).name == "epd" for w in words[:2])):
        return "epd launcher"
    if "transformers_serve_launcher" in " ".join(words):
        return "transformers serve"
    return Path(words[0]).name if words else "?"


# smaps_rollup's lines summed into each kind (kB there, bytes here)
MEMORY_KINDS = {"anon": "Pss_Anon", "file": "Pss_File", "shmem": "Pss_Shmem", "rss": "Rss"}


def tree_memory(pid: int) -> list[dict]:
    """Per process of the tree: role, pid, threads and PSS bytes by kind (anonymous, file-backed,
    shared memory) and RSS, from /proc/PID/smaps_rollup (Linux 5.x: Pss_Anon, Pss_File)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    rows = []
    for p in procs:
        try:
            role, threads = role_of(p.cmdline()), p.num_threads()
            fields = {}
            for line in Path(f"/proc/{p.pid}/smaps_rollup").read_text().splitlines()[1:]:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            continue
        row = {"role": role, "pid": p.pid, "threads": threads}
        row.update({kind: fields.get(key, 0) for kind, key in MEMORY_KINDS.items()})
        row["pss"] = fields.get("Pss", 0)
        rows.append(row)
    return rows


def memory_lines(rows: list[dict]) -> list[str]:
    """`tree_memory`'s rows as text, MiB, largest PSS first, with the total."""
    out = [
        f"  {r['role']} ({r['pid']}, {r['threads']} threads): PSS {r['pss'] / MiB:.0f} "
        f"(anon {r['anon'] / MiB:.0f}, file {r['file'] / MiB:.0f}, shmem {r['shmem'] / MiB:.0f}), "
        f"RSS {r['rss'] / MiB:.0f}"
        for r in sorted(rows, key=lambda r: -r["pss"])
    ]
    total = {k: sum(r[k] for r in rows) for k in ("pss", "anon", "file", "shmem")}
    out.append(
        f"  total: PSS {total['pss'] / MiB:.0f} (anon {total['anon'] / MiB:.0f}, "
        f"file {total['file'] / MiB:.0f}, shmem {total['shmem'] / MiB:.0f}) MiB"
    )
    return out


def cpu_by_role(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Core-seconds per role between two `tree_cpu_s` snapshots (processes summed by role)."""
    spent: dict[str, float] = {}
    for key, t in after.items():
        role = key.rsplit(" (", 1)[0]
        spent[role] = spent.get(role, 0.0) + t - before.get(key, 0.0)
    return {role: round(t, 2) for role, t in sorted(spent.items(), key=lambda x: -x[1]) if t >= 0.01}


class PeakPss:
    """Samples the tree's PSS every `interval_s` in a thread; .peak is the largest seen, .at_peak
    that sample's `tree_memory` rows."""

    def __init__(self, pid: int, interval_s: float = 1.0):
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self.at_peak: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rows = tree_memory(self.pid)
            pss = sum(r["pss"] for r in rows)
            if pss > self.peak:
                self.peak, self.at_peak = pss, rows
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakPss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def tree_pss_alone(pid: int) -> dict[str, float] | None:
    """MiB per process of the tree (`role (pid)`) and "total": each resident page divided among the
    tree's processes that map it, none outside; what `tree_pss` reads when nothing else maps those
    pages (a quiet machine). From /proc/PID/pagemap's page frame numbers, which only root reads
    (None otherwise). ~0.1 s of CPU per process: not for the load's peak sampler."""
    import numpy as np
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    frames: dict[str, np.ndarray] = {}
    for p in procs:
        try:
            frames[f"{role_of(p.cmdline())} ({p.pid})"] = _resident_frames(p.pid)
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
        except PermissionError:
            return None
    if not frames or not any(f.any() for f in frames.values()):
        return None  # not root: pagemap reads the frame numbers as 0
    every, counts = np.unique(np.concatenate(list(frames.values())), return_counts=True)
    out = {key: float((4096.0 / counts[np.searchsorted(every, f)]).sum()) / MiB for key, f in frames.items()}
    out["total"] = sum(out.values())
    return out


def _resident_frames(pid: int):
    """The page frame numbers of the process's resident pages (/proc/PID/maps, /proc/PID/pagemap)."""
    import numpy as np

    present, pfn_mask = np.uint64(1 << 63), np.uint64((1 << 55) - 1)
    out = []
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            span, *rest = line.split(maxsplit=5)
            if rest[-1:] == ["[vsyscall]"]:
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            pagemap.seek(start // 4096 * 8)
            entries = np.frombuffer(pagemap.read((end - start) // 4096 * 8), dtype=np.uint64)
            out.append(entries[(entries & present) != 0] & pfn_mask)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)
