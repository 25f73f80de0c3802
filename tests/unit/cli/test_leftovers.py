"""epd/cli/leftovers.py: what a killed launcher left is removed, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys

from epd.cli.leftovers import launcher_runs, remove_dead_launchers_entries


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
    dead_board = tmp_path / f"epd-stack-{dead}.board"
    dead_board.write_bytes(b"\0\0\0")
    kept = [
        tmp_path / f"epd-stack-{alive}-def456",  # a running launcher's
        tmp_path / f"epd-stacks-{dead}-x",  # another prefix
        tmp_path / f"epd-stack-{dead}",  # not the launcher's name shape
        tmp_path / "epd-stack-abc-1",  # no pid
    ]
    for path in kept:
        path.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / f"epd-stack-{dead}-link"
    link.symlink_to(target, target_is_directory=True)

    removed = remove_dead_launchers_entries(str(tmp_path), "epd-stack-")

    assert sorted(removed) == sorted([str(dead_dir), str(dead_board)])
    assert not dead_dir.exists() and not dead_board.exists()
    assert all(path.exists() for path in kept)
    assert link.is_symlink() and target.is_dir()


def test_a_missing_directory_removes_nothing(tmp_path):
    assert remove_dead_launchers_entries(str(tmp_path / "absent"), "epd-stack-") == []
