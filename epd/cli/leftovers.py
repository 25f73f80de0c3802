"""What a killed launcher leaves behind, removed by the next one.

`epd serve` (the stack) keeps two things outside its processes, and removes both when it stops:
its files directory (`epd-stack-<pid>-*` in the temp directory, 0700: the internal secret, the
API keys) and its threads board (`epd-threads-<pid>.board` in /dev/shm). A launcher killed with
SIGKILL (or by the OOM killer) cannot, and its services end with it (PDEATHSIG), so nothing else
would: the secret would stay on disk, and /dev/shm (RAM) would fill one board per killed stack.
The next launcher removes every such entry of this user whose launcher pid no longer runs. A pid
that runs again (reused) keeps its entry: leaving a file is safe, removing a live stack's is not.
"""

from __future__ import annotations

import logging
import os
import re
import shutil

log = logging.getLogger(__name__)

_PID = re.compile(r"(\d+)(?:-|\.board$)")
"""The launcher's pid right after the prefix: `<pid>-<random>` (a directory), `<pid>.board`."""


def launcher_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


def remove_dead_launchers_entries(directory: str, prefix: str) -> list[str]:
    """Remove the entries `prefix<pid>...` of `directory` that this user owns and whose pid no
    longer runs; returns their paths. Symbolic links are never followed or removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix) or entry.is_symlink():
            continue
        match = _PID.match(entry.name, len(prefix))
        try:
            if match is None or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if launcher_runs(int(match.group(1))):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError as exc:  # gone meanwhile, or not ours to remove
            log.debug("left %s: %s", entry.path, exc)
            continue
        removed.append(entry.path)
    if removed:
        log.info("removed what stopped launchers left: %s", ", ".join(removed))
    return removed
