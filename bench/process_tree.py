"""What a server's process tree uses, read with psutil from outside it (the load client's side):
PSS summed over the processes (`tree_pss`, sampled for its peak by `PeakPss`), how many map
tcmalloc, and CPU seconds by role (`tree_cpu_s`; `cpu_by_role` of two snapshots)."""

from __future__ import annotations

import threading
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
            words = " ".join(p.cmdline()).split()  # a forked service's title is one string (setproctitle)
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        role = next(
            (
                f"epd {w}"
                for w, prev in zip(words[1:], words)
                if prev == "serve" and w in ("encoder", "prefill", "decode", "gateway")
            ),
            "",
        )
        if not role:
            role = (
                "epd launcher"
                if "serve" in words and "epd.cli.main" in " ".join(words)
                else (
                    "transformers serve"
                    if "transformers_serve_launcher" in " ".join(words)
                    else Path(words[0]).name
                    if words
                    else "?"
                )
            )
        out[f"{role} ({p.pid})"] = t.user + t.system
    return out


def cpu_by_role(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Core-seconds per role between two `tree_cpu_s` snapshots (processes summed by role)."""
    spent: dict[str, float] = {}
    for key, t in after.items():
        role = key.rsplit(" (", 1)[0]
        spent[role] = spent.get(role, 0.0) + t - before.get(key, 0.0)
    return {role: round(t, 2) for role, t in sorted(spent.items(), key=lambda x: -x[1]) if t >= 0.01}


class PeakPss:
    """Samples tree_pss(pid) every `interval_s` in a thread; .peak is the largest seen."""

    def __init__(self, pid: int, interval_s: float = 1.0):
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss(self.pid)[0])
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakPss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
