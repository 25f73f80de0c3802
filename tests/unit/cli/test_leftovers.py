"""epd/cli/leftovers.py: what a killed launcher left is removed, and nothing else."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from epd.cli.leftovers import (
    launcher_runs,
    process_start_s,
    remove_dead_launchers_entries,
    remove_dead_stacks,
)
from epd.model_runtime.threads import stack_board_name


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: its pid runs no more (until the system reuses it)
    return proc.pid


def test_only_this_prefix_s_entries_of_launchers_that_no_longer_run_are_removed(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    assert not launcher_runs(dead) and launcher_runs(alive)
    dead_dir = tmp_path / f"epd-stack-{dead}-abc123"
    dead_dir.mkdir()
    (dead_dir / "internal-secret").write_bytes(b"s")
    kept = [
        tmp_path / f"epd-stack-{alive}-def456",  # a running launcher's
        tmp_path / f"epd-stacks-{dead}-x",  # another prefix
        tmp_path / f"epd-stack-{dead}",  # not the launcher's name shape
        tmp_path / f"epd-stack-{dead}.board",  # nor this
        tmp_path / "epd-stack-abc-1",  # no pid
    ]
    for path in kept:
        path.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / f"epd-stack-{dead}-link"
    link.symlink_to(target, target_is_directory=True)

    removed = remove_dead_launchers_entries(str(tmp_path), "epd-stack-")

    assert removed == [str(dead_dir)] and not dead_dir.exists()
    assert all(path.exists() for path in kept)
    assert link.is_symlink() and target.is_dir()


def test_a_missing_directory_removes_nothing(tmp_path):
    assert remove_dead_launchers_entries(str(tmp_path / "absent"), "epd-stack-") == []


def _stack(temp_dir, board_dir, stack_id: str) -> tuple:
    """A launcher's files directory (with its secret) and the threads board named after it."""
    files = temp_dir / f"epd-stack-{stack_id}"
    files.mkdir()
    (files / "internal-secret").write_bytes(b"s")
    board = board_dir / stack_board_name(stack_id)
    board.write_bytes(b"\0\0\0")
    return files, board


def test_a_dead_stacks_board_goes_with_its_files_directory_and_only_with_it(tmp_path):
    """/dev/shm is the machine's, temp directories are not: a launcher removes the board of a dead
    stack whose files directory is in its own temp directory, never one of another temp directory's
    stack (swept machine-wide, a board a stack killed a moment ago under another TMPDIR had just
    left was gone before that directory's next launcher came to it)."""
    temp_dir, other_temp_dir, board_dir = tmp_path / "tmp", tmp_path / "other-tmp", tmp_path / "shm"
    for d in (temp_dir, other_temp_dir, board_dir):
        d.mkdir()
    dead, alive = _dead_pid(), os.getpid()
    dead_here = _stack(temp_dir, board_dir, f"{dead}-abc123")
    dead_elsewhere = _stack(other_temp_dir, board_dir, f"{dead}-def456")
    running_here = _stack(temp_dir, board_dir, f"{alive}-ghi789")
    legacy_board = board_dir / f"epd-threads-{dead}.board"  # named by the pid alone, by older launchers
    legacy_board.write_bytes(b"\0\0\0")

    # Launchers of older versions swept `epd-threads-<dead pid>-...` or `.board` machine-wide: not this name.
    older_launchers_rule = re.compile(r"(\d+)(?:-|\.board$)")
    assert remove_dead_launchers_entries(str(board_dir), "epd-threads-", older_launchers_rule) == [
        str(legacy_board)
    ]
    legacy_board.write_bytes(b"\0\0\0")

    removed = remove_dead_stacks(
        str(temp_dir), "epd-stack-", str(board_dir), stack_board_name, "epd-threads-"
    )

    assert sorted(removed) == sorted(map(str, [*dead_here, legacy_board]))
    assert all(path.exists() for path in [*dead_elsewhere, *running_here])
    # That temp directory's next launcher takes them.
    assert sorted(
        remove_dead_stacks(
            str(other_temp_dir), "epd-stack-", str(board_dir), stack_board_name, "epd-threads-"
        )
    ) == sorted(map(str, dead_elsewhere))


def test_a_pid_reused_by_a_younger_process_does_not_keep_a_dead_launchers_entries(tmp_path):
    """Pids wrap (at 32768 by default): an entry whose pid runs a process that started after the
    entry was made is a dead launcher's. The entry's time is its mtime set back here (this process,
    the "reused" pid, started after it), the newest bound a real entry has."""
    mine = os.getpid()
    started = process_start_s(mine)
    assert started is not None and abs(started - time.time()) < 24 * 3600
    old = tmp_path / f"epd-stack-{mine}-old111"
    old.mkdir()
    os.utime(old, (started - 60, started - 60))
    current = tmp_path / f"epd-stack-{mine}-new222"
    current.mkdir()
    assert not launcher_runs(mine, started - 60) and launcher_runs(mine, time.time())

    assert remove_dead_launchers_entries(str(tmp_path), "epd-stack-") == [str(old)]
    assert current.exists()
