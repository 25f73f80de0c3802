"""What a killed launcher leaves behind, removed by the next one.

`epd serve` (the stack) keeps two things outside its processes, and removes both when it stops:
its files directory (`epd-stack-<pid>-<random>` in the temp directory, 0700: the internal secret,
the API keys) and its threads board (`epd-threads-of-<pid>-<random>.board` in /dev/shm, named
after the files directory). A launcher killed with SIGKILL (or by the OOM killer) cannot, and its
services end with it (PDEATHSIG), so nothing else would: the secret would stay on disk, and
/dev/shm (RAM) would fill one board per killed stack.

The next launcher that uses the same temp directory removes every such directory of this user
whose launcher no longer runs, and each one's board with it. Only with it: /dev/shm is one per
machine while temp directories are not (a test's own TMPDIR, another session's), and a launcher
that swept every dead launcher's board removed the board of a stack killed a moment ago under
another temp directory, before the launcher of that directory came to it. A launcher "no longer
runs" when its pid does not, or runs a process started after the entry was made (the pid was
reused: Linux's pids wrap at 32768 by default). Leaving a file is safe, removing a live stack's
is not, so where the start time cannot be read a running pid keeps its entry.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable

log = logging.getLogger(__name__)

_PID = re.compile(r"(\d+)-")
"""The launcher's pid right after the prefix: `<pid>-<random>`."""

_LEGACY_BOARD = re.compile(r"(\d+)\.board$")
"""A board named by the launcher's pid alone (`epd-threads-<pid>.board`, before boards were named
after their files directory): swept by the pid rule wherever it is."""

STARTED_AFTER_SLACK_S = 2.0
"""A process that started this much after an entry was made cannot be the launcher that made it
(the launcher makes its entries after it started; the boot time that start times count from is
read in whole seconds)."""


def launcher_runs(pid: int, made_at_s: float | None = None) -> bool:
    """Whether the launcher with `pid` that made an entry at `made_at_s` (epoch seconds; None:
    unknown) still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    if made_at_s is not None and (started := process_start_s(pid)) is not None:
        return started <= made_at_s + STARTED_AFTER_SLACK_S
    return True


def process_start_s(pid: int) -> float | None:
    """When `pid` started, in epoch seconds, from /proc (Linux); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open("/proc/stat", "rb") as f:
            boot_s = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, StopIteration, ValueError):
        return None
    # Field 22, after the command name in parentheses (which may itself hold spaces or parentheses).
    fields = stat[stat.rindex(b")") + 2 :].split()
    return boot_s + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def remove_dead_stacks(
    temp_directory: str,
    stack_prefix: str,
    board_directory: str,
    board_name: Callable[[str], str],
    legacy_board_prefix: str,
) -> list[str]:
    """Remove the files directories `stack_prefix<pid>-<random>` of `temp_directory` that this
    user owns and whose launcher no longer runs, each with its board, `board_name("<pid>-<random>")`
    in `board_directory`, and the boards `legacy_board_prefix<pid>.board` there of dead pids (older
    launchers'); returns the paths removed."""
    removed = remove_dead_launchers_entries(temp_directory, stack_prefix)
    for directory in list(removed):
        board = os.path.join(board_directory, board_name(os.path.basename(directory)[len(stack_prefix) :]))
        try:
            os.unlink(board)
        except OSError:  # none (killed before it made one), or gone meanwhile
            continue
        removed.append(board)
    removed += remove_dead_launchers_entries(board_directory, legacy_board_prefix, _LEGACY_BOARD)
    if removed:
        log.info("removed what stopped launchers left: %s", ", ".join(removed))
    return removed


def remove_dead_launchers_entries(directory: str, prefix: str, name: re.Pattern[str] = _PID) -> list[str]:
    """Remove the entries `prefix<pid>...` of `directory` (the rest of the name matching `name`)
    that this user owns and whose launcher no longer runs; returns their paths. Symbolic links are
    never followed or removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix) or entry.is_symlink():
            continue
        match = name.match(entry.name, len(prefix))
        try:
            if match is None or (stat := entry.stat(follow_symlinks=False)).st_uid != os.getuid():
                continue
            # Made at: the entry's last status change, a bound no earlier than its creation.
            if launcher_runs(int(match.group(1)), min(stat.st_ctime, stat.st_mtime)):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError as exc:  # gone meanwhile, or not ours to remove
            log.debug("left %s: %s", entry.path, exc)
            continue
        removed.append(entry.path)
    return removed
