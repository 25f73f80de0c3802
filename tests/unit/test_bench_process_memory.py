"""The bench's memory readings of a server's process tree (bench/process_tree.py): PSS by kind per
process, the tree's PSS as if nothing outside it mapped its pages, and a reading settled after a
load (`settled`, on made-up readings)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.process_tree import MiB, settled, tree_memory, tree_pss, tree_pss_alone

# A parent that writes 64 MiB of its own and forks a child that shares them (copy on write).
_SHARED_64_MIB = (
    "import os, sys, time\n"
    "buf = bytearray(64 << 20)\n"
    "buf[::4096] = b'\\x01' * (len(buf) // 4096)\n"
    "if os.fork() == 0:\n"
    "    time.sleep(60); os._exit(0)\n"
    "print('ready', flush=True); sys.stdin.readline()\n"
)


@pytest.fixture
def two_sharing():
    proc = subprocess.Popen(
        [sys.executable, "-c", _SHARED_64_MIB], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(30)


def test_memory_by_kind_adds_up_to_the_trees_pss(two_sharing):
    rows = tree_memory(two_sharing)
    assert len(rows) == 2
    for row in rows:
        assert row["anon"] >= 30 * MiB  # its half of the shared 64 MiB at least
        assert row["pss"] == pytest.approx(row["anon"] + row["file"] + row["shmem"], abs=MiB)
    assert sum(r["pss"] for r in rows) == pytest.approx(tree_pss(two_sharing)[0], rel=0.05)


def test_pss_as_if_alone_counts_a_shared_page_once_in_the_tree(two_sharing):
    if os.geteuid() != 0:
        pytest.skip("page frame numbers in /proc/PID/pagemap are for root only")
    alone = tree_pss_alone(two_sharing)
    assert alone is not None and len(alone) == 3  # two processes and the total
    rss = sum(r["rss"] for r in tree_memory(two_sharing)) / MiB
    # the 64 MiB once (not twice, as RSS counts them), plus two interpreters of their own
    assert 64 <= alone["total"] <= rss - 48, (alone, rss)
    assert all(value >= 32 for key, value in alone.items() if key != "total")


class _Readings:
    """Made-up PSS readings, one per call, and the waits asked for between them (none taken)."""

    def __init__(self, values: list[int]):
        self.values, self.num_reads, self.waits_s = values, 0, []

    def read(self) -> int:
        self.num_reads += 1
        return self.values[self.num_reads - 1]

    def sleep(self, seconds: float) -> None:
        self.waits_s.append(seconds)


def test_the_pss_after_a_load_is_read_once_the_idle_release_has_given_memory_back():
    """Two equal reads before the release (the services' first idle tick) do not end the wait; the
    value returned is the released one, once three reads in a row agree."""
    readings = _Readings([1000, 1000, 900, 895, 899, 0])
    assert settled(readings.read, interval_s=0.5, sleep=readings.sleep) == (899, True)
    assert readings.num_reads == 5 and readings.waits_s == [0.5] * 4


def test_a_pss_that_never_settles_is_read_at_most_max_reads_times():
    readings = _Readings([1000 - 50 * i for i in range(20)])
    assert settled(readings.read, max_reads=6, sleep=readings.sleep) == (750, False)
    assert readings.num_reads == 6
